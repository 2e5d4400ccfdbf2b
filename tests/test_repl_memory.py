"""REPL views of the memory mechanisms: the radix cache as a rich Tree, the pool strip's cell kinds,
and a live engine's panel with prefix caching and swapping on."""

from __future__ import annotations

from rich.console import Console

from nanoserve.viz.repl import render_pool, render_radix

NODES = [  # the shape of RadixCache.snapshot(): parents before children, the root left out
    {"node_id": 1, "parent_id": 0, "text": "You are a helpful bot.", "num_tokens": 8, "block_ids": [0, 1],
     "lock_count": 2, "last_access": 4},
    {"node_id": 3, "parent_id": 1, "text": " Tell\nme", "num_tokens": 4, "block_ids": [3],
     "lock_count": 1, "last_access": 4},
    {"node_id": 2, "parent_id": 1, "text": " Hi" + "!" * 60, "num_tokens": 4, "block_ids": [2],
     "lock_count": 0, "last_access": 3},
    {"node_id": 5, "parent_id": 0, "text": "Other", "num_tokens": 4, "block_ids": [7],
     "lock_count": 0, "last_access": 1},
]


def plain(renderable, width: int = 120) -> str:
    console = Console(width=width, record=True, file=None, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def test_render_radix_tree_shape_and_labels():
    panel = render_radix(NODES)
    tree = panel.renderable
    assert "4 nodes, 5 blocks cached, 2 evictable" in tree.label.plain
    top = [child.label.plain for child in tree.children]
    assert len(top) == 2 and top[0].startswith("'You are a helpful bot.'") and top[1].startswith("'Other'")
    under = [child.label.plain for child in tree.children[0].children]
    assert len(under) == 2
    assert "' Tell⏎me'" in under[0] and "#3 · 4 tokens · blocks 3" in under[0] and "lock 1" in under[0]
    assert "unlocked, evictable" in under[1] and "last used step 3" in under[1] and "…" in under[1]
    assert "lock 2" in top[0] and "blocks 0 1" in top[0]
    text = plain(panel)
    assert "RadixCache" in text and "└──" in text


def test_render_radix_empty_and_orphans():
    assert "nothing cached yet" in plain(render_radix([]))
    orphan = [{"node_id": 9, "parent_id": 42, "text": "x", "num_tokens": 4, "block_ids": [1], "lock_count": 0,
               "last_access": 0}]
    assert "'x'" in plain(render_radix(orphan))


def test_render_pool_cell_kinds():
    # block 0 free; 1 one request; 2 shared by two requests and the cache; 3 only the cache; 4 request + cache
    ref_counts = [0, 1, 3, 1, 2]
    owners = {1: 0, 2: 1, 4: 1}
    strip = render_pool(ref_counts, owners, cached={2, 3, 4}, holders={1: 1, 2: 2, 4: 1})
    assert strip.plain == "·■■□▣"
    styles = {span.start: str(span.style) for span in strip.spans}
    assert styles[2] == "bold white on red" and styles[3] == "green"
    # without cache information, a ref count above 1 means shared, as before
    assert render_pool([0, 2, 1], {2: 0}).plain == "·■■"


def test_live_engine_panel_shows_cache_and_swap():
    from nanoserve import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=32, preemption_mode="swap"))
    for rid in ("a", "b"):
        engine.add_request(rid, "You are a helpful assistant. Hi", SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    text = plain(engine.__rich__())
    assert "prefix cache:" in text and "blocks cached" in text and "CPU swap pool: 0/32" in text
    assert "cached only (evictable)" in text
    assert "RadixCache" in plain(render_radix(engine.snapshot()["radix"]["nodes"]))
