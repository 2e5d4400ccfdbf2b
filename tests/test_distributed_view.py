"""Watching distributed runs: the fold, the TUI's ranks bar and rank switcher, the split picture.

The replays use traces recorded from real runs (tests/data/tui-tensor-parallel.jsonl:
the tensor-parallel scenario; tests/data/tui-disaggregated.jsonl: the decode side
of a disaggregated run; both written by docs/img/make_distributed_pictures.py),
so they need no worker process. Traces recorded before these events existed
still replay (the memory-pressure trace has no ranks).
"""

from __future__ import annotations

import asyncio
import functools
import html
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from nanoserve import events as ev
from nanoserve.distributed.layers import attach
from nanoserve.distributed.sharding import describe_shard, shard_model, split_plan, vocab_slice
from nanoserve.trace import fold_all, read_trace
from nanoserve.viz.tp_dot import split_dot

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
TP_TRACE, DISAGG_TRACE = DATA / "tui-tensor-parallel.jsonl", DATA / "tui-disaggregated.jsonl"
OLD_TRACE = DATA / "tui-memory-pressure.jsonl"


def run_async(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return wrapper


# -- the fold -------------------------------------------------------------------------------------

def test_fold_keeps_ranks_collectives_and_transfers():
    events = read_trace(TP_TRACE)
    state = fold_all(events)
    assert [(r.rank, r.kv_heads) for r in state.ranks] == [(0, (0,)), (1, (1,))]
    assert state.ranks[0].digest == state.ranks[1].digest
    last = max(e.step for e in events if isinstance(e, ev.CollectiveOps))
    kinds = {e.kind for e in events if isinstance(e, ev.CollectiveOps) and e.step == last}
    assert {k for k, *_ in state.collectives} == kinds >= {"all_reduce", "gather", "broadcast"}

    disagg = fold_all(read_trace(DISAGG_TRACE))
    arrived = [e for e in read_trace(DISAGG_TRACE) if isinstance(e, ev.KVTransferred)]
    assert [(t.request_id, t.block_ids, t.num_bytes) for t in disagg.transfers] == \
        [(e.seq_id, list(e.block_ids), e.num_bytes) for e in arrived]
    assert disagg.ranks == [] and fold_all(read_trace(OLD_TRACE)).ranks == []


# -- the TUI --------------------------------------------------------------------------------------

@run_async
async def test_rank_switcher_and_ranks_bar():
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.source import ReplaySource
    from nanoserve_tui.widgets.pool import PoolGrid, PoolPanel

    app = NanoserveApp(ReplaySource.from_path(TP_TRACE))
    async with app.run_test(size=(160, 50)) as pilot:
        while app.frame is None:
            await pilot.pause(0.02)
        for _ in range(5):
            await pilot.press("space")
        await pilot.pause(0.1)
        pool = app.query_one(PoolPanel)
        bar = str(app.query_one("#ranks").render())
        assert app.query_one("#ranks").display
        assert "0 · KV heads 0" in bar and "1 · KV heads 1" in bar and "same slots ✓" in bar
        assert "all_reduce×5" in bar                     # 2 layers × 2 + the embedding
        assert pool.border_title.startswith("KV block pool · rank 0 of 2 · KV heads 0")
        app.query_one(PoolGrid).selected = 0
        await pilot.press("k")
        await pilot.pause(0.1)
        assert pool.border_title.startswith("KV block pool · rank 1 of 2 · KV heads 1")
        assert "on rank 1: K/V of KV heads 1" in str(app.query_one("#block-info").render())
        await pilot.press("k")
        assert pool.border_title.startswith("KV block pool · rank 0 of 2")


@run_async
async def test_handoffs_show_and_an_old_trace_has_no_ranks():
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.source import ReplaySource

    app = NanoserveApp(ReplaySource.from_path(DISAGG_TRACE))
    async with app.run_test(size=(160, 50)) as pilot:
        while app.frame is None:
            await pilot.pause(0.02)
        for _ in range(3):
            await pilot.press("space")
        await pilot.pause(0.1)
        bar = str(app.query_one("#ranks").render())
        assert "KV in" in bar and "prefill[" in bar
    app = NanoserveApp(ReplaySource.from_path(OLD_TRACE))
    async with app.run_test(size=(160, 50)) as pilot:
        while app.frame is None:
            await pilot.pause(0.02)
        await pilot.press("space", "k")
        await pilot.pause(0.1)
        assert not app.query_one("#ranks").display
        assert "no ranks to switch" in "\n".join(str(n.message) for n in app._notifications)


# -- the shards, and the picture drawn from them ----------------------------------------------------

def test_shards_compute_the_full_layer(tiny_llama):
    """Column-parallel then row-parallel: the ranks' partial sums add up to the unsplit MLP."""
    class Summed:   # stands in for the all-reduce: keeps each rank's partial output
        rank = 0

        def __init__(self):
            self.parts = []

        def all_reduce(self, t):
            self.parts.append(t.clone())
            return t

    model = tiny_llama.model
    x = torch.randn(5, 64)
    comm = Summed()
    for r in range(2):
        attach(shard_model(model, r, 2), comm).model.layers[0].mlp(x)
    full = model.model.layers[0].mlp(x)
    torch.testing.assert_close(comm.parts[0] + comm.parts[1], full, rtol=1e-5, atol=1e-5)
    assert vocab_slice(257, 0, 2) == (0, 129, 129) and vocab_slice(257, 1, 2) == (129, 257, 129)


def test_split_picture_is_drawn_from_the_shards(tiny_llama, tiny_gpt2):
    request = {"seq_id": "q0", "num_computed_tokens": 10, "block_table": [3, 7, 9]}
    source = split_dot(split_plan(tiny_llama.model, 2), request, block_size=4, num_blocks=48)
    for r in range(2):
        shard = describe_shard(shard_model(tiny_llama.model, r, 2))
        k = next(w for w in shard if w["name"] == "k_proj")
        assert k["shape"] == (16, 64) and k["owned"] == ((16 * r, 16 * (r + 1)),)
        assert f"rows {16 * r}–{16 * r + 15} (head {r})" in source
        assert f"KV heads {r} only" in source
    assert source.count("all-reduce (sum)") == 3 and "gather to rank 0" in source
    assert "block 9" in source and "tokens 8–9 (2/4)" in source
    gpt2 = split_dot(split_plan(tiny_gpt2.model, 2))
    assert "rows 0–31, 64–95, 128–159 (heads 0–1 of q, k and v)" in gpt2


def test_the_docs_split_picture_is_current():
    """docs/img/tp-split.svg has every label the code draws today (rerun make_distributed_pictures.py)."""
    spec = importlib.util.spec_from_file_location("pictures", ROOT / "docs/img/make_distributed_pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    svg = html.unescape(pictures.SPLIT.read_text())
    source = pictures.split_source()                     # starts a real 2-rank engine
    for label in re.findall(r"<B>(\w+)</B>", source) + re.findall(r"(rows [\d–, ]+)", source):
        assert label.strip() in svg, label
    for line in re.findall(r"<TD>(tokens [^<]+)</TD>", source):
        assert line in svg, line


def test_describe_events_in_the_event_log():
    pytest.importorskip("textual")
    from nanoserve_tui.widgets.event_log import describe

    assert describe(ev.KVTransferred(3, "q1", "prefill", "decode", (0, 1), (15, 16), 7, 2048, 0.001)) == \
        "q1 prefill [0 1] -> decode [15 16]: KV of 7 tokens, 2048 bytes"
    assert describe(ev.CollectiveOps(3, "all_reduce", 5, 1280, 0.002)) == "all_reduce ×5, 1280 bytes from rank 0"
