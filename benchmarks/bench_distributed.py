"""Across processes, measured: what tensor parallelism and a KV handoff cost on this machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py              # a 4-layer random Llama, ~1 min
    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py --model tiny-llama

Part 1, tensor parallelism: the same greedy batch (8 requests, 128-token
prompts, 32 output tokens each, EOS ignored) on TP=1 and TP=2. Printed: wall
time, mean step time over decode-only steps, and from the engine's own
`CollectiveOps` events the all-reduce time and bytes per step, with their
share of the step. One thread per process (OMP_NUM_THREADS=1): TP=2 uses two
cores where TP=1 uses one.

Part 2, prefill/decode disaggregation: 8 requests, 4 of them with
1024-token prompts arriving while the others decode. Printed: the KV handed
over per request (bytes, milliseconds, MiB/s: copy out of the prefill pool,
gloo send/recv over the loopback, copy into the decode pool), and the step
times of the steps in which short requests decoded, single engine vs the
disaggregated decode engine (median and slowest: the inter-token latency the
decoding requests see).

Nothing is asserted: these are this machine's figures, and on a 2-core CPU
tensor parallelism is a lesson, not a speed-up (two processes share the
cores, and an all-reduce is a round trip through the kernel).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev
from nanoserve.distributed.disaggregated import DisaggregatedEngine
from nanoserve.models.loader import load_model


def medium_llama(folder: str) -> str:
    """A random Llama of 4 layers, hidden 512, 8 query / 4 KV heads, saved like a downloaded model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(count)]


def tensor_parallel(loaded, name: str, size: int) -> dict:
    config = EngineConfig(model=name, block_size=16, num_blocks=256, max_num_batched_tokens=512,
                          tensor_parallel_size=size)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with LLMEngine(config, loaded=loaded) as engine:
        for i, p in enumerate(prompts(loaded.model.config.vocab_size, 8, 128, seed=1)):
            engine.add_request(f"r{i}", p, params)
        t0 = time.perf_counter()
        events, tokens = [], {}
        while engine.has_unfinished_requests():
            result = engine.step()
            events += result.events
            tokens.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
        wall = time.perf_counter() - t0
    decode_steps = [e for e in events if isinstance(e, ev.StepFinished) and e.num_prefill_tokens == 0]
    per_step = {e.step: 0.0 for e in decode_steps}
    bytes_step = {e.step: 0 for e in decode_steps}
    other = {e.step: 0.0 for e in decode_steps}
    for e in events:
        if isinstance(e, ev.CollectiveOps) and e.step in per_step:
            if e.kind == "all_reduce":
                per_step[e.step] += e.duration_s
                bytes_step[e.step] += e.num_bytes
            else:
                other[e.step] += e.duration_s
    n = max(1, len(decode_steps))
    return {"wall": wall, "tokens": tokens, "step": sum(e.duration_s for e in decode_steps) / n,
            "all_reduce": sum(per_step.values()) / n, "bytes": sum(bytes_step.values()) / n,
            "other": sum(other.values()) / n, "steps": len(decode_steps)}


def decode_latency(events) -> list[float]:
    """Durations of the steps in which one of the short requests decoded."""
    decoding = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and not e.is_prefill
                and e.seq_id.startswith("s")}
    return [e.duration_s for e in events if isinstance(e, ev.StepFinished) and e.step in decoding]


def run_mixed(engine_like, vocab: int) -> tuple[list, dict]:
    """4 short requests decode; a 1024-token prompt arrives every 8 steps, 4 in all."""
    short = prompts(vocab, 4, 32, seed=2)
    long = prompts(vocab, 4, 1024, seed=3)
    for i, p in enumerate(short):
        engine_like.add_request(f"s{i}", p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    events, tokens, steps = [], {}, 0
    seen: list = []
    unsubscribe = engine_like.subscribe(seen.append)
    while engine_like.has_unfinished_requests():
        if steps % 8 == 4 and steps // 8 < len(long):
            engine_like.add_request(f"l{steps // 8}", long[steps // 8],
                                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result = engine_like.step()
        steps += 1
        tokens.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
    unsubscribe()
    events = [e for e in seen if not isinstance(e, ev.EngineSynced)]
    return events, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model name or directory (default: a random 4-layer Llama)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        name = args.model or medium_llama(tmp)
        loaded = load_model(name)
        m = loaded.model
        print(f"model: {args.model or 'random Llama'}: {m.num_layers} layers, hidden {m.config.hidden_size}, "
              f"{m.config.num_attention_heads} heads / {m.num_kv_heads} KV heads, "
              f"{sum(p.numel() for p in m.parameters()) / 1e6:.1f} M parameters, float32\n")

        print("Part 1: tensor parallelism (8 requests x 128-token prompts, 32 greedy tokens each)")
        one, two = tensor_parallel(loaded, name, 1), tensor_parallel(loaded, name, 2)
        same = one["tokens"] == two["tokens"]
        print(f"{'':6}{'wall s':>8}{'decode step ms':>16}{'all-reduce ms/step':>20}{'KiB/step':>10}"
              f"{'other comm ms':>15}")
        for label, r in (("TP=1", one), ("TP=2", two)):
            print(f"{label:6}{r['wall']:8.2f}{1000 * r['step']:16.1f}{1000 * r['all_reduce']:20.2f}"
                  f"{r['bytes'] / 1024:10.1f}{1000 * r['other']:15.2f}")
        print(f"TP=2 / TP=1 wall time: {two['wall'] / one['wall']:.2f}x; all-reduce share of a TP=2 decode step: "
              f"{100 * two['all_reduce'] / two['step']:.0f}%; greedy tokens equal: {same}\n")

        print("Part 2: disaggregation (4 short requests decode while four 1024-token prompts arrive)")
        config = EngineConfig(model=name, block_size=16, num_blocks=512, max_num_batched_tokens=256)
        single = LLMEngine(config, loaded=loaded)
        mixed, ref = run_mixed(single, m.config.vocab_size)
        with DisaggregatedEngine(config, loaded=loaded) as pair:
            split, got = run_mixed(pair, m.config.vocab_size)
            transfers = list(pair.transfers)
        long = [t for t in transfers if t.request_id.startswith("l")]
        for t in long:
            print(f"  handoff {t.request_id}: {t.num_tokens} tokens, {len(t.block_ids)} blocks, "
                  f"{t.num_bytes / 2**20:.2f} MiB in {1000 * t.seconds:.1f} ms "
                  f"({t.num_bytes / 2**20 / t.seconds:.0f} MiB/s)")
        for label, events in (("single engine", mixed), ("decode engine", split)):
            d = decode_latency(events)
            print(f"  {label:14} steps with decodes: {len(d):3}, median {1000 * statistics.median(d):6.1f} ms, "
                  f"slowest {1000 * max(d):6.1f} ms")
        print(f"  greedy tokens equal: {ref == got}")


if __name__ == "__main__":
    main()
