"""Lesson 5: copy-on-write fork, parallel sampling and beam search.

Run it:  python lessons/05_fork_and_beam_search.py

A fork makes a new sequence that shares every KV block of its parent: the
block tables are copied (a list of ids), the blocks are not. Each shared block's
ref count goes up by one. Nothing is copied until a sequence is about to write
into a block someone else also holds; only the last, partly filled block is
ever written, so at most one block per fork is copied ("copy-on-write").

Three users of fork, all checked with `assert`s on `tiny-llama` (random weights,
one token per byte): `SamplingParams(n=4)` computes the prompt once and forks
it four ways; `engine.fork(request_id)` splits a running request; beam search
forks the beams worth continuing and prunes the others. The prefix cache is off
in this lesson (enable_prefix_caching=False) so that every shared block is
shared by a fork; section 1 says what the cache would add.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "copy-on-fork": "expect each fork to hold its own copy of every prompt block",
    "write-in-place": "expect the four sequences to write into the shared last block in place, no copies",
})

from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import BeamPruned, BlockDeduplicated, CowCopied, Forked  # noqa: E402

BS = 4                                              # block_size: small, so tables are short to read
PROMPT = "Once upon a time, in a land far"         # 31 characters = 31 tokens: 7 full blocks + 3 tokens
assert len(PROMPT) == 31


def engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": "tiny-llama", "block_size": BS, "num_blocks": 64,
                                     "enable_prefix_caching": False, **config}))


def run(eng: LLMEngine, watch=None) -> dict:
    """Step to the end; calls watch(eng, result) after each step. Returns tokens computed, the peak
    number of blocks in use, every event and the finished outputs by request id."""
    out = {"computed": 0, "peak": 0, "events": [], "outputs": {}}
    while eng.has_unfinished_requests():
        result = eng.step()
        eng.check_invariants()                       # ref counts = the tables that hold each block
        out["computed"] += result.stats.num_prefill_tokens + result.stats.num_decode_tokens
        # (after the step: a sequence that finished has already given its blocks back)
        out["peak"] = max(out["peak"], result.stats.num_blocks - result.stats.num_free_blocks)
        out["events"] += result.events
        out["outputs"].update({o.request_id: o for o in result.outputs if o.finished})
        if watch:
            watch(eng, result)
    return out


def of_type(events, kind) -> list:
    return [e for e in events if isinstance(e, kind)]


def tables(eng: LLMEngine) -> dict[str, list[int]]:
    return {r["seq_id"]: r["block_table"] for r in eng.snapshot()["sequences"]}


# ---------------------------------------------------------------------------
section("1. n=4: one prefill, four completions", f"""
SamplingParams(n=4) asks for four completions of one prompt. The prompt ({len(PROMPT)} tokens) is
computed once; when its first token is sampled the request forks three times, and all four
sample from the same logits row. We compare with four separate requests for the same prompt.
Greedy (temperature 0), so all completions must be equal.
""")
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)   # random weights: never stop early
fork_engine = engine()
fork_engine.add_request("p", PROMPT, SamplingParams(n=4, max_tokens=8, temperature=0, ignore_eos=True))
seen = {}


def after_step_2(eng: LLMEngine, result) -> None:
    if result.stats.step == 2:
        seen["tables"] = tables(eng)
        seen["ref"] = list(eng.snapshot()["pool"]["ref_counts"])
        seen["k"] = [k.clone() for k, _ in eng.runner.kv_caches]   # [blocks, BS, kv_heads, head_dim] per layer
        print(eng)


forked = run(fork_engine, after_step_2)
separate_engine = engine()
for i in range(4):
    separate_engine.add_request(f"s{i}", PROMPT, greedy)
separate = run(separate_engine)

forks = of_type(forked["events"], Forked)
cows = of_type(forked["events"], CowCopied)
completions = [c.token_ids for c in forked["outputs"]["p"].outputs]
assert [(e.step, e.parent_id, e.seq_id) for e in forks] == [(1, "p", "p.1"), (1, "p", "p.2"), (1, "p", "p.3")]
assert all(list(e.block_ids) == list(range(8)) for e in forks), "each fork shares the parent's 8 blocks"
assert len(completions) == 4 and all(c == completions[0] for c in completions)
assert completions[0] == separate["outputs"]["s0"].outputs[0].token_ids, "forking changes nothing in the output"
shared = seen["tables"]["p"][:7]
assert all(t[:7] == shared for t in seen["tables"].values()), "the 7 full prompt blocks stay shared"
assert all(seen["ref"][b] == 4 for b in shared), "ref count 4: four tables hold each of them"
# The partly filled block 7 (prompt tokens 28-30) is written by all four in step 2: the first three
# writers get a copy, the last one finds ref count 1 and keeps the original.
expected_cows = [] if BROKEN == "write-in-place" else [(2, 7, 7)] * 3
assert [(e.step, e.index, e.src) for e in cows] == expected_cows, (
    f"copies {[(e.step, e.index, e.src) for e in cows]} (step, logical block, source), not {expected_cows}: "
    "block 7, the prompt's partly filled last block, is shared by all four, and each writes its next token "
    "there in step 2; a shared block is never written in place, so the first three writers get a copy")
for e in cows:   # the copy is real: the copied slots hold the same K in every layer
    assert all((k[e.dst, :3] - k[e.src, :3]).abs().max() == 0 for k in seen["k"])

table = Table("", "prompt tokens computed", "all tokens computed", "peak blocks in use", box=box.SIMPLE,
              pad_edge=False)
prefill_fork = len(PROMPT)
table.add_row("n=4, forked", str(prefill_fork), str(forked["computed"]), str(forked["peak"]))
table.add_row("4 separate requests", str(4 * len(PROMPT)), str(separate["computed"]), str(separate["peak"]))
console.print(table)
assert forked["computed"] == len(PROMPT) + 4 * 7, "the prompt once, then 7 decode tokens per completion"
assert separate["computed"] == 4 * (len(PROMPT) + 7)
expected_peak = 4 * 10 if BROKEN == "copy-on-fork" else 7 + 4 * 3
assert forked["peak"] == expected_peak, (
    f"the forks' peak is {forked['peak']} blocks, not {expected_peak}: a fork copies the block table (a list "
    "of ids), not the blocks; the 7 full prompt blocks stay shared, and each sequence owns only 3 blocks")
assert separate["peak"] == 4 * 10, "separate requests: 10 blocks each"
say(f"""Step 1 computed the prompt once and forked (Forked x3, every table = blocks 0-7). Step 2
wrote each completion's first token into block 7, shared and partly filled: CowCopied x3, all
from block 7 (to {[e.dst for e in cows]}); the copied slots hold the same K, compared in every layer.
The 7 full prompt blocks stay shared to the end: {forked['peak']} blocks at the peak instead of {separate['peak']}.""")

cache_engine = engine(enable_prefix_caching=True)
for i in range(4):
    cache_engine.add_request(f"s{i}", PROMPT, greedy)
cache_run = run(cache_engine)
dedup = of_type(cache_run["events"], BlockDeduplicated)
assert cache_run["computed"] == separate["computed"] and dedup
say(f"""And the prefix cache (lesson 4)? Four separate requests arriving together all miss: nothing
is cached before the first step, so the prompt is still computed 4 times ({cache_run['computed']} tokens in
all). After the step the cache finds the four copies of each full block and keeps one
(BlockDeduplicated x{len(dedup)}): it recovers memory, not compute. A fork saves both.""")

# ---------------------------------------------------------------------------
section("2. Parallel sampling: n=3 at temperature 1", """
With sampling, each fork draws from its own random stream (seeded from the request's seed),
so the completions differ, and the same seed gives the same three again.
""")


def sample_three() -> list[list[int]]:
    eng = engine()
    eng.add_request("p", PROMPT, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True))
    return [c.token_ids for c in run(eng)["outputs"]["p"].outputs]


first, again = sample_three(), sample_three()
for i, c in enumerate(first):
    console.print(f"  completion {i}: {c}")
assert len({tuple(c) for c in first}) == 3, "three different completions"
assert first == again, "reproducible with the same seed"
console.print("The same three again with seed=5: each fork's generator is seeded from the request's.")

# ---------------------------------------------------------------------------
section("3. engine.fork(): split a running request", """
engine.fork(request_id) forks a running request at its current position; the new sequence
("r.1") joins the same request as one more completion, with its own random stream.
""")
eng = engine()
eng.add_request("r", PROMPT, SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True))
for _ in range(3):
    eng.step()                                      # the prompt, then two decodes: 33 tokens with KV
parent_table = list(eng.snapshot()["sequences"][0]["block_table"])
child = eng.fork("r")
fork_tables = tables(eng)
print(eng)
assert child == "r.1" and fork_tables["r.1"] == fork_tables["r"] == parent_table
assert all(eng.snapshot()["pool"]["ref_counts"][b] == 2 for b in parent_table)
done = run(eng)
cow = of_type(done["events"], CowCopied)
assert len(cow) == 1 and cow[0].index == len(parent_table) - 1, "one copy: the partly filled last block"
outs = {c.index: c.token_ids for c in done["outputs"]["r"].outputs}
num_before = 3                                      # tokens sampled before the fork
assert outs[0][:num_before] == outs[1][:num_before], "the fork starts from the parent's tokens"
assert outs[0][num_before:] != outs[1][num_before:], "then each samples on its own"
say(f"""r and r.1 share all {len(parent_table)} blocks (ref count 2) right after the fork. The next step, the
first writer into the partly filled block {parent_table[-1]} gets a copy (CowCopied: {cow[0].src} -> {cow[0].dst}).""")
console.print(f"  r   {outs[0]}")
console.print(f"  r.1 {outs[1]}")
say(f"Same first {num_before} tokens (from before the fork), then their own random draws.")

# ---------------------------------------------------------------------------
section("4. Beam search", """
SamplingParams(beam_width=3, n=3, temperature=0): keep the 3 most likely continuations. Each
step every beam scores the whole vocabulary; the best 3 (beam, token) pairs over all beams
survive. A beam chosen once continues itself, chosen twice it is forked first, not chosen it
is pruned (its blocks freed). min_tokens = max_tokens = 6, so every beam has the same length
(EOS is masked) and the result equals Hugging Face generate(num_beams=3, do_sample=False),
which tests/test_memory.py checks.
""")
beam_engine = engine()
beam_engine.add_request("b", PROMPT, SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=6, min_tokens=6))
steps = Table("step", "forked", "pruned", "copy-on-write", "beams' block tables (after the 7 shared)",
              box=box.SIMPLE, pad_edge=False)
live_max, beam_peak = 0, 0


def watch_beams(eng: LLMEngine, result) -> None:
    global live_max, beam_peak
    beams = tables(eng)
    live_max = max(live_max, len(beams))
    beam_peak = max(beam_peak, len({b for t in beams.values() for b in t}))
    assert all(t[:7] == list(range(7)) for t in beams.values()), "every beam keeps the prompt's 7 blocks"
    steps.add_row(str(result.stats.step),
                  " ".join(f"{e.parent_id}->{e.seq_id}" for e in of_type(result.events, Forked)),
                  " ".join(e.seq_id for e in of_type(result.events, BeamPruned)),
                  " ".join(f"{e.seq_id}:{e.src}->{e.dst}" for e in of_type(result.events, CowCopied)),
                  "  ".join(f"{rid} {t[7:]}" for rid, t in beams.items()) or "(all finished)")


beams = run(beam_engine, watch_beams)
console.print(steps)
result = beams["outputs"]["b"].outputs
scores = [c.cumulative_logprob / len(c.token_ids) for c in result]   # length_penalty 1: log-prob per token
for c, s in zip(result, scores):
    console.print(f"  beam {c.index}: {c.token_ids}  cumulative log-prob {c.cumulative_logprob:.3f}  score {s:.4f}")
assert scores == sorted(scores, reverse=True), "completions come best first"
assert len({tuple(c.token_ids) for c in result}) == 3, "three different hypotheses"
assert live_max <= 3 and of_type(beams["events"], BeamPruned) and of_type(beams["events"], CowCopied)
assert beam_peak < 3 * 9, "the beams never hold 3 separate copies of their 9 blocks"

# Greedy is beam search with one beam; wider beams may find more likely sequences (or not).
best, finals = {}, {}
for width in (1, 2, 3, 4):
    e = engine()
    e.add_request("g", PROMPT, SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=6,
                                              min_tokens=6))
    finals[width] = run(e)["outputs"]["g"].outputs    # all `width` hypotheses, best first
    best[width] = finals[width][0]
e = engine()
e.add_request("greedy", PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))
plain_greedy = run(e)["outputs"]["greedy"].outputs[0]
assert best[1].token_ids == plain_greedy.token_ids, "beam_width=1 is greedy decoding"
assert abs(best[1].cumulative_logprob - plain_greedy.cumulative_logprob) < 1e-4
say(f"""The tables show the sharing: the 7 prompt blocks are held by every beam for the whole search;
the beams' own blocks are shared right after a fork and copied on the next write. At most
{beam_peak} distinct blocks were in use, not 3 x 9.""")
console.print("Best sequence's cumulative log-prob by beam width (greedy = width 1):")
console.print("  " + "   ".join(f"width {w}: {best[w].cumulative_logprob:.3f}" for w in best))
say(f"""A wider beam explores more, but beam search is a heuristic, not a search for the best
sequence. Here width 3 beats greedy, and width 4 does worse than width 3: it also keeps a
fourth first token, whose continuations outscore, at step 3, the prefix {best[3].token_ids[:3]}
that leads to width 3's winner, so width 4 prunes that prefix.""")
assert best[3].cumulative_logprob > best[1].cumulative_logprob, "on this prompt, width 3 beats greedy"
assert best[4].cumulative_logprob < best[3].cumulative_logprob, "and width 4 does worse than width 3"
assert all(c.token_ids[:3] != best[3].token_ids[:3] for c in finals[4]), "width 4 lost width 3's prefix"
console.print("All checks passed.", style="bold green")
