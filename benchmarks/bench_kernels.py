"""GPU benchmark of the Triton kernels and of the engine end to end (ready to run on a CUDA machine).

    python benchmarks/bench_kernels.py                 # on a GPU: decode and prefill sweeps + end to end
    python benchmarks/bench_kernels.py --only decode   # one part: decode, prefill or e2e (several allowed)
    python benchmarks/bench_kernels.py --smoke         # anywhere: tiny shapes, CPU interpreter, checks the script

1. Decode attention: for context lengths 256..32k and batch sizes 1..64, the
   Triton paged decode kernel (K/V read through shuffled block tables) against
   a device-to-device copy of the same K/V (what the memory can do at that
   size: bytes read plus bytes written, divided by time) and against torch
   `scaled_dot_product_attention` on the same K/V stored contiguously. Prints
   time, achieved bandwidth (bytes of K/V + q + out that must be read or
   written, divided by time), its fraction of the copy's and of the device's
   peak, and SDPA's time.
2. Prefill over a cached prefix: a chunk of 512 new queries per sequence after
   prefixes of 0..16k tokens, 1 and 8 sequences, the Triton prefill kernel
   against SDPA with a bottom-right causal mask on contiguous K/V: time and
   TFLOP/s (the causal half only).
3. End to end: output tokens/s of nanoserve (attention_backend="triton"), with
   CUDA graphs for decode steps and without (enforce_eager=True), and of
   Hugging Face `generate` with padded static batches, 64 concurrent
   requests, on GPT-2-small-sized and SmolLM2-135M-sized models (random
   weights with the real shapes: throughput does not depend on the values).

Targets from the issue: decode kernel >= 70 % of peak bandwidth at long
contexts; end to end >= 3x HF padded-batch generate at 64 requests.
"""

from __future__ import annotations

import argparse
import os
import random
import time

PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}   # HBM bandwidth, GB/s (SXM parts)


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs, after a warm-up."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def decode_sweep(args, device: str, peak: float | None) -> None:
    import torch

    dtype = torch.float16 if device == "cuda" else torch.float32
    hq, hkv, d, bs = (32, 8, 128, 16) if not args.smoke else (4, 2, 16, 4)
    contexts = [256, 1024, 4096, 16384, 32768] if not args.smoke else [16, 40]
    batches = [1, 8, 32, 64] if not args.smoke else [1, 3]
    print(f"\ndecode attention: {hq} query heads, {hkv} KV heads, head_dim {d}, block_size {bs}, {dtype}")
    print(f"{'batch':>5} {'context':>7} {'triton':>9} {'GB/s':>7} {'of copy':>7} {'of peak':>7} {'copy GB/s':>9} "
          f"{'sdpa':>9} {'speed':>6}  max|diff|")
    for batch in batches:
        for ctx in contexts:
            if batch * ctx * hkv * d * 2 * 2 * 3 > 0.5 * (torch.cuda.mem_get_info()[0] if device == "cuda" else 2**32):
                continue   # K/V three times (paged, contiguous, the copy's target) must fit comfortably
            measure_decode(args, device, peak, dtype, batch, ctx, hq, hkv, d, bs)


def measure_decode(args, device, peak, dtype, batch, ctx, hq, hkv, d, bs) -> None:
    """One row of the sweep (a function, so its tensors are freed before the next row)."""
    import torch
    import torch.nn.functional as F

    from nanoserve.kernels.triton_decode import decode_attention

    nb = ctx // bs
    k_cache = torch.randn(batch * nb, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * nb, device=device).view(batch, nb)     # scattered blocks
    seq_lens = torch.full((batch,), ctx, device=device)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    # The same K/V stored contiguously per sequence, for SDPA.
    k = k_cache[tables].view(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    v = v_cache[tables].view(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    # Same numbers first: the kernel (reading through the shuffled tables) against SDPA on the copies.
    err = (decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
           - F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)).abs().max().item()
    assert err < 1e-2, f"decode kernel differs from SDPA by {err} (batch {batch}, context {ctx})"
    t_tri = timed(lambda: decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5), device, args.repeats)
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True),
                   device, args.repeats)
    k_copy, v_copy = torch.empty_like(k_cache), torch.empty_like(v_cache)
    t_copy = timed(lambda: (k_copy.copy_(k_cache), v_copy.copy_(v_cache)), device, args.repeats)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    moved = kv_bytes + 2 * q.numel() * q.element_size()
    bw_tri, bw_copy = moved / t_tri / 1e9, 2 * kv_bytes / t_copy / 1e9     # a copy reads and writes every byte
    frac = f"{bw_tri / peak:7.0%}" if peak else "      -"
    print(f"{batch:5d} {ctx:7d} {t_tri * 1e6:7.0f}us {bw_tri:7.0f} {bw_tri / bw_copy:7.0%} {frac} {bw_copy:9.0f} "
          f"{t_sdpa * 1e6:7.0f}us {t_sdpa / t_tri:5.2f}x  {err:.1e}")


def prefill_sweep(args, device: str) -> None:
    import torch

    dtype = torch.float16 if device == "cuda" else torch.float32
    hq, hkv, d, bs = (32, 8, 128, 16) if not args.smoke else (4, 2, 16, 4)
    chunk = 512 if not args.smoke else 8
    prefixes = [0, 1024, 4096, 16384] if not args.smoke else [0, 12]
    print(f"\nprefill over a cached prefix: chunks of {chunk} queries, {hq} query heads, {hkv} KV heads, "
          f"head_dim {d}, block_size {bs}, {dtype}")
    print(f"{'seqs':>5} {'prefix':>7} {'triton':>10} {'TFLOP/s':>8} {'sdpa':>10} {'TFLOP/s':>8} {'speed':>6}  max|diff|")
    for seqs in ([1, 8] if not args.smoke else [1, 2]):
        for prefix in prefixes:
            measure_prefill(args, device, dtype, seqs, prefix, chunk, hq, hkv, d, bs)


def measure_prefill(args, device, dtype, seqs, prefix, chunk, hq, hkv, d, bs) -> None:
    """One row: `seqs` chunks of `chunk` queries, each after `prefix` cached tokens of its own sequence."""
    import torch
    import torch.nn.functional as F

    from nanoserve.kernels.triton_prefill import prefill_attention

    ctx = prefix + chunk
    nb = -(-ctx // bs)
    k_cache = torch.randn(seqs * nb, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(seqs * nb, device=device).view(seqs, nb)
    q = torch.randn(seqs * chunk, hq, d, dtype=dtype, device=device)
    starts = torch.arange(seqs, device=device) * chunk
    q_lens = torch.full((seqs,), chunk, device=device)
    ctx_lens = torch.full((seqs,), ctx, device=device)
    run = lambda: prefill_attention(q, k_cache, v_cache, tables, starts, q_lens, ctx_lens, d**-0.5,  # noqa: E731
                                    max_query_len=chunk)
    # SDPA on contiguous copies: query i of a chunk sees keys 0 .. prefix + i (bottom-right causal).
    k = k_cache[tables].view(seqs, nb * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v = v_cache[tables].view(seqs, nb * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    qs = q.view(seqs, chunk, hq, d).transpose(1, 2)
    mask = torch.ones(chunk, ctx, dtype=torch.bool, device=device).tril(prefix)
    sdpa = lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    err = (run().view(seqs, chunk, hq, d).transpose(1, 2) - sdpa()).abs().max().item()
    assert err < 1e-2, f"prefill kernel differs from SDPA by {err} ({seqs} sequences, prefix {prefix})"
    t_tri, t_sdpa = timed(run, device, args.repeats), timed(sdpa, device, args.repeats)
    flops = 4 * seqs * hq * chunk * (prefix + (chunk + 1) / 2) * d       # QK^T and PV over the visible keys
    print(f"{seqs:5d} {prefix:7d} {t_tri * 1e6:8.0f}us {flops / t_tri / 1e12:8.1f} {t_sdpa * 1e6:8.0f}us "
          f"{flops / t_sdpa / 1e12:8.1f} {t_sdpa / t_tri:5.2f}x  {err:.1e}")


def end_to_end(args, device: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from nanoserve import EngineConfig, LLMEngine, SamplingParams
    from nanoserve.models.loader import LoadedModel, build_from_hf

    configs = {
        "gpt2-small-sized": GPT2Config(),
        "smollm2-135m-sized": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          max_position_embeddings=8192, tie_word_embeddings=True),
    }
    if args.smoke:
        configs = {"tiny": LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)}
    n_req = args.num_requests
    dtype = torch.float16 if device == "cuda" else torch.float32
    for name, cfg in configs.items():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
        rng = random.Random(0)
        reqs = [([rng.randrange(cfg.vocab_size) for _ in range(rng.randint(*args.prompt_len))],
                 rng.randint(*args.output_len)) for _ in range(n_req)]
        useful = sum(n for _, n in reqs)

        loaded = LoadedModel(build_from_hf(hf).to(device=device, dtype=dtype).eval(), None, None, name, None)
        got: dict[bool, dict[int, list[int]]] = {}     # enforce_eager -> nanoserve's tokens by request index
        hf_got: dict[int, list[int]] = {}

        def run_nanoserve(engine, tokens: dict, replayed: list) -> None:
            """All requests to the end; tokens by request index, and how many steps replayed a graph."""
            ids = {f"{time.perf_counter_ns()}-{i}": i for i in range(len(reqs))}
            for rid, i in ids.items():
                engine.add_request(rid, reqs[i][0], SamplingParams(max_tokens=reqs[i][1], temperature=0,
                                                                   ignore_eos=True))
            replayed.append(0)
            while engine.has_unfinished_requests():
                result = engine.step()
                replayed[-1] += result.stats.graph_bucket > 0
                for out in result.outputs:
                    if out.finished:
                        tokens[ids[out.request_id]] = out.outputs[0].token_ids

        def measure(eager: bool) -> tuple[float, float, int]:
            """(seconds for the workload, start-up seconds, steps that replayed a graph) of one engine."""
            t0 = time.perf_counter()
            engine = LLMEngine(EngineConfig(model=name, device=device, dtype=str(dtype).split(".")[1],
                                            attention_backend="triton", block_size=16, num_blocks=args.num_blocks,
                                            max_num_seqs=n_req, max_num_batched_tokens=2048,
                                            max_model_len=args.max_model_len, enforce_eager=eager), loaded=loaded)
            start, replayed = time.perf_counter() - t0, []
            seconds = timed(lambda: run_nanoserve(engine, got.setdefault(eager, {}), replayed), device, 1)
            return seconds, start, replayed[-1]

        @torch.inference_mode()
        def run_hf():
            width = max(len(p) for p, _ in reqs)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs], device=device)
            new = max(n for _, n in reqs)
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            hf_got.update({i: gen[i, width : width + n].tolist() for i, (_, n) in enumerate(reqs)})

        print(f"\nend to end, {name}, {n_req} requests, {useful} output tokens:")
        times = {}
        for eager in (True, False):
            times[eager], start, replayed = measure(eager)
            label = "eager (enforce_eager)" if eager else "CUDA graphs" if device == "cuda" else "padded, uncaptured"
            print(f"  nanoserve, {label:22s} {useful / times[eager]:9.1f} tok/s   (start-up {start:.1f} s, "
                  f"{replayed} steps replayed a graph)")
        t_hf = timed(run_hf, device, 1)
        print(f"  HF padded static batch            {useful / t_hf:9.1f} tok/s")
        print(f"  graphs / eager                    {times[True] / times[False]:9.2f}x")
        print(f"  graphs / HF                       {t_hf / times[False]:9.2f}x")
        same = sum(got[False][i] == hf_got[i] for i in range(len(reqs)))
        same_eager = sum(got[False][i] == got[True][i] for i in range(len(reqs)))
        print(f"  greedy tokens: graphs = eager in {same_eager}/{len(reqs)} requests, = HF in {same}/{len(reqs)} "
              f"({dtype}: near-ties may flip)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--max-model-len", type=int, default=512, help="engine setting: sizes the graphs' tables")
    ap.add_argument("--only", nargs="+", choices=["decode", "prefill", "e2e"], default=["decode", "prefill", "e2e"])
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
        args.repeats, args.num_requests, args.num_blocks = 1, 3, 64
        args.prompt_len, args.output_len, args.max_model_len = (3, 8), (2, 4), 32
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    peak = None
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
        print(f"device: {name}, peak HBM bandwidth {peak or 'unknown'} GB/s, torch {torch.__version__}")
    else:
        print("device: CPU (smoke run under the Triton interpreter: timings mean nothing)")
    if "decode" in args.only:
        decode_sweep(args, device, peak)
    if "prefill" in args.only:
        prefill_sweep(args, device)
    if "e2e" in args.only and not args.skip_e2e:
        end_to_end(args, device)


if __name__ == "__main__":
    main()
