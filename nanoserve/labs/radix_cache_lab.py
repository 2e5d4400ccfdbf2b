"""Lab radix-cache: the prefix cache's match, insert and eviction (nanoserve/radix_cache.py).

The student writes `RadixCache.match_prefix`, `insert` and `evict`; the
helpers around them (`_key`, `_common_blocks`, `_split`, `_add_node`,
`lock`, `unlock`, `touch`) stay the engine's. Each check judges one of the
three on a tree the check builds node by node (never with another blank),
with the engine's own block pool underneath (in the checker: its ref counts
are the truth), block size 4 and token ids chosen so that every block differs.
Then the real engine runs requests that share a system prompt in a pool small
enough that cached blocks must be evicted.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.events import RadixEvicted, RadixInserted, StepClock
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine, same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect
from nanoserve.radix_cache import RadixCache as RealCache

BS = 4
FULL_HIT = ("a full-prompt prefix hit leaves nothing to compute: the step needs at least one token to produce "
            "the next token's logits, so match at most (len(tokens) - 1) // block_size blocks")
KEY_HINT = ("a node is found by the tokens of its first block: a cached span that loses its key is never matched "
            "again (children are filed under tokens[:block_size])")


class Fixture:
    """The engine's pool (here), the student's cache (in the worker), a clock and the events it emitted."""

    def __init__(self, ctx: Context, num_blocks: int = 24) -> None:
        self.module = ctx.module
        self.pool = BlockPool(num_blocks, BS)
        self.events: list = []
        self.clock = StepClock()
        self.cache = ctx.module.RadixCache(self.pool, self.events.append, None, clock=self.clock)

    def grow(self, parent, tokens: list[int], step: int = 0):
        """A node under `parent` (None: the root) holding `tokens` (whole blocks): (node, its blocks).

        Built by hand as the tree's invariants say (one reference per block, filed under its first
        block, unlocked), so no blank of the student's runs while a check sets up its tree."""
        cache, parent = self.cache, parent if parent is not None else self.cache.root
        blocks = self.pool.allocate(len(tokens) // BS)      # this reference becomes the tree's
        node_id = max(cache.nodes.keys()) + 1
        node = self.module.RadixNode(node_id, parent, tuple(tokens), list(blocks), step)
        parent.children[tuple(tokens[:BS])] = node
        cache.nodes[node_id] = node
        cache._next_id = node_id + 1
        cache.num_evictable_blocks = cache.num_evictable_blocks + len(blocks)
        return node, blocks

    def tree(self) -> dict[int, tuple]:
        """node id -> (parent id, tokens, block ids, lock count, last access), for every node but the root."""
        out = {}
        for node in self.cache.nodes.values():
            if node is not self.cache.root:
                out[node.node_id] = (node.parent.node_id, tuple(node.tokens), list(node.block_ids), node.lock_count,
                                     node.last_access)
        return out

    def refs(self) -> list[int]:
        return [b.ref_count for b in self.pool.blocks]

    def check(self, who: str, hint: str, locks: dict | None = None) -> None:
        """Every node under its first block's key in its parent; the engine's own tree and pool invariants."""
        for node in self.cache.nodes.values():
            if node is not self.cache.root:
                expect(node.parent.children.get(tuple(node.tokens[:BS])) is node,
                       f"after {who}, radix node {node.node_id} is not under the key of its first block in its parent",
                       KEY_HINT)
        try:
            RealCache.check_invariants(self.cache, locks or {})
            self.pool.check_invariants(RealCache.held_blocks(self.cache))
        except AssertionError as exc:
            raise CheckFailed(f"after {who}: {exc}", hint) from None


def span(first: int, n_blocks: int) -> list[int]:
    """`n_blocks` blocks of distinct tokens starting at `first` (100, 101, ... : every block differs)."""
    return list(range(first, first + n_blocks * BS))


def _path_blocks(node) -> list[int]:
    return [b for n in reversed(node.path()) for b in n.block_ids]


MATCH_HINT = ('match_prefix: a block counts only when every token in it agrees. Where does the walk stop, and '
              'which node and which blocks say how far it got?')


def match_prefix(ctx: Context) -> None:
    f = Fixture(ctx)
    a = span(100, 3)
    node_a, blocks_a = f.grow(None, a)
    before_refs, before_tree = f.refs(), f.tree()
    for tokens, want_blocks, what in ((a + [7], blocks_a, "all 12 cached tokens and one more"),
                                      ([5] + a, [], "another first token"),
                                      (a[:4], [], "one block: a prompt of at most one block matches nothing"),
                                      ([], [], "no tokens")):
        node, got = f.cache.match_prefix(tokens)
        hint = FULL_HIT if len(tokens) <= BS else MATCH_HINT
        expect(list(got) == want_blocks, f"match_prefix({what}) gave blocks {list(got)}, expected {want_blocks}", hint)
        want_node = node_a if want_blocks else f.cache.root
        expect(node is want_node, f"match_prefix({what}) returned radix node {node.node_id}, expected "
               f"{'node ' + str(want_node.node_id) if want_blocks else 'the root'}", MATCH_HINT)
    expect(f.refs() == before_refs and f.tree() == before_tree,
           "match_prefix changed ref counts, lock counts or the tree on prompts that needed no split",
           "match_prefix only looks: it neither shares nor locks (the caller does, if it admits the request)")
    node, got = f.cache.match_prefix(a)                       # the whole prompt is cached: the cap
    expect(len(got) < 3, "match_prefix of a 12-token prompt that is fully cached returned all 3 blocks", FULL_HIT)
    expect(list(got) == blocks_a[:2], f"match_prefix(the same 12 tokens) gave blocks {list(got)}, expected "
           f"{blocks_a[:2]}", FULL_HIT)
    expect(_path_blocks(node) == blocks_a[:2],
           f"match_prefix(12 cached tokens) returned a node whose path holds {_path_blocks(node)}, expected "
           f"{blocks_a[:2]}", "a match that ends inside a node's span splits it (self._split) and returns the head")
    f.check("a match that split a node", "split with self._split: the head keeps the first blocks")
    f2 = Fixture(ctx)
    node_a, blocks_a = f2.grow(None, a)
    node, got = f2.cache.match_prefix(a[:6] + [1, 2, 3, 4, 5, 6])
    expect(list(got) == blocks_a[:1] and _path_blocks(node) == blocks_a[:1],
           f"a prompt agreeing on 6 of a node's tokens matched blocks {list(got)}, expected {blocks_a[:1]}",
           "match whole blocks only: a block whose tokens agree only in part holds other KV")
    f2.check("a match inside a node", "split with self._split")
    f3 = Fixture(ctx)
    parent, pb = f3.grow(None, span(100, 2))
    c1, b1 = f3.grow(parent, span(200, 1))
    c2, b2 = f3.grow(parent, span(300, 2))
    node, got = f3.cache.match_prefix(span(100, 2) + span(300, 2) + [9])
    expect(list(got) == pb + b2 and node is c2, f"match_prefix through a node and its second child gave {list(got)}, "
           f"expected {pb + b2}", MATCH_HINT + " (through every node on the way)")
    node, got = f3.cache.match_prefix(span(100, 2) + span(200, 1))
    expect(list(got) == pb and node is parent, f"match_prefix(a 3-block prompt fully cached over two nodes) gave "
           f"{list(got)}, expected {pb} (the cap leaves the last block)", FULL_HIT)
    f4 = Fixture(ctx)
    top, tb = f4.grow(None, span(100, 1))
    low, lb = f4.grow(top, span(200, 3))
    node, got = f4.cache.match_prefix(span(100, 1) + span(200, 3))      # 4 blocks cached, the cap is 3
    expect(list(got) == tb + lb[:2] and _path_blocks(node) == tb + lb[:2],
           f"match_prefix(a 4-block prompt, all cached: 1 block, then a node of 3) gave {list(got)}, expected "
           f"{tb + lb[:2]} (the cap falls inside the second node: split it there)", FULL_HIT)


INSERT_HINT = ('insert: walk as match_prefix does. Where the tree has no continuation, how many nodes should hold'
               ' the rest? Where the tree already holds the same tokens in other blocks, the caller must learn '
               'which of its blocks repeat cached ones. An insert is a use too')


def insert(ctx: Context) -> None:
    f = Fixture(ctx)
    t = span(100, 3)
    mine = f.pool.allocate(3)
    f.clock.step = 3
    got = f.cache.insert("a", t, mine)
    expect(isinstance(got, tuple) and len(got) == 2, f"insert returned {got!r}, expected (node, duplicates)",
           INSERT_HINT)
    node, dups = got
    expect(list(dups) == [], f"inserting into an empty tree reported duplicates {list(dups)}", INSERT_HINT)
    tree = f.tree()
    expect(len(tree) == 1 and tree.get(node.node_id, (None,))[:3] == (0, tuple(t), mine),
           f"inserting 3 blocks into an empty tree made the tree {tree}, expected one node under the root "
           f"holding blocks {mine}", INSERT_HINT)
    expect([f.pool.blocks[b].ref_count for b in mine] == [2, 2, 2],
           "the tree holds no reference of its own on the blocks it caches", "new nodes come from self._add_node, "
           "which takes the tree's reference")
    expect(node.last_access == 3, f"the inserted node's last_access is {node.last_access}, expected the step (3)",
           "insert touches the last node of the path (self.touch)")
    expect(any(isinstance(e, RadixInserted) for e in f.events), "insert emitted no RadixInserted",
           "add new nodes with self._add_node (it emits the event)")
    f.pool.free(mine)
    f.check("insert into an empty tree", INSERT_HINT)

    theirs = f.pool.allocate(3)                                # a second request computed the same prefix
    refs = f.refs()
    node2, dups = f.cache.insert("b", t, theirs)
    want = [(i, theirs[i], mine[i]) for i in range(3)]
    expect([tuple(d) for d in dups] == want, f"inserting the same tokens in blocks {theirs} reported duplicates "
           f"{list(dups)}, expected {want}", "when the tree already holds the same tokens, insert reports "
           "(index, your block, cached block) so the caller swaps its copy for the cached one; otherwise the "
           "duplicate prefix block is freed while a table still points at it")
    expect(node2 is node and len(f.tree()) == 1 and f.refs() == refs,
           "inserting cached tokens again added a node or changed ref counts", INSERT_HINT)
    f.pool.free(theirs)

    f.clock.step = 5
    more = f.pool.allocate(1)
    node3, dups = f.cache.insert("c", t + span(400, 1), mine + more)
    expect(list(dups) == [] and node3.parent is node and list(node3.block_ids) == more and len(f.tree()) == 2,
           "inserting 4 blocks whose first 3 are cached should add one child node holding only the new block "
           f"(got blocks {list(node3.block_ids)} under node {node3.parent.node_id}, {len(f.tree())} nodes)",
           INSERT_HINT)
    expect(node.last_access == 5 and node3.last_access == 5, "insert did not touch every node on the path",
           "touch the last node (self.touch marks it and its ancestors)")
    f.pool.free(more)
    f.check("insert extending a cached path", INSERT_HINT)

    other = f.pool.allocate(2)
    node4, dups = f.cache.insert("d", t[:4] + span(500, 2), [mine[0]] + other)
    expect(list(dups) == [] and list(node4.block_ids) == other and list(node4.parent.block_ids) == [mine[0]],
           f"inserting tokens that leave a cached node after its first block gave a node with blocks "
           f"{list(node4.block_ids)} under one with {list(node4.parent.block_ids)}; expected {other} under "
           f"[{mine[0]}]", "where the new tokens leave a node part way, split it there (self._split) and add the "
                           "rest under the head")
    f.pool.free(other)
    f.check("insert that split a node", INSERT_HINT)

    g = Fixture(ctx)
    top, tb = g.grow(None, span(100, 1))
    low, lb = g.grow(top, span(200, 3))
    node6, dups = g.cache.insert("y", span(100, 1) + span(200, 3), tb + lb[:1])   # tokens for 4 blocks, 2 given
    expect(list(dups) == [] and list(node6.block_ids) == lb[:1] and node6.parent is top and
           list(node6.children.values())[0].block_ids == lb[1:],
           f"inserting 2 blocks whose tokens run on inside a cached node gave a node with blocks "
           f"{list(node6.block_ids)}, duplicates {list(dups)}; expected a split: [{lb[0]}] above {lb[1:]}",
           "only len(block_ids) whole blocks are inserted, whatever follows in `tokens`: compare at most the "
           "blocks you were given (n - i of them) with a node's span")
    g.check("insert of fewer blocks than its tokens", INSERT_HINT)

    refs, tree = f.refs(), f.tree()
    node5, dups = f.cache.insert("e", t + [1], mine)           # a partial 4th block: whole blocks only
    expect(list(dups) == [] and f.refs() == refs and {k: v[:3] for k, v in f.tree().items()} ==
           {k: v[:3] for k, v in tree.items()}, "inserting blocks the tree already holds (the same ids) changed it",
           "blocks already in the tree, in the same ids, are neither duplicates nor new")


EVICT_HINT = ('evict: which nodes may go (nobody locks them, nothing hangs below them), in which order (the least'
              ' recently used), how many (until n blocks are free), and what becomes of a parent whose last child'
              ' went?')


def evict(ctx: Context) -> None:
    f = Fixture(ctx)
    old, b_old = f.grow(None, span(100, 2), step=1)
    mid, b_mid = f.grow(None, span(200, 2), step=2)
    new, b_new = f.grow(None, span(300, 2), step=3)
    f.cache.lock(old)                                   # a running request uses the oldest leaf
    f.events.clear()
    freed = f.cache.evict(1)
    expect(all(f.pool.blocks[b].ref_count for b in b_old), "evict freed blocks of a locked node",
           "evict only unlocked leaves: a locked node's blocks are in a running request's table")
    expect(freed == 2 and all(f.pool.blocks[b].ref_count == 0 for b in b_mid) and
           all(f.pool.blocks[b].ref_count == 1 for b in b_new),
           f"evict(1) returned {freed} and left ref counts {f.refs()[:8]}; expected the whole least recently used "
           f"unlocked leaf (step 2, blocks {b_mid}) freed, and only it", EVICT_HINT)
    expect(mid.node_id not in f.cache.nodes and f.cache.root.children.get(tuple(span(200, 1))) is None,
           "the evicted node is still in the tree", "unlink the evicted leaf from its parent and from self.nodes")
    evicted = [e for e in f.events if isinstance(e, RadixEvicted)]
    expect(len(evicted) == 1 and evicted[0].node_id == mid.node_id and sorted(evicted[0].block_ids) == sorted(b_mid),
           f"evict(1) emitted {evicted}, expected one RadixEvicted for node {mid.node_id} with blocks {b_mid}",
           "emit RadixEvicted for every evicted leaf, with the blocks that went back to the free queue")
    f.check("evict(1)", EVICT_HINT, {old.node_id: 1})
    expect(f.cache.evict(0) == 0 and new.node_id in f.cache.nodes, "evict(0) evicted something",
           "evict stops as soon as n blocks are free")
    f.cache.unlock(old)

    g = Fixture(ctx)
    parent, pb = g.grow(None, span(100, 2), step=1)
    child, cb = g.grow(parent, span(200, 1), step=5)
    leaf, lb = g.grow(None, span(300, 2), step=3)
    freed = g.cache.evict(g.pool.num_blocks)
    order = [e.node_id for e in g.events if isinstance(e, RadixEvicted)]
    want = [leaf.node_id, child.node_id, parent.node_id]
    expect(order == want and freed == 5, f"evicting everything (a step-3 leaf, a step-5 leaf under a step-1 node) "
           f"evicted nodes {order} and returned {freed}; expected {want} and 5",
           "after a leaf goes, its parent may have become an unlocked leaf: it is a candidate too (push it on the "
           "heap), and it is the least recently used")
    expect(g.pool.num_free_blocks == g.pool.num_blocks and g.cache.num_evictable_blocks == 0 and not g.tree(),
           f"after evicting everything: {g.pool.num_free_blocks} of {g.pool.num_blocks} blocks free, "
           f"num_evictable_blocks {g.cache.num_evictable_blocks}, {len(g.tree())} nodes left",
           "free every evicted block, unlink it, and subtract it from num_evictable_blocks")
    g.check("evicting everything", EVICT_HINT)

    h = Fixture(ctx)
    for i in range(3):
        h.grow(None, span(100 * (i + 1), 2), step=i + 1)
    freed = h.cache.evict(3)
    expect(freed == 4 and len(h.tree()) == 1, f"evict(3) with three 2-block leaves freed {freed} blocks and left "
           f"{len(h.tree())} nodes; expected 4 and 1", "evict stops as soon as at least n blocks are free")


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0)
    again = prompts(1, 12, seed=1)[0]                 # 3 whole blocks, asked twice: the second is a full hit
    try:
        run_engine(ctx, ctx.components(), [("a", again, greedy), ("b", again, greedy)],
                   {"num_blocks": 16, "max_num_seqs": 1}, max_steps=60)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc} (the same 12-token prompt twice)", FULL_HIT) from None
    reqs = [(f"s{i}", p, greedy) for i, p in enumerate(prompts(6, 14, shared=9))]
    reqs += [(f"x{i}", p, greedy) for i, p in enumerate(prompts(2, 13, seed=3))]
    config = {"num_blocks": 16, "max_num_seqs": 3}
    same_as_engine(ctx, reqs, config, "the engine's tokens differ with your cache: a hit must share exactly "
                   "the blocks that hold those tokens' KV")
    ref, _ = run_engine(ctx, Components(), reqs, config)
    mine, _ = run_engine(ctx, ctx.components(), reqs, config)
    want, got = ref.prefix_cache_stats()["num_hit_tokens"], mine.prefix_cache_stats()["num_hit_tokens"]
    expect(got == want, f"prefix hits skipped {got} prompt tokens; the engine's own cache skips {want}",
           "requests sharing a system prompt should hit the cache: insert adds every filled block, match "
           "walks down through whole-block keys")


INVARIANTS = """The tree holds one reference on each block of each node; a node's children are keyed by
the tokens of their first block (so two children never start with the same block); a
node spans whole blocks: len(tokens) == len(block_ids) * block_size. lock_count counts
the running sequences using a node or a node below it; num_evictable_blocks is the number
of blocks in unlocked nodes. match_prefix changes no ref count and no lock."""

LAB = Lab(
    name="radix-cache",
    title="the radix prefix cache: match whole blocks, insert, evict LRU unlocked leaves",
    module="nanoserve.radix_cache",
    blanks={
        "RadixCache.match_prefix": "walk down from the root while a child is keyed by the next block of tokens "
                                   "(self._key); count the common blocks (self._common_blocks), split a node "
                                   "you leave part way (self._split); never match more than "
                                   "(len(tokens) - 1) // block_size blocks",
        "RadixCache.insert": "walk down like match_prefix; where no child starts with the next block add a node "
                             "(self._add_node) for all remaining blocks; where the tree already holds those "
                             "tokens in other blocks, list (index, your block, cached block) as duplicates; "
                             "touch the last node",
        "RadixCache.evict": "heap of unlocked leaves by last_access; pop, unlink from the parent, free their "
                            "blocks (self.pool.free), update num_evictable_blocks, emit RadixEvicted; push the "
                            "parent if it became an unlocked leaf",
    },
    contracts={
        "RadixCache.match_prefix": "Returns the deepest node whose path is a prefix of `tokens` in whole blocks, "
                                   "and the blocks along that path, at most (len(tokens) - 1) // block_size of "
                                   "them. A match ending inside a node's span leaves the tree split at that block "
                                   "(the returned node is the head). No ref count or lock changes.",
        "RadixCache.insert": "Afterwards the tree holds `tokens` (the first len(block_ids) whole blocks) on one "
                             "path; blocks it did not hold join it in ONE new node, with the tree's reference. "
                             "Returns (the node at the end of the path, [(index, caller's block, cached block) "
                             "for every block the tree already held in another id]). The path is touched.",
        "RadixCache.evict": "Frees unlocked leaves, least recently used first (a parent left an unlocked leaf "
                            "counts as one), whole, until at least num_blocks blocks went back to the pool or "
                            "nothing is left to evict; emits RadixEvicted for each. Returns the blocks freed.",
    },
    invariants=INVARIANTS,
    components=lambda m: Components(radix_cache=m.RadixCache),
    checks=(
        SIGNATURES,
        Check("RadixCache.match_prefix: whole blocks, never the whole prompt", match_prefix,
              "match whole blocks only, split a node a match leaves part way, and leave at least one token to "
              "compute", 60, function="RadixCache.match_prefix"),
        Check("RadixCache.insert: one node for new blocks; duplicates", insert, INSERT_HINT, 60,
              function="RadixCache.insert"),
        Check("RadixCache.evict: least recently used unlocked leaves", evict, EVICT_HINT, 60,
              function="RadixCache.evict"),
        Check("real engine: same tokens and hits, with eviction", engine_runs,
              "insert and evict meet here: every node must stay under the key of its first block, and a locked node "
              "stays; run the engine with your cache "
              "(engine.check_invariants() after each step says which broke)", 240),
    ),
    why=(
        ("Why does a match stop one token short of a fully cached prompt?",
         "The step that admits the request must compute at least one token: the logits of the last prompt "
         "token are what the next token is sampled from, and a cache stores KV, not logits."),
        ("Why are children keyed by their first block of tokens, not by their first token?",
         "The tree shares whole blocks. Two spans that agree on their first token but differ later in the "
         "block hold different KV in that block; keyed by the whole block, two children can never share one, "
         "and a lookup is one dict access per block."),
        ("Why evict leaves only, least recently used first?",
         "A node's KV is valid only after its parent's (K and V at position i depend on tokens 0..i): evicting "
         "an inner node would strand its children. Among leaves, the least recently used is the best guess "
         "for the prefix least likely to be asked for again."),
    ),
    prerequisites="the block-pool lab; lesson 4 (prefix caching)",
    minutes=60,
)
