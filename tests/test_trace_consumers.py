"""One trace check for every consumer: `export`, `tui --replay`, `plot`, `compare --trace` and the
what-if API (`compare`, `figure`) refuse the same bad traces with the same one line, naming the
file, the line and the field; a last line cut mid-way is left out with a warning, not refused.

The bad traces are the committed one (tests/data/tui-memory-pressure.jsonl) with one edit each:
broken types, values outside their set or range, steps out of order, and hand edits that break
the pool's books (a block freed that nobody held, a released list naming a block twice, a
negative ref count). Every engine-written trace passes the same check: the engine state
machine (test_engine_stateful.py) runs it on each example's events.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from conftest import FullDisk

from nanoserve.cli import main
from nanoserve.trace import JsonlRecorder, TraceWarning, read_trace
from nanoserve.trace_check import check_trace, load_trace

TRACE = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"
LINES = TRACE.read_text().splitlines()


def line_of(kind: str, nth: int = 1) -> int:
    """The line number (1-based) of the nth event of type `kind` (the trace predates "Sequence" names)."""
    names = {kind, kind.replace("Sequence", "Request")}
    hits = [i for i, line in enumerate(LINES, 1) if json.loads(line)["type"] in names]
    return hits[nth - 1]


def edited(line: int, **changes) -> list[str]:
    lines = list(LINES)
    event = json.loads(lines[line - 1])
    event.update(changes)
    lines[line - 1] = json.dumps(event)
    return lines


def released_twice() -> list[str]:
    line = line_of("BlocksFreed")
    released = json.loads(LINES[line - 1])["released"]
    return edited(line, released=released + released[:1])


def free_unheld_block() -> list[str]:
    """A BlocksFreed before anything ran, of block 5, which is free at the start."""
    lines = list(LINES)
    lines.insert(1, json.dumps({"type": "BlocksFreed", "step": 0, "seq_id": "r0", "block_ids": [5],
                                "released": [5]}))
    return lines


def second_synced() -> list[str]:
    lines = list(LINES)
    lines.insert(line_of("StepStarted", 3) - 1, LINES[0])
    return lines


def out_of_order() -> list[str]:
    return edited(line_of("StepStarted", 3), step=1)


BAD = {   # name -> (the edited lines, the line named in the error, what the error says)
    "second EngineSynced": (second_synced, lambda: line_of("StepStarted", 3), "a second EngineSynced"),
    "steps out of order": (out_of_order, lambda: line_of("StepStarted", 3), "step 1 starts after step 2"),
    "num_blocks 0": (lambda: edited(1, num_blocks=0), lambda: 1, "cannot exist"),
    "block_size 0": (lambda: edited(1, block_size=0), lambda: 1, "cannot exist"),
    "step 1.5": (lambda: edited(line_of("BlocksAllocated"), step=1.5), lambda: line_of("BlocksAllocated"),
                 "field step should be int"),
    "NaN duration": (lambda: edited(line_of("StepFinished"), duration_s=float("nan")),
                     lambda: line_of("StepFinished"), "field duration_s is NaN"),
    "negative duration": (lambda: edited(line_of("StepFinished"), duration_s=-1.0),
                          lambda: line_of("StepFinished"), "field duration_s must be >= 0"),
    "unheld block freed": (free_unheld_block, lambda: 2, "block 5 is dropped 1 time(s) but has 0 holder(s)"),
    "released twice": (released_twice, lambda: line_of("BlocksFreed"), "field released lists a block twice"),
    "negative ref count": (lambda: edited(1, ref_counts=[-1] + json.loads(LINES[0])["ref_counts"][1:]),
                           lambda: 1, "field ref_counts must be >= 0"),
    "unknown preemption mode": (lambda: edited(line_of("Preempted"), mode="rm -rf /"), lambda: line_of("Preempted"),
                                "field mode must be one of recompute, swap"),
    "unknown finish reason": (lambda: edited(line_of("SequenceFinished"), finish_reason="exploded"),
                              lambda: line_of("SequenceFinished"), "field finish_reason must be one of"),
}


def write(tmp_path, lines: list[str], name: str = "bad.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nanoserve: error: "), err
    return lines[0]


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


CONSUMERS = {
    "export": lambda p, tmp: ["export", "-t", p, "-f", "dot", "-o", tmp / "x.dot"],
    "plot": lambda p, tmp: ["plot", "--trace", p, "--what", "blocks", "-o", tmp / "x.png"],
    "compare --trace": lambda p, tmp: ["compare", "--trace", TRACE, "--trace", p],
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_every_command_refuses_a_bad_trace_in_one_line(capsys, tmp_path, consumer, name):
    make, line, needle = BAD[name]
    path = write(tmp_path, make())
    code, err = cli(capsys, *CONSUMERS[consumer](path, tmp_path))
    message = one_error_line(err)
    assert code == 2
    assert f"{path}: line {line()} (" in message and needle in message, message


@pytest.mark.parametrize("name", list(BAD))
def test_replay_and_whatif_refuse_it_with_the_same_line(capsys, tmp_path, name):
    from nanoserve.whatif import compare
    from nanoserve.whatif.plots import figure
    from nanoserve_tui.app import run_app

    make, line, needle = BAD[name]
    path = write(tmp_path, make())
    with pytest.raises(ValueError) as info:
        load_trace(path)
    expected = str(info.value)
    assert f"line {line()} (" in expected and needle in expected
    assert run_app(replay=str(path)) == 2
    assert one_error_line(capsys.readouterr().err) == f"nanoserve: error: {expected}"
    for call in (lambda: compare(TRACE, path), lambda: figure(path, "timeline")):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == expected


def test_a_list_of_events_is_checked_too():
    from nanoserve.whatif import compare

    events = read_trace(TRACE)
    with pytest.raises(ValueError, match="event 3 .*a second EngineSynced"):
        compare(events, events[:2] + events[:1] + events[2:])


def test_the_committed_traces_pass():
    for path in sorted(TRACE.parent.glob("*.jsonl")):
        assert load_trace(path)


def test_a_cut_last_line_is_left_out_with_a_warning(capsys, tmp_path):
    whole = TRACE.read_bytes()
    cut = whole[: whole.index(b"\n", len(whole) // 2) + 20]         # 19 bytes into a line
    path = tmp_path / "cut.jsonl"
    path.write_bytes(cut)
    with pytest.warns(TraceWarning, match="is cut short"):
        events = load_trace(path)
    assert len(events) == cut.count(b"\n")
    for argv in (CONSUMERS["export"](path, tmp_path), CONSUMERS["plot"](path, tmp_path)):
        code, err = cli(capsys, *argv)
        assert code == 0 and "Traceback" not in err
        assert f"nanoserve: warning: {path}: line {len(events) + 1} is cut short" in err
    # A cut line that is not the last one is an error, not a repair.
    path.write_bytes(cut + b"\n" + whole.splitlines()[-1] + b"\n")
    with pytest.raises(ValueError, match=f"{path}:{len(events) + 1}:"):
        load_trace(path)


def test_a_recorder_on_a_full_disk_keeps_whole_lines(tmp_path):
    events = read_trace(TRACE)
    path = tmp_path / "full.jsonl"
    recorder = JsonlRecorder(path)
    recorder._file = FullDisk(recorder._file, room=5000)
    written = 0
    with pytest.raises(OSError, match="recording to .* stopped: No space left on device after"):
        for event in events:
            recorder(event)
            written += 1
    assert recorder.error and 0 < written < len(events)
    recorder(events[-1])                                   # stopped: nothing more is written, nothing raised
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no cut line to repair
        assert read_trace(path) == events[:written]
    check_trace(events[:written], path)


# -- hostile lines are quoted escaped and short; traces past the viewers' limits are refused in one line --


HOSTILE = {   # name -> the line put after the first
    "random bytes": b"\x1b[2J\x1b]0;pwned\x07\xff\xfe\x00" + bytes(range(1, 32)) * 50,
    "terminal escapes in an event type": json.dumps({"type": "\x1b[31mRED\x1b[0m" * 100, "step": 1}).encode(),
    "a huge unknown field": json.dumps({"type": "StepStarted", "step": 1, "\x1b[2J" + "x" * 100_000: 1}).encode(),
    "a megabyte line": b"{" + b"\x9b" * 1_000_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_line_is_quoted_escaped_and_cut_short(capsys, tmp_path, name):
    from nanoserve_tui.app import run_app

    path = tmp_path / "hostile.jsonl"
    path.write_bytes(LINES[0].encode() + b"\n" + HOSTILE[name] + b"\n")
    with pytest.raises(ValueError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2") and len(message) < 600, message[:800]
    assert message.isprintable(), repr(message[:300])       # no escape, no control character, no newline
    assert run_app(replay=str(path)) == 2
    assert one_error_line(capsys.readouterr().err) == f"nanoserve: error: {message}"
    code, err = cli(capsys, *CONSUMERS["export"](path, tmp_path))
    assert code == 2 and one_error_line(err) == f"nanoserve: error: {message}"


def test_a_pool_past_the_limit_is_refused_in_one_line_before_it_is_read(capsys, tmp_path):
    """2,000,000 blocks: refused from the first line's JSON, naming MAX_BLOCKS, by every consumer."""
    from nanoserve import trace_check
    from nanoserve_tui.app import run_app

    n = 2_000_000
    synced = {"type": "EngineSynced", "step": 0, "model": "m", "num_blocks": n, "block_size": 4,
              "ref_counts": [0] * n, "free_queue": list(range(n)), "requests": []}
    path = write(tmp_path, [json.dumps(synced)] + LINES[1:2])
    with pytest.raises(ValueError, match=f"pools of at most {trace_check.MAX_BLOCKS} blocks \\(MAX_BLOCKS\\)"):
        load_trace(path)
    assert run_app(replay=str(path)) == 2
    assert "MAX_BLOCKS" in one_error_line(capsys.readouterr().err)
    code, err = cli(capsys, "export", "-t", path, "-f", "html", "-o", tmp_path / "x.html")
    assert code == 2 and "MAX_BLOCKS" in one_error_line(err) and not (tmp_path / "x.html").exists()


def test_a_trace_past_the_event_limit_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    """(The limit made small here: the committed trace stands for a million empty steps.)"""
    from nanoserve import trace_check
    from nanoserve_tui.app import run_app

    monkeypatch.setattr(trace_check, "MAX_EVENTS", 100)
    monkeypatch.setattr(trace_check, "MAX_BLOCKS", 10)        # the committed trace's pool has 20
    with pytest.raises(ValueError, match=f"{len(LINES)} lines; .* at most 100 events \\(MAX_EVENTS\\)"):
        load_trace(TRACE)
    assert run_app(replay=str(TRACE)) == 2
    assert "MAX_EVENTS" in one_error_line(capsys.readouterr().err)
    monkeypatch.setattr(trace_check, "MAX_EVENTS", 10_000)
    with pytest.raises(ValueError, match="MAX_BLOCKS"):
        load_trace(TRACE)
