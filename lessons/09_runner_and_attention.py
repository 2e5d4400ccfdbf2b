"""Lesson 9: the runner's flat batch, and attention over a cached prefix.

Run it:  python lessons/09_runner_and_attention.py

One step is one forward pass over a *flat row* of tokens: the decodes of
running requests and the prefill chunks of others, side by side. The runner
(`nanoserve/runner.py`) builds that row and what attention needs to find
every token's K/V in the paged cache: positions, slots, block tables, masks.
This lesson records the batch of a real step on `tiny-llama` (by wrapping
`engine.runner.prepare`), reads it field by field, and checks that a prefill
chunk after a prefix-cache hit, which attends to K/V it never computed, gives
exactly the logits of a prompt computed from scratch.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "positions-from-zero": "expect a prefill chunk's positions to start at 0, whatever it follows",
    "chunk-only-mask": "expect a chunk's queries to see only the chunk's own keys, not the cached prefix",
})

import torch  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import ChunkScheduled, PrefixMatched  # noqa: E402

BS = 4
SYSTEM = "You are terse. "                          # 15 tokens: 3 whole blocks of 4, and 3 more
GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(**config) -> LLMEngine:
    # path="reading": the reading path, the code this lesson reads (models/llama.py, kernels/reference.py:
    # padded tables, masks). By default a CPU runs the fast path of nanoserve/cpu/ instead, whose attention
    # kernel (cpu/attention.c) reads each sequence's own tokens and needs neither. engine.implementation
    # says which one ran.
    return LLMEngine(EngineConfig(model="tiny-llama", block_size=BS, num_blocks=64, max_num_batched_tokens=64,
                                  path="reading", **config))


engine = make_engine()
assert engine.implementation.path == "reading", "this lesson reads (and runs) models/ and kernels/reference.py"
recorded = []                                       # (the RunInputs, the Batch) of every forward pass
prepare = engine.runner.prepare


def recording_prepare(inputs):
    batch = prepare(inputs)
    recorded.append((inputs, batch))
    return batch


engine.runner.prepare = recording_prepare           # a spy: the engine's calls go through it

# ---------------------------------------------------------------------------
section("1. One step's flat row", """
Two requests decode while a third arrives whose prompt starts with a cached system prompt.
The step that admits it runs one forward pass over a row of tokens: the two decodes first,
one token each, then the new request's prefill chunk, which starts after the cached prefix.
""")
engine.add_request("warm", SYSTEM + "Hi!", SamplingParams(max_tokens=2, **GREEDY))   # fills the cache
engine.add_request("d1", "Decode me, please, now!", SamplingParams(max_tokens=20, **GREEDY))
engine.add_request("d2", "And me", SamplingParams(max_tokens=20, **GREEDY))
for _ in range(3):
    engine.step()
engine.add_request("hit", SYSTEM + "Why?", SamplingParams(max_tokens=4, logprobs=5, **GREEDY))
result = engine.step()
inputs, batch = recorded[-1]
hit = next(e for e in result.events if isinstance(e, PrefixMatched))
chunks = {e.seq_id: e for e in result.events if isinstance(e, ChunkScheduled)}
console.print(f"step {result.stats.step}: PrefixMatched {hit.seq_id}: {hit.num_hit_tokens} of "
              f"{hit.num_tokens} tokens cached, blocks {list(hit.block_ids)}")
for rid, c in chunks.items():
    console.print(f"  {rid:4} {'prefill' if c.is_prefill else 'decode '} tokens {c.start}..{c.start + c.num_tokens - 1}")
meta = batch.meta
console.print(f"input_ids     {batch.input_ids.tolist()}")
console.print(f"positions     {batch.positions.tolist()}")
console.print(f"slot_mapping  {meta.slot_mapping.tolist()}")
group = meta.decode_groups[0]                       # decodes attended together (up to 8 neighbours)
console.print(f"decodes: {meta.num_decodes}, their block tables (padded with block 0) "
              f"{group.block_tables.tolist()}, lengths {group.seq_lens.tolist()}")
for p in meta.prefills:
    console.print(f"prefill chunk: rows {p.start}..{p.end - 1} of the row, "
                  f"context_len {p.context_len} (cached prefix + chunk), block table {p.block_table.tolist()}")
console.print(f"logits_indices {batch.logits_indices.tolist()}: the rows whose logits come back")

assert hit.seq_id == "hit" and hit.num_hit_tokens == len(SYSTEM) // BS * BS
assert meta.num_decodes == 2 and [len(x.token_ids) for x in inputs].count(1) == 2, "two decodes"
assert len(meta.decode_groups) == 1 and group.end - group.start == 2, "two decodes, one group"
order = sorted(inputs, key=lambda x: len(x.token_ids) > 1)          # decodes first, as the runner lays them out
row = 0
for x in order:
    n = len(x.token_ids)
    expected = list(range(n)) if BROKEN == "positions-from-zero" and n > 1 else list(range(x.start, x.start + n))
    got = batch.positions[row:row + n].tolist()
    assert got == expected, (
        f"positions {got}, not {expected}: a chunk's tokens sit at positions start..start+n-1 of their "
        f"sequence ({x.start} tokens are already in the cache before this chunk), and RoPE and the causal "
        "mask both use those absolute positions")
    slots = [x.block_table[p // BS] * BS + p % BS for p in got]
    assert meta.slot_mapping[row:row + n].tolist() == slots, "slot = table[pos // bs] * bs + pos % bs"
    row += n
prefill = meta.prefills[0]
assert prefill.start == 2 and prefill.context_len == chunks["hit"].start + chunks["hit"].num_tokens
assert batch.logits_indices.tolist() == [0, 1, batch.input_ids.numel() - 1], \
    "logits for each decode and for the last token of the chunk, which reaches the prompt's end"
say(f"""The row holds {batch.input_ids.numel()} tokens: the decodes at rows 0 and 1, then "hit"'s chunk,
which starts at position {chunks['hit'].start}, right after the {hit.num_hit_tokens} cached tokens. Its slots
follow its block table, whose first blocks are the cached ones ({list(hit.block_ids)}). Only 3 rows
of logits are computed: a mid-prompt chunk would have none.""")

# ---------------------------------------------------------------------------
section("2. The mask: a chunk sees the cached prefix", """
In every layer, attention first writes the row's new K/V at their slots, then computes the
decodes (one query each, over their padded block tables, masked to their lengths) and each
prefill chunk: its queries attend, through its block table, to the cached prefix AND to the
chunk itself, causally. Query i of a chunk starting at position s may see keys 0..s+i.
(█ visible, · masked; rows: the chunk's queries, columns: key positions)
""")
mask = prefill.mask
start = chunks["hit"].start
for i in range(mask.shape[0]):
    console.print(f"  query at position {start + i:2d}  " + "".join("█" if v else "·" for v in mask[i].tolist()))
keys = torch.arange(mask.shape[1])
for i in range(mask.shape[0]):
    lo = start if BROKEN == "chunk-only-mask" else 0
    expected = (keys >= lo) & (keys <= start + i)
    assert torch.equal(mask[i], expected), (
        f"query {i} (position {start + i}) sees keys {keys[mask[i]].tolist()}: the chunk's queries attend to "
        f"the cached prefix too (positions 0..{start - 1}, read from the shared blocks), so key j is visible "
        "to query i exactly when j <= start + i")
dmask = group.mask[:, 0, 0]                         # [decodes, padded blocks * block_size]
for b in range(meta.num_decodes):
    console.print(f"  decode {b}: {int(group.seq_lens[b])} real slots of {dmask.shape[1]} gathered  "
                  + "".join("█" if v else "·" for v in dmask[b].tolist()))
    assert int(dmask[b].sum()) == int(group.seq_lens[b]), "a decode sees exactly its own tokens"
short = int(group.seq_lens.argmin())
assert group.block_tables[short, -1] == 0 and dmask[short, -BS:].sum() == 0, "padding: block 0, masked"
say("""The decodes' tables are padded to the longest with block 0; the mask hides the padding and
the unused slots of each last block. (This is the reading path, which this lesson's engine takes with
path="reading". By default a CPU runs every row in the C kernel of cpu/attention.c, which walks
each row's own block table up to its length: no padding, no mask, no gathered copy. A prefill chunk's
query at position p is a row over the first p + 1 tokens of the chunk's table: causal by construction.)""")

# ---------------------------------------------------------------------------
section("3. Attention over a cached prefix is attention over a recomputed one", """
The same request in an engine with the prefix cache off computes its whole prompt. Its
first token's log-probabilities must equal those of the hit request, which computed only
the chunk and read the prefix's K/V from blocks another request wrote.
""")
while engine.has_unfinished_requests():
    for out in engine.step().outputs:
        if out.request_id == "hit" and out.finished:
            with_hit = out.outputs[0]
fresh = make_engine(enable_prefix_caching=False)
fresh.add_request("hit", SYSTEM + "Why?", SamplingParams(max_tokens=4, logprobs=5, **GREEDY))
computed = 0
while fresh.has_unfinished_requests():
    r = fresh.step()
    computed += r.stats.num_prefill_tokens
    for out in r.outputs:
        if out.finished:
            from_scratch = out.outputs[0]
first_hit, first_fresh = with_hit.logprobs[0], from_scratch.logprobs[0]
console.print(f"with the cache hit: prefill {chunks['hit'].num_tokens} tokens, top log-probs "
              + ", ".join(f"{t}: {v:.5f}" for t, v in list(first_hit.items())[:3]))
console.print(f"from scratch:       prefill {computed} tokens, top log-probs "
              + ", ".join(f"{t}: {v:.5f}" for t, v in list(first_fresh.items())[:3]))
assert first_hit.keys() == first_fresh.keys()
assert all(abs(first_hit[t] - first_fresh[t]) < 1e-4 for t in first_hit), "same logits, to float error"
assert with_hit.token_ids == from_scratch.token_ids, "and the same greedy tokens"
say("""Same distribution, same tokens, with the prefix computed once by another request. That is
why a prefix-cache hit can skip the prefill of the cached tokens: their K/V in the shared
blocks are exactly what the request would have computed.""")
engine.check_invariants()
console.print("All checks passed.", style="bold green")
