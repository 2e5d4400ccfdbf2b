"""Lesson 15: prefill/decode disaggregation, a KV handoff between two processes.

Run it:  python lessons/15_disaggregation.py

Prefill and decode are different kinds of work. Disaggregated serving runs
them in different engines and ships each request's KV cache from the one
to the other. nanoserve's `DisaggregatedEngine` runs the prefill engine
(with the prefix cache) in a worker process and the decode engine in this
one, connected by torch.distributed (gloo):

1. why they differ: arithmetic per byte read, and what a long prompt does to
   the decoding requests that share its steps;
2. the handoff: which blocks leave the prefill pool, where they land in the
   decode pool, how many bytes, checked byte for byte;
3. the prefix cache lives on the prefill side;
4. outputs equal a single engine's (greedy and seeded sampling);
5. what the handoff costs here (measured, not asserted).

Every claim is checked with an `assert` on `tiny-llama` (random weights, one
token per byte). Everything runs inside `main()`: the prefill worker is
started with `spawn`, which imports this file again, and nothing may run then.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

# isort: split
# (lesson.py sets OMP_NUM_THREADS, which only counts before torch is imported)
import statistics  # noqa: E402

from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.distributed.disaggregated import DisaggregatedEngine  # noqa: E402
from nanoserve.events import ChunkScheduled, KVTransferred, StepFinished  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402
from nanoserve.runner import kv_bytes_per_block  # noqa: E402

BS = 4
CONFIG = EngineConfig(model="tiny-llama", block_size=BS, num_blocks=160, max_num_batched_tokens=64)
SYSTEM = "You are a helpful assistant. Answer briefly and politely. "
SHORT = [SYSTEM + "Hi!", SYSTEM + "Hello.", SYSTEM + "Hey."]
LONG = "The quick brown fox jumps over the lazy dog. " * 5          # 225 tokens
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def workload(add, step, has_work) -> list:
    """Three short requests start decoding; at step 4 a long prompt arrives. Returns every event."""
    for i, prompt in enumerate(SHORT):
        add(f"s{i}", prompt, GREEDY)
    events, steps = [], 0
    while has_work():
        steps += 1
        if steps == 4:
            add("long", LONG, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        events += step().events
    return events


def decode_steps(events) -> list[tuple[int, float]]:
    """(tokens computed, seconds) of every step in which a short request decoded."""
    decoding = {e.step for e in events if isinstance(e, ChunkScheduled) and not e.is_prefill
                and e.seq_id.startswith("s")}
    return [(e.num_prefill_tokens + e.num_decode_tokens, e.duration_s)
            for e in events if isinstance(e, StepFinished) and e.step in decoding]


def outputs(engine_like, prompts, params) -> dict:
    """Run prompts to the end; final token ids by request."""
    for i, prompt in enumerate(prompts):
        engine_like.add_request(f"o{i}", prompt, params)
    done = {}
    while engine_like.has_unfinished_requests():
        for out in engine_like.step().outputs:
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def main() -> None:
    broken = breaks({
        "decode-beside-prefill": "expect a single engine's decoding steps to carry no prompt tokens either",
        "ship-every-token": "expect the handoff to carry the KV of every prompt token, the last one too",
        "cache-on-decode-side": "expect the decode engine to keep the prefix cache",
    })
    loaded = load_model("tiny-llama")
    model = loaded.model

    section("1. Why prefill and decode differ", """
Every forward reads all the weights once. A prefill chunk of T tokens does
2 x params x T multiply-adds with them: lots of arithmetic per byte read, the
arithmetic units are the limit (compute-bound). A decode step does 2 x params
per running request, and also reads each request's whole KV cache: little
arithmetic per byte, the memory is the limit (memory-bound). Counted for this
model (float32), a 256-token prefill chunk vs a step of 4 decodes at 256
tokens of context each:""")
    params = sum(p.numel() for p in model.parameters())
    kv_token = kv_bytes_per_block(model, 1, next(model.parameters()).dtype)   # KV bytes of one token
    prefill = 2 * params * 256 / (4 * params + 256 * kv_token)                # writes its KV once
    decode = 2 * params * 4 / (4 * params + 4 * 256 * kv_token)
    console.print(f"prefill: {prefill:.0f} FLOP per byte read, decode: {decode:.1f} FLOP per byte read")
    assert prefill > 30 * decode
    say("""
In one engine both share every step: when a long prompt arrives, the steps that
compute its chunks are the same steps the decoding requests wait for. Three
short requests decode; at step 4 a 225-token prompt arrives (budget 64 tokens
a step, so its prefill is chunked):""")
    single = LLMEngine(CONFIG, loaded=loaded)
    mixed = decode_steps(workload(single.add_request, single.step, single.has_unfinished_requests))
    with DisaggregatedEngine(CONFIG, loaded=loaded) as pair:
        split = decode_steps(workload(pair.add_request, pair.step, pair.has_unfinished_requests))
        table = Table("engine", "steps with decodes", "most tokens computed in one")
        for name, rows in (("single engine", mixed), ("decode engine (disaggregated)", split)):
            table.add_row(name, str(len(rows)), str(max(t for t, _ in rows)))
        console.print(table)
        # The single engine ran 61 prompt tokens in a step beside the 3 decodes; the decode engine never runs
        # more than one token per request (a handed-over request computes only its last prompt token).
        most = max(t for t, _ in mixed)
        want = 3 if broken == "decode-beside-prefill" else 64
        assert most == want, (
            f"a step of the single engine in which the short requests decoded computed {most} tokens, not "
            f"{want}: the long prompt's chunks fill the rest of the 64-token budget in the very steps the "
            "decoding requests wait for; only the disaggregated decode engine keeps prompts out of them")
        assert max(t for t, _ in split) <= 4
        times = {name: [s for _, s in rows] for name, rows in (("single engine", mixed), ("decode engine", split))}
        console.print("The times of those steps (measured, not asserted):")
        for name, t in times.items():
            console.print(f"  {name}: median {1000 * statistics.median(t):.1f} ms, slowest {1000 * max(t):.1f} ms")
        say("""
On this 2-core CPU the prefill process competes with the decode process for
the same cores, so the decode engine's steps need not be faster here; on
separate GPUs they would not compete. What does not depend on the machine is
the column above: no prompt chunk ever shares a step with the decodes.""")

        section("2. The handoff", """
Once the prefill engine has computed a prompt, the blocks holding the KV of all
its tokens but the last leave its pool, in table order, as one tensor
[blocks, layers, K/V, block_size, KV heads, head_dim]. The decode engine takes
fresh blocks of its own pool (any ids: that is the block mapping), writes the
KV in, and the request is RUNNING there with those tokens computed. Its first
decode step computes the last prompt token, whose logits give the first output
token. The bytes are hashed on both sides.""")
        t = next(t for t in pair.transfers if t.request_id == "long")
        per_block = kv_bytes_per_block(model, BS, next(model.parameters()).dtype)
        table = Table("request", "tokens", "prefill pool blocks", "decode pool blocks", "bytes", "same bytes")
        for x in pair.transfers:
            table.add_row(x.request_id, str(x.num_tokens), " ".join(map(str, x.src_block_ids[:5])) + " …",
                          " ".join(map(str, x.block_ids[:5])) + " …", str(x.num_bytes),
                          "✓" if x.sent_digest == x.landed_digest else "✗")
            assert x.sent_digest == x.landed_digest and x.num_bytes == len(x.src_block_ids) * per_block
        console.print(table)
        want = len(LONG) if broken == "ship-every-token" else len(LONG) - 1
        assert t.num_tokens == want, (
            f"the handoff of 'long' carried the KV of {t.num_tokens} tokens, not {want}: the prompt's last "
            "token is computed on the decode side, in its first step, because its logits give the first "
            "output token, which the decode engine samples with the request's own random stream")
        assert len(t.block_ids) == -(-t.num_tokens // BS)
        console.print(f"'long': {t.num_tokens} tokens of KV in {len(t.block_ids)} blocks of {per_block} bytes "
                      f"= {t.num_bytes} bytes; the decode engine computed 1 prompt token itself.")

        section("3. The prefix cache lives on the prefill side", """
The prefill engine keeps a radix prefix cache; the decode engine keeps none
(its requests arrive with their KV). One more request with the same system
prompt: its prefill skips the system prompt's cached blocks, and the handoff
still ships the KV of every prompt token but the last.""")
        before = pair.prefix_cache["num_hit_tokens"]
        outputs(pair, [SYSTEM + "One more?"], GREEDY)
        hit = pair.prefix_cache["num_hit_tokens"] - before
        t = pair.transfers[-1]
        has_cache = pair.decode.radix is not None
        assert has_cache == (broken == "cache-on-decode-side"), (
            f"the decode engine {'has' if has_cache else 'has no'} prefix cache: prompts are computed on the "
            "prefill side, so that is where cached blocks save work; a decode engine's requests arrive with "
            "all their prompt's KV but the last token's")
        assert hit == len(SYSTEM) // BS * BS
        assert t.num_tokens == len(SYSTEM + "One more?") - 1
        console.print(f"prefill side: {hit} of its {t.num_tokens + 1} prompt tokens came from its cache; "
                      f"{t.num_tokens} tokens of KV ({t.num_bytes} bytes) went to the decode engine")

        section("4. Outputs equal a single engine's", """
The decode side samples every output token, the first included, with each
request's own random stream: greedy and seeded sampling give a single engine's
tokens, n > 1 forks included.""")
        prompts = SHORT + [LONG]
        for params in (GREEDY, SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=5)):
            assert outputs(pair, prompts, params) == outputs(LLMEngine(CONFIG, loaded=loaded), prompts, params)
        console.print(f"{len(prompts)} prompts, greedy and seeded n=2: identical tokens.")
        events = []
        unsubscribe = pair.subscribe(events.append)
        outputs(pair, [LONG], GREEDY)
        unsubscribe()
        arrived = [e for e in events if isinstance(e, KVTransferred)]
        chunks = [e for e in events if isinstance(e, ChunkScheduled)]
        assert arrived[0].num_tokens == len(LONG) - 1
        assert (chunks[0].start, chunks[0].num_tokens) == (len(LONG) - 1, 1)   # only the last prompt token here
        pair.check_invariants()          # both engines' bookkeeping, and every handoff byte for byte

        section("5. What the handoff costs here", """
Measured on this machine (nothing asserted, and different on every run): gloo
send/recv over the loopback, plus copying the blocks out of one pool and into
the other. On GPUs, NVLink or RDMA moves tens of GB/s.""")
        total = sum(x.num_bytes for x in pair.transfers)
        seconds = sum(x.seconds for x in pair.transfers)
        console.print(f"{len(pair.transfers)} handoffs, {total} bytes of KV in {1000 * seconds:.1f} ms "
                      f"(one MiB would take {1000 * seconds * 2**20 / total:.1f} ms)")
    console.print("All checks passed.", style="bold green")


if __name__ == "__main__":   # (the spawned prefill worker imports this file as a module: nothing may run then)
    main()
