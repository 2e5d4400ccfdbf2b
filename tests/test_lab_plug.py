"""`--lab NAME=FILE`: the engine runs the student's component; with the engine's own module as the
"student's" file, every event and every TUI frame is the same as without `--lab`."""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve import block_pool, radix_cache
from nanoserve.cli import main
from nanoserve.labs.plug import components_from
from nanoserve.trace import read_trace
from nanoserve_tui.app import make_source
from nanoserve_tui.source import ReplaySource


def timeless(events):
    """Events without wall-clock fields (a step's duration differs run to run)."""
    return [dataclasses.replace(e, duration_s=0.0) if hasattr(e, "duration_s") else e for e in events]


def test_record_with_the_engines_own_module_gives_the_same_frames(tmp_path):
    plain, mine = tmp_path / "plain.jsonl", tmp_path / "mine.jsonl"
    assert main(["record", "-s", "memory-pressure", "-m", "tiny-llama", "-o", str(plain)]) == 0
    assert main(["record", "-s", "memory-pressure", "-m", "tiny-llama", "-o", str(mine), "--lab", f"block-pool={block_pool.__file__}",
                 "--lab", f"radix-cache={radix_cache.__file__}"]) == 0
    a, b = timeless(read_trace(plain)), timeless(read_trace(mine))
    assert a == b and len(a) > 50
    ra, rb = ReplaySource(a), ReplaySource(b)
    assert ra.last == rb.last
    for step in range(ra.last + 1):
        assert ra.frame(step).state == rb.frame(step).state


def test_generate_with_lab_prints_the_same_text(tmp_path, capsys):
    argv = ["generate", "--max-tokens", "12", "Hello there", "Goodbye"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--lab", f"block-pool={block_pool.__file__}"]) == 0
    assert capsys.readouterr().out == plain


def test_tui_source_runs_the_students_component(tmp_path):
    components = components_from([f"block-pool={block_pool.__file__}"])
    assert components.block_pool is not block_pool.BlockPool and components.block_pool.__name__ == "BlockPool"
    source = make_source(model=None, replay=None, scenario="memory-pressure", components=components)
    assert source.components is components and source.description.endswith("with your block_pool")
    with pytest.raises(ValueError, match="--lab"):
        make_source(replay=str(tmp_path / "t.jsonl"), components=components)


@pytest.mark.parametrize("spec,text", [("block-pool", "takes NAME=FILE"), ("nope=x.py", "is not a lab"),
                                       ("block-pool=missing.py", "missing.py: no such file"),
                                       ("block-pool=bad.py", "bad.py:1: syntax error")])
def test_bad_lab_option_is_one_line(spec, text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text("def (\n")
    assert main(["generate", "Hi", "--lab", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanoserve: error: --lab ") and text in err and err.count("\n") == 1


FAILING_POOL = '''\
from nanoserve.block_pool import Block, FreeBlockQueue  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool


class BlockPool(_Pool):
    def allocate(self, n):
        if n > len(self.free_queue) - 4:       # the bug: four blocks it never hands out
            raise MemoryError(f"need {n} blocks, only {len(self.free_queue)} free")
        return super().allocate(n)
'''


def test_tui_pauses_on_a_step_that_fails_in_the_students_code(tmp_path):
    """`r` with a failing part: the run pauses on the failing step, one panel (not a toast per retry) says
    where it failed with the check's hint, and the panels show the pool as that step left it."""
    from test_tui import WIDE, notices, run_async, wait_for


    path = tmp_path / "bad_pool.py"
    path.write_text(FAILING_POOL)
    app = lab_app(path)

    @run_async
    async def drive():
        async with app.run_test(size=WIDE) as pilot:
            await run_until_the_lab_fails(pilot, app)
            await wait_for(pilot, lambda: app.frame is app.source._frame)   # the last frame posted is shown
            failed_at = app.frame.state.step
            panel = str(app.query_one("#lab-error").render())
            assert app.query_one("#lab-error").display and "bad_pool.py:8 in allocate: MemoryError" in panel
            assert "hint:" in panel and "nanoserve lab check block-pool" in panel
            assert "engine step failed" not in notices(app)            # no toast per retry
            assert "running" not in str(app.query_one("#status").render())
            await pilot.pause(0.5)
            assert app.frame.state.step == failed_at                   # paused there
            await pilot.press("space")                                 # stepping on is refused, once
            await pilot.pause(0.2)
            assert notices(app).count("failed in your code") == 1
    drive()


def test_tui_pauses_on_the_step_that_leaks(tmp_path):
    """A pool whose free forgets to queue a block it frees: the run pauses on the step of the leak, one panel
    saying which invariant broke, instead of running on while blocks are held by nobody."""
    import inspect

    from test_tui import WIDE, run_async, wait_for


    path = tmp_path / "leaky_pool.py"
    source = inspect.getsource(block_pool)
    assert source.count("                self.free_queue.append(block)\n") == 1
    path.write_text(source.replace("                self.free_queue.append(block)\n", "                pass\n"))
    app = lab_app(path)

    @run_async
    async def drive():
        async with app.run_test(size=WIDE) as pilot:
            await run_until_the_lab_fails(pilot, app)
            await wait_for(pilot, lambda: app.frame is app.source._frame)
            panel = str(app.query_one("#lab-error").render())
            assert app.query_one("#lab-error").display and "broke an invariant: invariant broken" in panel, panel
            assert app.source.lab_failed == f"step {app.frame.state.step}"     # paused on the step of the leak
    drive()


def lab_app(path):
    """The TUI live on memory-pressure with the student's block pool at `path`, failures explained as --lab does."""
    from nanoserve.labs.plug import explain_failure
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.live_source import LiveSource
    return NanoserveApp(LiveSource(scenario="memory-pressure", components=components_from([f"block-pool={path}"]),
                                   explain=explain_failure))


async def run_until_the_lab_fails(pilot, app) -> None:
    """Run at speed until the student's part fails a step, and the run has paused."""
    from test_tui import wait_for
    await wait_for(pilot, lambda: app.frame is not None)
    app.speed = 5
    await pilot.press("r")
    await wait_for(pilot, lambda: app.source.lab_failed is not None, timeout=120)
    await wait_for(pilot, lambda: not app.playing and not app.source._pending_steps)
