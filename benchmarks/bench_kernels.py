"""GPU benchmark of the Triton kernels and of the engine end to end (ready to run on a CUDA machine).

    python benchmarks/bench_kernels.py                 # on a GPU: decode kernel sweep + end to end
    python benchmarks/bench_kernels.py --smoke         # anywhere: tiny shapes, CPU interpreter, checks the script

1. Decode attention: for context lengths 256..32k and batch sizes 1..64, the
   Triton paged decode kernel (K/V read through shuffled block tables) against
   torch `scaled_dot_product_attention` on the same K/V stored contiguously.
   Prints time, achieved bandwidth (bytes of K/V + q + out that must be read
   or written, divided by time) and its fraction of the device's peak.
2. End to end: output tokens/s of nanoserve (attention_backend="triton") and
   of Hugging Face `generate` with padded static batches, 64 concurrent
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
    batches = [1, 8, 64] if not args.smoke else [1, 3]
    print(f"\ndecode attention: {hq} query heads, {hkv} KV heads, head_dim {d}, block_size {bs}, {dtype}")
    print(f"{'batch':>5} {'context':>7} {'triton':>9} {'GB/s':>8} {'of peak':>8} {'sdpa':>9} {'GB/s':>8} {'ratio':>6}  max|diff|")
    for batch in batches:
        for ctx in contexts:
            if batch * ctx * hkv * d * 2 * 2 * 2 > 0.5 * (torch.cuda.mem_get_info()[0] if device == "cuda" else 2**32):
                continue   # K/V twice (paged and contiguous) must fit comfortably
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
    moved = 2 * batch * ctx * hkv * d * k_cache.element_size() + 2 * q.numel() * q.element_size()
    bw_tri, bw_sdpa = moved / t_tri / 1e9, moved / t_sdpa / 1e9
    frac = f"{bw_tri / peak:7.0%}" if peak else "      -"
    print(f"{batch:5d} {ctx:7d} {t_tri * 1e6:7.0f}us {bw_tri:8.0f} {frac} {t_sdpa * 1e6:7.0f}us "
          f"{bw_sdpa:8.0f} {t_sdpa / t_tri:5.2f}x  {err:.1e}")


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
        engine = LLMEngine(EngineConfig(model=name, device=device, dtype=str(dtype).split(".")[1],
                                        attention_backend="triton", block_size=16, num_blocks=args.num_blocks,
                                        max_num_seqs=n_req, max_num_batched_tokens=2048), loaded=loaded)

        got: dict[int, list[int]] = {}       # nanoserve's tokens by request index (the last run's)
        hf_got: dict[int, list[int]] = {}

        def run_nanoserve():
            ids = {f"{time.perf_counter_ns()}-{i}": i for i in range(len(reqs))}
            for rid, i in ids.items():
                engine.add_request(rid, reqs[i][0], SamplingParams(max_tokens=reqs[i][1], temperature=0,
                                                                   ignore_eos=True))
            while engine.has_unfinished_requests():
                for out in engine.step().outputs:
                    if out.finished:
                        got[ids[out.request_id]] = out.outputs[0].token_ids

        @torch.inference_mode()
        def run_hf():
            width = max(len(p) for p, _ in reqs)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs], device=device)
            new = max(n for _, n in reqs)
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            hf_got.update({i: gen[i, width : width + n].tolist() for i, (_, n) in enumerate(reqs)})

        t_ns = timed(run_nanoserve, device, 1)
        t_hf = timed(run_hf, device, 1)
        print(f"\nend to end, {name}, {n_req} requests, {useful} output tokens:")
        print(f"  nanoserve (triton)      {useful / t_ns:9.1f} tok/s")
        print(f"  HF padded static batch  {useful / t_hf:9.1f} tok/s")
        print(f"  ratio                   {t_hf / t_ns:9.2f}x")
        same = sum(got[i] == hf_got[i] for i in range(len(reqs)))
        print(f"  greedy tokens identical to HF's: {same}/{len(reqs)} requests ({dtype}: near-ties may flip)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
        args.repeats, args.num_requests, args.num_blocks = 1, 3, 64
        args.prompt_len, args.output_len = (3, 8), (2, 4)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    peak = None
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
        print(f"device: {name}, peak HBM bandwidth {peak or 'unknown'} GB/s, torch {torch.__version__}")
    else:
        print("device: CPU (smoke run under the Triton interpreter: timings mean nothing)")
    decode_sweep(args, device, peak)
    if not args.skip_e2e:
        end_to_end(args, device)


if __name__ == "__main__":
    main()
