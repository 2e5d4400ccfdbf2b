"""Lab radix-cache: the prefix cache's match, insert and eviction (nanoserve/radix_cache.py).

The student writes `RadixCache.match_prefix`, `insert` and `evict`; the
helpers around them (`_key`, `_common_blocks`, `_split`, `_add_node`,
`lock`, `unlock`) stay the engine's. The checks build a small tree by hand
(block size 4, token ids chosen so every block differs), then run the real
engine on requests that share a system prompt in a pool small enough that
cached blocks must be evicted.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine, same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect
from nanoserve.radix_cache import RadixCache as RealCache

BS = 4
FULL_HIT = ("a full-prompt prefix hit leaves nothing to compute: the step needs at least one token to produce "
            "the next token's logits, so match at most (len(tokens) - 1) // block_size blocks")


def _cache(ctx: Context, num_blocks: int = 16):
    pool = BlockPool(num_blocks, BS)
    return pool, ctx.module.RadixCache(pool, lambda event: None)


def _fill(pool, cache, rid: str, tokens: list[int]) -> list[int]:
    """What the engine does for a request: allocate its blocks, insert them, drop its own reference."""
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(rid, tokens, blocks)
    pool.free(blocks)
    _keys(cache)
    return blocks


def _keys(cache) -> None:
    """Every node sits in its parent's children under the tokens of its own first block."""
    for node in list(cache.nodes.values()):
        if node is not cache.root:
            expect(node.parent.children.get(tuple(node.tokens[:BS])) is node,
                   f"radix node {node.node_id} is not under the key of its first block in its parent",
                   "a node is found by the tokens of its first block: a cached span that loses its key is "
                   "never matched again (file it under tokens[:block_size])")


def _check(cache, locks=None) -> None:
    RealCache.check_invariants(cache, locks or {})
    cache.pool.check_invariants(RealCache.held_blocks(cache))


def match_whole_blocks(ctx: Context) -> None:
    pool, cache = _cache(ctx)
    tokens = list(range(100, 112))                            # 3 blocks
    blocks = _fill(pool, cache, "a", tokens)
    node, got = cache.match_prefix(tokens)
    expect(len(got) < 3, "match_prefix of a 12-token prompt that is fully cached returned all 3 blocks", FULL_HIT)
    expect(got == blocks[:2], f"match_prefix(the same 12 tokens) gave blocks {got}, expected {blocks[:2]}")
    _check(cache)
    node, got = cache.match_prefix(tokens + [7])
    expect(got == blocks, f"match_prefix(13 tokens, 12 cached) gave {got}, expected all of {blocks}")
    node, got = cache.match_prefix(tokens[:6] + [1, 2, 3, 4, 5, 6])
    expect(got == blocks[:1], f"a prompt agreeing on 6 tokens matched blocks {got}, expected {blocks[:1]}",
           "match whole blocks only: a block whose tokens agree only in part holds other KV")
    _check(cache)
    node, got = cache.match_prefix([5] + tokens)
    expect(got == [] and node is cache.root, f"a prompt with another first token matched {got}")


def match_splits(ctx: Context) -> None:
    pool, cache = _cache(ctx)
    tokens = list(range(100, 116))                            # 4 blocks in one node
    blocks = _fill(pool, cache, "a", tokens)
    node, got = cache.match_prefix(tokens[:8] + [1, 2, 3, 4, 5])
    expect(got == blocks[:2], f"matching 2 of a node's 4 blocks gave {got}, expected {blocks[:2]}")
    path = [b for n in reversed(node.path()) for b in n.block_ids]
    expect(path == blocks[:2], f"the returned node's path holds blocks {path}, expected {blocks[:2]}",
           "a match that ends inside a node's span splits the node (self._split) and returns the head")
    _check(cache)


def insert_duplicates(ctx: Context) -> None:
    pool, cache = _cache(ctx)
    tokens = list(range(100, 108))
    mine = pool.allocate(2)
    node, dups = cache.insert("a", tokens, mine)
    expect(dups == [], f"inserting into an empty tree reported duplicates {dups}")
    theirs = pool.allocate(2)                                  # a second request computed the same prefix
    node2, dups = cache.insert("b", tokens, theirs)
    expect(dups == [(0, theirs[0], mine[0]), (1, theirs[1], mine[1])],
           f"inserting the same tokens in blocks {theirs} reported duplicates {dups}",
           "when the tree already holds the same tokens, insert must report (index, your block, cached block) "
           "so the caller swaps its copy for the cached one; otherwise the duplicate prefix block is freed "
           "while a table still points at it")
    expect(node2 is node, "inserting the same tokens twice made a second node for them")
    more = pool.allocate(1)
    node3, dups = cache.insert("c", tokens + [1, 2, 3, 4], mine + more)
    expect(dups == [] and node3.parent is node and node3.block_ids == more,
           "inserting 3 blocks whose first 2 are cached should add one child node holding only the new block")
    expect(cache.root.children.get(tuple(tokens[:BS])) is node,
           "the cached span is no longer found under the key of its first block",
           "a node is found by the tokens of its first block: a cached span that loses its key is never matched")
    cache.pool.free(theirs)
    cache.pool.free(mine + more)
    _check(cache)


def evict_lru(ctx: Context) -> None:
    pool, cache = _cache(ctx)
    ids = {}
    for step, first in enumerate((100, 200, 300), 1):          # three branches, inserted at steps 1, 2, 3
        cache.clock.step = step
        ids[first] = _fill(pool, cache, f"r{step}", list(range(first, first + 8)))
    oldest = cache.match_prefix(list(range(100, 109)))[0]
    cache.lock(oldest)                                          # a running request uses the oldest branch
    freed = cache.evict(1)
    expect(ids[100][0] not in pool.free_queue.ids(), "evict freed blocks of a locked node",
           "evict only unlocked leaves: a locked node's blocks are in a running request's table")
    expect(freed == 2 and set(ids[200]) <= set(pool.free_queue.ids()),
           f"evict(1) freed {freed} blocks; expected the whole least recently used unlocked leaf (step 2, "
           f"blocks {ids[200]})",
           "evict the unlocked leaf with the smallest last_access first (least recently used)")
    _check(cache, {oldest.node_id: 1})
    cache.unlock(oldest)
    cache.clock.step = 4
    _fill(pool, cache, "r4", list(range(300, 312)))    # extends the step-3 branch: a parent and a leaf
    _check(cache)
    freed = cache.evict(pool.num_blocks)
    expect(freed == 2 + 3 and cache.num_cached_blocks == 0,
           f"evicting everything freed {freed} blocks and left {cache.num_cached_blocks} cached",
           "after a leaf goes, its parent may have become an unlocked leaf: it is a candidate too")
    expect(pool.num_free_blocks == pool.num_blocks, "blocks leaked after evicting everything")
    _check(cache)


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
    components=lambda m: Components(radix_cache=m.RadixCache),
    checks=(
        SIGNATURES,
        Check("match: whole blocks, never the whole prompt", match_whole_blocks,
              "match whole blocks only, and leave at least one token to compute", 30),
        Check("match inside a node splits it", match_splits,
              "split the node at the block where the match ends; return the head node", 30),
        Check("insert: new spans and duplicates", insert_duplicates,
              "insert reports blocks the tree already holds, and adds one node for the new tail", 30),
        Check("evict: least recently used unlocked leaves", evict_lru,
              "evict unlocked leaves, oldest last_access first; parents become leaves", 30),
        Check("real engine: same tokens and hits, with eviction", engine_runs,
              "run the engine with your cache; every node must stay under the key of its first block "
              "(engine.check_invariants() after each step says which broke)", 240),
    ),
    prerequisites="the block-pool lab; lesson 4 (prefix caching)",
    minutes=60,
)
