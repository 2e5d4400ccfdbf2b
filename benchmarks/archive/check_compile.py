"""Does torch.compile (Inductor's CPU backend) pay for nanoserve's model forward? Compile time and speed.

    python benchmarks/archive/check_compile.py                 # SmolLM2-135M's layer shapes, float32
    python benchmarks/archive/check_compile.py --dtype bfloat16 --threads 2

What it compiles: one decoder layer's dense part, the whole layer except
paged attention (RMSNorm, q/k/v projections, RoPE, o projection and residual,
RMSNorm, SwiGLU MLP and residual), with `dynamic=True` so that one graph serves
every token count. Attention stays outside the graph: its inputs are Python
lists of block tables whose lengths change every step, which would make
Dynamo guard on them and recompile. It prints the compile time of the first
call, whether a second token count recompiles, and eager vs compiled time per
call (CPU time of this thread, median of repeats) at a decode batch (32 rows)
and a prefill chunk (512 rows), and checks both give the same numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve.models.llama import apply_rotary
from nanoserve.models.loader import load_model


def dense_layer(layer, rotary):
    """The layer's work around attention; attention output replaced by v repeated (same shapes, no cache)."""
    attn, mlp = layer.self_attn, layer.mlp

    def forward(h, positions):
        T = h.shape[0]
        x = layer.input_layernorm(h)
        cos, sin = rotary(positions)
        q = attn.q_proj(x).view(T, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(T, attn.num_kv_heads, attn.head_dim)
        _v = attn.v_proj(x).view(T, attn.num_kv_heads, attn.head_dim)   # its cost counts; the stand-in skips it
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = q + k.repeat_interleave(attn.num_heads // attn.num_kv_heads, 1)    # stands in for attention
        h = h + attn.o_proj(o.reshape(T, -1))
        return h + mlp(layer.post_attention_layernorm(h))

    return forward


def cpu_ms(fn, *args, repeat: int = 7) -> float:
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn(*args)
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, getattr(torch, args.dtype)).model
    layer = model.model.layers[0]
    eager = dense_layer(layer, model.rotary)
    compiled = torch.compile(eager, dynamic=True)
    hidden = model.config.hidden_size
    with torch.inference_mode():
        x32, p32 = torch.randn(32, hidden, dtype=getattr(torch, args.dtype)), torch.arange(100, 132)
        t0 = time.perf_counter()
        compiled(x32, p32)
        print(f"compile (first call, 32 rows): {time.perf_counter() - t0:.1f} s wall")
        x512, p512 = torch.randn(512, hidden, dtype=x32.dtype), torch.arange(512)
        t0 = time.perf_counter()
        compiled(x512, p512)
        print(f"second call, 512 rows (a recompile would show here): {time.perf_counter() - t0:.1f} s wall")
        for x, p in ((x32, p32), (x512, p512)):
            torch.testing.assert_close(compiled(x, p), eager(x, p), atol=1e-3, rtol=1e-3)
            e, c = cpu_ms(eager, x, p), cpu_ms(compiled, x, p)
            print(f"{x.shape[0]:4d} rows: eager {e:7.2f} ms, compiled {c:7.2f} ms per layer ({e / c:.2f}x); "
                  f"x {model.num_layers} layers")


if __name__ == "__main__":
    main()
