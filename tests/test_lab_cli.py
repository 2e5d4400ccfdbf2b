"""`nanoserve lab`: list/start/check/grade from the command line, and student files that misbehave
(do not import, never return, raise, tamper with the engine) give one clear line while the other checks run."""

from __future__ import annotations

import csv
import inspect
import json
import textwrap

import pytest

from nanoserve import block_pool
from nanoserve.cli import main
from nanoserve.labs import get_lab, lab_names
from nanoserve_labkit.run import Status, run_in_process


def overriding(method: str) -> str:
    """The engine's block_pool.py (the student's copy) and a BlockPool subclass that rewrites `method`."""
    return inspect.getsource(block_pool) + "\n\n_Pool = BlockPool\n\n\nclass BlockPool(_Pool):\n" + \
        textwrap.indent(textwrap.dedent(method), "    ")


def line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_list_names_every_lab(capsys):
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    for name in lab_names():
        assert name in out


def test_start_writes_starter_and_readme_and_never_overwrites(tmp_path, capsys):
    folder = tmp_path / "bp"
    assert main(["lab", "start", "block-pool", str(folder)]) == 0
    starter = (folder / "block_pool.py").read_text()
    assert 'raise NotImplementedError("BlockPool.allocate: your code goes here")' in starter
    assert "nanoserve lab check block-pool" in (folder / "README.md").read_text()
    (folder / "block_pool.py").write_text("# my work\n")
    capsys.readouterr()
    assert main(["lab", "start", "block-pool", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanoserve: error: DIR ") and "already exist" in err and "\n" not in err
    assert (folder / "block_pool.py").read_text() == "# my work\n"


@pytest.mark.parametrize("argv,flag", [(["lab", "start", "nope"], "lab"),
                                       (["lab", "check", "block-pool", "missing.py"], "FILE"),
                                       (["lab", "grade", "block-pool", "no-such-dir"], "DIR"),
                                       (["lab", "check", "block-pool", "x.py", "--time-limit", "0"], "--time-limit")])
def test_bad_input_is_one_line_exit_2(argv, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nanoserve: error: {flag} ")


def test_check_exit_code_table_and_why(tmp_path, capsys):
    lab = get_lab("block-pool")
    n = len(lab.checks)
    good = write(tmp_path / "good.py", inspect.getsource(block_pool))
    assert main(["lab", "check", "block-pool", str(good)]) == 0
    out = capsys.readouterr().out
    assert f"{n}/{n} checks pass" in out and "every rule of the lab holds on these checks" in out
    assert "flagged: identical to the engine's code" in out     # the engine's own module, copied
    for question, answer in lab.why:             # the questions, not the answers (those are on the page, folded)
        assert question in out and answer not in out
    bad = write(tmp_path / "bad.py", "def broken(:\n")
    assert main(["lab", "check", "block-pool", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.py:1: syntax error" in out and f"0/{n} checks pass" in out and "every rule" not in out


def test_check_fail_fast_and_json(tmp_path, capsys):
    path = tmp_path / "raises.py"
    path.write_text(overriding("""\
        def allocate(self, n):
            raise RuntimeError("oops")
        """))
    assert main(["lab", "check", "block-pool", str(path), "--fail-fast", "--json"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in rows][:5] == ["pass"] * 4 + ["fail"]
    assert rows[4]["function"] == "BlockPool.allocate" and rows[4]["detail"] == \
        f"raises.py:{line_of(path, 'oops')} in allocate: RuntimeError: oops"
    assert {r["status"] for r in rows[5:]} == {"not run"}


def test_start_design_mode_states_contracts(tmp_path, capsys):
    folder = tmp_path / "d"
    assert main(["lab", "start", "block-pool", str(folder), "--mode", "design"]) == 0
    text = (folder / "block_pool.py").read_text()
    lab = get_lab("block-pool")
    assert "# TODO" not in text and text.count("# Contract:") == len(lab.blanks) and "Invariants:" in text
    assert "design mode" in capsys.readouterr().out and "What must hold between calls" in (folder / "README.md").read_text()


def test_import_errors_name_file_and_line(tmp_path):
    lab = get_lab("block-pool")
    missing = write(tmp_path / "missing.py", """\
        from nanoserve.block_pool import Block, FreeBlockQueue
        x = 1
        y = undefined_name
        """)
    results = run_in_process(lab, missing)
    assert all(r.status is Status.FAIL for r in results)
    assert "missing.py does not import: missing.py:3 in <module>: NameError" in results[0].detail
    no_class = write(tmp_path / "no_class.py", inspect.getsource(block_pool).replace("class BlockPool", "class Pool"))
    results = run_in_process(lab, no_class)
    assert results[0].detail == "BlockPool.allocate is missing; BlockPool.share is missing; BlockPool.free is missing"
    pool_rows = [r for r in results[1:] if not r.function.startswith("FreeBlockQueue")]
    assert all(not r.passed for r in pool_rows)
    assert all("AttributeError" in r.detail and "BlockPool" in r.detail for r in pool_rows)


def test_raise_names_the_line_and_other_checks_run(tmp_path):
    path = tmp_path / "raises.py"
    path.write_text(overriding("""\
        def share(self, block_ids):
            raise RuntimeError("oops")
        """))
    results = {r.function: r for r in run_in_process(get_lab("block-pool"), path)}
    assert results["BlockPool.share"].detail == f"raises.py:{line_of(path, 'oops')} in share: RuntimeError: oops"
    assert results["BlockPool.allocate"].passed and results["BlockPool.free"].passed   # the others ran


def test_never_returns_is_stopped_and_tampering_stays_in_its_process(tmp_path):
    """A check that loops forever is reported as timed out and the next check still runs; a file that
    rewrites the engine's own classes at import changes nothing for the next submission."""
    (tmp_path / "a_loops.py").write_text(overriding("""\
        def share(self, block_ids):
            while True:
                pass
        """))
    write(tmp_path / "b_tamper.py", """\
        import nanoserve.block_pool as real
        from nanoserve.block_pool import Block, FreeBlockQueue, BlockPool
        real.BlockPool.free = lambda self, ids: []       # breaks the engine's own pool in this process
        """)
    write(tmp_path / "c_good.py", inspect.getsource(block_pool))
    lab = get_lab("block-pool")
    n = len(lab.checks)
    assert main(["lab", "grade", "block-pool", str(tmp_path), "--time-limit", "10"]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert rows["c_good.py"]["passed"] == str(n)
    assert set(rows["c_good.py"]["identical"].split()) == set(lab.blanks)      # a copy: graded, and flagged
    assert int(rows["b_tamper.py"]["passed"]) < n
    looped = rows["a_loops.py"]
    name = {c.function: c.name for c in lab.checks}
    assert looped[name["BlockPool.share"]] == "timeout"
    assert looped[name["BlockPool.free"]] == "pass" and looped[name["BlockPool.allocate"]] == "pass"
    assert int(looped["passed"]) == n - 2         # share, and the engine (its forks share blocks)
