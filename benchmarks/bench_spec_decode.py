"""Speculative decoding on SmolLM2-135M (CPU): acceptance, tokens per forward, speedup.

    python benchmarks/bench_spec_decode.py
    python benchmarks/bench_spec_decode.py --model tiny-llama --num-requests 2

One workload, input-grounded on purpose (the model is asked to repeat, edit
or summarise a text it was given, so its output reuses the input's n-grams),
run in one process by three engines that differ only in speculation:

* no speculation         one token per request per forward
* n-gram prompt lookup   k tokens copied from an earlier occurrence of the suffix
* truncated draft        the target's first layers (weights shared) sample k tokens

Each run is greedy, so all three produce the same tokens (checked); what
changes is how many target forwards that takes and the wall-clock time.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_model

TEXT = (
    "The KV cache stores the keys and values of every token a request has seen, so that each new "
    "token only computes attention for itself. A paged KV cache cuts this memory into fixed-size "
    "blocks, and a block table maps each request's logical blocks to physical ones. Because blocks "
    "are allocated on demand, memory is not reserved for tokens that are never generated, and "
    "requests of very different lengths can share one pool without fragmentation."
)
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text, replacing 'blocks' with 'pages' and changing nothing else:\n\n{text}",
    "Copy the following paragraph, then add one sentence at the end:\n\n{text}",
    "Summarise the following text in two sentences, reusing its wording:\n\n{text}",
]


def run(loaded, prompts, max_tokens: int, **spec) -> dict:
    engine = LLMEngine(EngineConfig(model=loaded.name, block_size=16, num_blocks=1024,
                                    max_num_batched_tokens=1024, **spec), loaded=loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs, steps, drafted, accepted, seq_forwards = {}, 0, 0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
        for out in result.outputs:
            if out.finished:
                outputs[out.request_id] = out
    secs = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    seq_forwards = sum(o.metrics.num_sampling_steps for o in outputs.values())
    return dict(secs=secs, steps=steps, tokens=tokens, drafted=drafted, accepted=accepted,
                per_forward=tokens / seq_forwards,
                token_ids=[outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=4, help="requests in the batch (cycling over the tasks)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="tokens proposed per step")
    ap.add_argument("--draft-layers", default="8,20,26", help="layers of the truncated drafts to try (comma separated)")
    args = ap.parse_args()

    loaded = load_model(args.model)
    prompts = []
    for i in range(args.num_requests):
        task = TASKS[i % len(TASKS)].format(text=TEXT)
        if loaded.tokenizer is not None and getattr(loaded.tokenizer, "chat_template", None):
            task = loaded.tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                                        add_generation_prompt=True)
        prompts.append(task)
    run(loaded, prompts[:1], 4)                                   # warm-up
    print(f"model {args.model}, {len(prompts)} requests, up to {args.max_tokens} tokens each, greedy, "
          f"k = {args.k}, torch threads {torch.get_num_threads()}")
    base = run(loaded, prompts, args.max_tokens)
    rows = [("no speculation", base)]
    variants = [("n-gram lookup", dict(speculative_method="ngram", num_speculative_tokens=args.k,
                                       ngram_min=1, ngram_max=4))]
    for n in (int(x) for x in args.draft_layers.split(",")):
        variants.append((f"truncated draft ({n} of {loaded.model.num_layers} layers)",
                         dict(speculative_method="draft", num_speculative_tokens=args.k, draft_num_layers=n)))
    for name, spec in variants:
        result = run(loaded, prompts, args.max_tokens, **spec)
        assert result["token_ids"] == base["token_ids"], f"{name}: greedy output changed"
        rows.append((name, result))
    print(f"\n{'':36s} {'time':>8s} {'tok/s':>8s} {'steps':>6s} {'accept':>7s} {'tok/fwd':>8s} {'speedup':>8s}")
    for name, r in rows:
        rate = f"{r['accepted'] / r['drafted']:.0%}" if r["drafted"] else "-"
        print(f"{name:36s} {r['secs']:7.2f}s {r['tokens'] / r['secs']:8.1f} {r['steps']:6d} {rate:>7s} "
              f"{r['per_forward']:8.2f} {base['secs'] / r['secs']:7.2f}x")
    print("\naccept = accepted / drafted tokens; tok/fwd = tokens per target forward per request; "
          "outputs identical in every run")
    for i in range(min(2, len(prompts))):
        print(f"\noutput {i}: {loaded.tokenizer.decode(base['token_ids'][i])[:300]!r}" if loaded.tokenizer else "")


if __name__ == "__main__":
    main()
