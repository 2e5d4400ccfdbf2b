"""Lesson 17: KV cache groups, and the memory a sliding window gives back.

Run it:  python lessons/17_kv_cache_groups.py   (a few seconds; tiny-gemma3, random weights, offline)

Gemma 3 puts most of its layers on sliding-window attention: a query sees only
the last W positions. Once the sequence has moved W tokens past a block, no
local layer will ever read it again, so a paged engine can give it back, if
the local layers keep their own block table. nanoserve splits the layers into
KV cache groups (kv_groups.py): one table per group, one shared pool, and a
windowed group's table drops its head as the window slides. This lesson runs
one long request on a Gemma-3-shaped model with freeing on and off: the same
tokens, and the memory it holds stops growing in the local layers.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "keep-everything": "never give back a block the window passed (the slide does nothing)",
    "one-token-early": "free a block one token before the window has passed it",
})

from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams, kv_manager  # noqa: E402
from nanoserve import events as ev  # noqa: E402
from nanoserve.kv_groups import FREED, max_window_blocks  # noqa: E402
from nanoserve.trace import fold_all  # noqa: E402

BS, PROMPT, NEW = 4, 120, 60          # 4-token blocks; a 120-token prompt, 60 tokens generated

# ---------------------------------------------------------------------------
section("1. Groups: one block table per kind of layer", """
tiny-gemma3 has three layers: two local ones with a window of 8 tokens and one global one. The
engine cuts the layers into groups of equal size (here one layer each), full attention first.
A block is block_size tokens of one group's layers, so the same block id means the same bytes
in every group, and slot s of every group shares one K and one V tensor.
""")
engine = LLMEngine(EngineConfig(model="tiny-gemma3", block_size=BS, num_blocks=256, max_num_batched_tokens=16))
windows = engine.loaded.model.sliding_windows
table = Table("group", "window", "layers", box=box.SIMPLE, pad_edge=False)
for g, group in enumerate(engine.kv_groups):
    table.add_row(str(g), str(group.window or "full"), ", ".join(map(str, group.layers)))
console.print(f"layer windows: {windows}")
console.print(table)
k, _ = engine.runner.slot_caches[0]
console.print(f"KV tensors: {len(engine.runner.slot_caches)} pair of {tuple(k.shape)} "
              f"[blocks, block_size, kv_heads, head_dim], shared by the layers of every group")
assert [g.window for g in engine.kv_groups] == [None, 8, 8] and len(engine.runner.slot_caches) == 1, \
    "tiny-gemma3: a full group first, then one group per local layer, and one tensor pair for all"
assert engine.pool.num_blocks == 3 * 256, "num_blocks counts whole-model blocks: 3 one-layer blocks each"

# ---------------------------------------------------------------------------
section("2. One long request, window freeing on and off", f"""
The same {PROMPT}-token prompt and {NEW} greedy tokens, in 16-token chunks. After every step the
lesson counts the blocks the request holds in each group's table, and the bytes they take.
""")
prompt = [(7 * i) % 250 + 3 for i in range(PROMPT)]


def run(freeing: bool):
    eng = LLMEngine(EngineConfig(model="tiny-gemma3", block_size=BS, num_blocks=256, max_num_batched_tokens=16,
                                 kv_window_freeing=freeing), loaded=engine.loaded)
    if freeing and BROKEN == "keep-everything":
        eng.kv.slide = lambda seq: None
    events = []
    eng.subscribe(events.append)
    eng.add_request("long", prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0))
    block_bytes = sum(k[0].nbytes + v[0].nbytes for k, v in eng.runner.slot_caches)   # one block, K and V
    held, out = [], None
    while eng.has_unfinished_requests():
        result = eng.step()
        seq = eng.sequences.get("long")
        if seq is not None:
            tables = [seq.block_table, *seq.group_tables]
            held.append((eng.step_count, seq.num_computed_tokens, [sum(b != FREED for b in t) for t in tables]))
        out = next((o for o in result.outputs if o.finished), out)
    return out.outputs[0], held, block_bytes, events


if BROKEN == "one-token-early":     # the first block still needed, computed as if one more token had passed
    kv_manager.first_needed_block = lambda w, n, bs: 0 if w is None else max(0, n - w + 2) // bs
on, held_on, bytes_on, events = run(True)
off, held_off, bytes_off, _ = run(False)

rows = Table("step", "tokens in KV", "on: blocks per group", "on: KiB", "off: blocks", "off: KiB",
             box=box.SIMPLE, pad_edge=False)
for (step, tokens, blocks), (_, _, blocks_off) in list(zip(held_on, held_off))[::8]:
    rows.add_row(str(step), str(tokens), " + ".join(map(str, blocks)), f"{sum(blocks) * bytes_on / 1024:.1f}",
                 str(blocks_off[0]), f"{blocks_off[0] * bytes_off / 1024:.1f}")
console.print(rows)
most = max(max(blocks[1:]) for _, _, blocks in held_on)
left = sum(isinstance(e, ev.BlocksLeftWindow) for e in events)
console.print(f"most blocks a local table held: {most} (window 8 / block 4, plus one: "
              f"{max_window_blocks(8, BS)}); BlocksLeftWindow events: {left}")
final_on = sum(held_on[-1][2]) * bytes_on
final_off = held_off[-1][2][0] * bytes_off
console.print(f"at the end: {final_on / 1024:.1f} KiB held with freeing, {final_off / 1024:.1f} KiB without "
              f"({final_on / final_off:.0%})")
assert on.token_ids == off.token_ids and abs(on.cumulative_logprob - off.cumulative_logprob) < 1e-4, \
    "freeing must not change a single probability: a block was freed while a local layer could still read it"
assert most <= max_window_blocks(8, BS), \
    f"a local table held {most} blocks: the blocks a window passed must go back to the pool"
assert final_on < final_off
say(f"""The global group's table grows with the sequence, as every table did before; each local group's
stays at {most} blocks, whatever the length. For the real Gemma 3 (window 512, five local layers of
every six) the local layers' share of a long request's KV stops growing at 512 tokens, and the
request holds close to a sixth of what it would. (With the prefix cache on, as here, a block the
window passed is not lost at once: the cache keeps it, evictable, for a later request with the same
prefix, and gives it back first when the pool runs short.)""")

# ---------------------------------------------------------------------------
section("3. The engine's own pictures", """
The TUI's block-table panel, drawn from the events of the run above (a trace is enough): group
0's table on the request's line, each local group's under it, `·` where a block left the window.
`nanoserve tui --scenario sliding-window` runs the same kind of request live.
""")
from nanoserve_tui.widgets.tables import TablesLayout  # noqa: E402

state = fold_all(e for e in events if not (isinstance(e, ev.SequenceFinished) or
                                          (isinstance(e, ev.BlocksFreed) and e.seq_id == "long")))
layout = TablesLayout(state, 100)
for i in range(layout.count):
    console.print("".join(seg.text for seg in layout.line(i)).rstrip())
assert any("→·" in "".join(s.text for s in layout.line(i)) for i in range(layout.count))
engine.check_invariants()
console.print("All checks passed.", style="bold green")
