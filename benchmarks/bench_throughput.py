"""Throughput: nanoserve vs Hugging Face `generate` on the same workload, in one process.

    python benchmarks/bench_throughput.py                    # SmolLM2-135M, 32 requests
    python benchmarks/bench_throughput.py --model tiny-llama --num-requests 16

The workload: N requests with random prompts of 16-256 tokens and output
lengths of 32-128 tokens (fixed per request, EOS ignored, so every system
generates exactly the same number of useful tokens). Three systems run it:

* HF one at a time   `generate` per request, batch size 1
* HF static batches  `generate` on padded batches of B requests (left padding);
                     a batch runs until its longest request is done, so short
                     requests' seats sit idle: that waste is what continuous
                     batching removes
* nanoserve          all requests added at once, stepped until done

It prints output tokens/s for each and the ratios against nanoserve.
Only useful tokens count (a padded batch's tokens past a request's length do not).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_hf, load_model


def workload(n: int, vocab: int, seed: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))]
        reqs.append((prompt, rng.randint(32, 128)))
    return reqs


@torch.inference_mode()
def hf_batched(hf, reqs, batch_size: int, pad_id: int) -> float:
    """Padded static batches of `batch_size`; returns seconds."""
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    eos_token_id=None, pad_token_id=pad_id)
    return time.perf_counter() - t0


def nanoserve_run(loaded, reqs, args) -> tuple[float, int]:
    engine = LLMEngine(EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens), loaded=loaded)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--batch-sizes", default="8,32", help="HF static batch sizes to try (comma separated)")
    ap.add_argument("--skip-single", action="store_true", help="skip HF one-at-a-time (the slowest part)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model)
    if loaded.path is None:   # tiny models: build the same random weights for HF
        from nanoserve.models.loader import tiny_hf_config
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(tiny_hf_config(args.model))
        loaded = load_model(args.model, seed=0)
    else:
        hf = load_hf(loaded.path)[0]
    hf = hf.eval()
    reqs = workload(args.num_requests, hf.config.vocab_size, args.seed)
    useful = sum(n for _, n in reqs)
    print(f"model {args.model}, {len(reqs)} requests, prompts {min(len(p) for p, _ in reqs)}-"
          f"{max(len(p) for p, _ in reqs)} tokens, outputs {min(n for _, n in reqs)}-{max(n for _, n in reqs)} "
          f"tokens ({useful} in all), torch threads {torch.get_num_threads()}")

    # Warm up both (first calls allocate and pick kernels).
    hf_batched(hf, reqs[:2], 2, 0)
    nanoserve_run(loaded, [(p, 4) for p, _ in reqs[:2]], args)

    results = {}
    secs, steps = nanoserve_run(loaded, reqs, args)
    results["nanoserve"] = secs
    print(f"{'nanoserve':28s} {secs:8.2f} s  {useful / secs:8.1f} tok/s  ({steps} steps)")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        secs = hf_batched(hf, reqs, b, 0)
        results[f"HF static batch {b}"] = secs
        print(f"{'HF static batch ' + str(b):28s} {secs:8.2f} s  {useful / secs:8.1f} tok/s")
    if not args.skip_single:
        secs = hf_batched(hf, reqs, 1, 0)
        results["HF one at a time"] = secs
        print(f"{'HF one at a time':28s} {secs:8.2f} s  {useful / secs:8.1f} tok/s")
    print("\nspeedup of nanoserve (tokens/s ratio):")
    for name, secs in results.items():
        if name != "nanoserve":
            print(f"  vs {name:26s} {secs / results['nanoserve']:.2f}x")


if __name__ == "__main__":
    main()
