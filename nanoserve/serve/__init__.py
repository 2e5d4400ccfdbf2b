"""nanoserve serve: an OpenAI-compatible HTTP server around one engine, watchable live.

    nanoserve serve --model smollm2                  (http://127.0.0.1:8000)
    nanoserve tui --attach http://127.0.0.1:8000     (watch it)

The modules, one concept each:

    app.py            the FastAPI app: routes for watching, auth, lifespan
    errors.py         every error as an OpenAI-shaped body, the framework's own included
    openai_routes.py  /v1/models, /v1/completions (batches of prompts), /v1/chat/completions (streaming or not)
    vllm_routes.py    vLLM's routes beside the OpenAI API: /tokenize, /detokenize, /tokenizer_info, /version,
                      /reset_prefix_cache
    protocol.py       request bodies (pydantic) and ApiError, the OpenAI-style error
    unsupported.py    the fields refused with a 400 rather than ignored (vLLM extras nanoserve has no use for)
    structured.py     structured output's request fields (response_format, guided_*) -> structured_outputs
    grammars.py       their grammars compiled off the engine thread: size limits, a deadline, unsatisfiable -> 400
    responses.py      engine outputs as OpenAI JSON and stream chunks (echo, prompt log-probabilities)
    engine_loop.py    the thread that owns the engine; queues to and from the handlers
    event_stream.py   GET /events: the engine's events as server-sent events (trace lines)
    clients.py        who is connected (the TUI's clients panel)
    metrics.py        GET /metrics in Prometheus' format
    limits.py         what one client may take: body size, time to send headers and body
    listener.py       the listening socket (TCP_NODELAY) and uvicorn's settings
    background.py     a server on a loopback port in a thread (tests, lessons, benchmarks)
    command.py        the `nanoserve serve` command line

Importing `nanoserve` never imports this package (or FastAPI); `nanoserve serve` does.
"""
