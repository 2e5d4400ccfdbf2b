"""`nanoserve lab`: list/start/check/grade from the command line, and student files that misbehave
(do not import, never return, raise, tamper with the engine) give one clear line while the other checks run."""

from __future__ import annotations

import csv
import inspect
import textwrap

import pytest

from nanoserve import block_pool
from nanoserve.cli import main
from nanoserve.labs import get_lab, lab_names
from nanoserve.labs.run import Status, run_in_process


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


def test_check_exit_code_and_table(tmp_path, capsys):
    good = write(tmp_path / "good.py", inspect.getsource(block_pool))
    assert main(["lab", "check", "block-pool", str(good)]) == 0
    assert "6/6 checks pass" in capsys.readouterr().out
    bad = write(tmp_path / "bad.py", "def broken(:\n")
    assert main(["lab", "check", "block-pool", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.py:1: syntax error" in out and "0/6 checks pass" in out


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
    no_class = write(tmp_path / "no_class.py", "from nanoserve.block_pool import Block, FreeBlockQueue\n")
    results = run_in_process(lab, no_class)
    assert results[0].detail == "BlockPool.allocate is missing; BlockPool.share is missing; BlockPool.free is missing"
    assert all(not r.passed for r in results)
    assert all("AttributeError" in r.detail and "BlockPool" in r.detail for r in results[1:])


def test_raise_names_the_line_and_other_checks_run(tmp_path):
    path = write(tmp_path / "raises.py", """\
        from nanoserve.block_pool import Block, FreeBlockQueue
        from nanoserve.block_pool import BlockPool as _Pool


        class BlockPool(_Pool):
            def share(self, block_ids):
                raise RuntimeError("oops")
        """)
    results = {r.check: r for r in run_in_process(get_lab("block-pool"), path)}
    shared = results["shared blocks stay until the last holder frees"]
    assert shared.detail == "raises.py:7 in share: RuntimeError: oops"
    assert results["allocate: head of the queue, all or nothing"].passed   # the others ran


def test_never_returns_is_stopped_and_tampering_stays_in_its_process(tmp_path):
    """A check that loops forever is reported as timed out and the next check still runs; a file that
    rewrites the engine's own classes at import changes nothing for the next submission."""
    write(tmp_path / "a_loops.py", """\
        from nanoserve.block_pool import Block, FreeBlockQueue
        from nanoserve.block_pool import BlockPool as _Pool


        class BlockPool(_Pool):
            def share(self, block_ids):
                while True:
                    pass
        """)
    write(tmp_path / "b_tamper.py", """\
        import nanoserve.block_pool as real
        from nanoserve.block_pool import Block, FreeBlockQueue, BlockPool
        real.BlockPool.free = lambda self, ids: []       # breaks the engine's own pool in this process
        """)
    write(tmp_path / "c_good.py", inspect.getsource(block_pool))
    assert main(["lab", "grade", "block-pool", str(tmp_path), "--time-limit", "10"]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert rows["c_good.py"]["passed"] == "6"
    assert int(rows["b_tamper.py"]["passed"]) < 6
    looped = rows["a_loops.py"]
    assert looped["shared blocks stay until the last holder frees"] == "timeout"
    assert looped["free queue links (remove from the middle)"] == "pass"          # ran after the timeout
    assert looped["passed"] == "4"
