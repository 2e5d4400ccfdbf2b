"""A submission that attacks the grader ends in a verdict for that file alone: its classmate, graded after it,
gets the grade it would get alone, nothing it wrote outside its scratch folder survives (where Landlock holds),
and the run goes on. Each attack runs at every confinement level that this machine offers (`confine.LEVELS`:
the best, the PID namespace alone, none at all): where the kernel refuses the attack, the file's own checks fail
with the refusal; where nothing refuses it, `lab grade`'s own defences (a checker per file, snapshots of the
submissions, the import-path watch) still keep it to that file."""

from __future__ import annotations

import csv
import inspect
import os
import sys
import textwrap

import pytest

from nanoserve import block_pool
from nanoserve.labs import get_lab
from nanoserve_labkit import confine
from nanoserve_labkit.grade import CHECKED, STOPPED, grade, read_submissions
from nanoserve_labkit.integrity import changed_files

LIMIT = 20.0
VICTIM = "def broken(:\n"          # a classmate's file: 0 checks pass, and it says "syntax error" (fast: no model)

# The attack looks for the checkers of its own `grade` run: those started by this test process. Every checker
# on the machine would include another test run's (CI runs two pytest processes side by side), and an attack at
# level "none" would then kill a checker that some other test is waiting on.
FIND_CHECKER = """
import os, signal
def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
def started_by_this_test(pid):
    try:
        while pid > 1:
            pid = parent(pid)
            if pid == TEST_PID:
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False
def checkers():
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if b"nanoserve_labkit.grade" in cmd and int(d) != os.getpid() and started_by_this_test(int(d)):
                found.append(int(d))
    assert found, "no checker found"
    return found
""".replace("TEST_PID", str(os.getpid()))


def attack(kind: str, where) -> str:
    """The attacking file's text (`where`: the test's folders)."""
    body = {
        "pth": f"""
            open({str(where['site'] / 'zz_forge.pth')!r}, "w").write("import zz_forge\\n")
            open({str(where['site'] / 'zz_forge.py')!r}, "w").write("print('every check passes')\\n")
            """,
        "SIGSTOP": "for pid in checkers():\n    os.kill(pid, signal.SIGSTOP)\n",
        "SIGKILL": "for pid in checkers():\n    os.kill(pid, signal.SIGKILL)\n",
        "SIGTERM": "for pid in checkers():\n    os.kill(pid, signal.SIGTERM)\n",
        "fd1": """
            import json
            rows = [json.dumps({"check": c, "status": "pass"}) for c in CHECKS]
            for pid in checkers():
                with open(f"/proc/{pid}/fd/1", "a") as out:
                    out.write("\\n".join(rows) + "\\n")
            """.replace("CHECKS", repr([c.name for c in get_lab("block-pool").checks])),
        "environ": """
            for pid in checkers():
                raise RuntimeError(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
            """,
        "classmate": f"""
            open({str(where['submissions'] / 'b_victim.py')!r}, "w").write(GOOD)
            """.replace("GOOD", repr(inspect.getsource(block_pool))),
    }[kind]
    return FIND_CHECKER + textwrap.dedent(body)


def holds(kind: str, plan: confine.Confinement) -> bool:
    """Whether this level's confinement refuses the attack itself (else grade's own defences must hold)."""
    return {"pth": plan.writes_confined, "classmate": plan.writes_confined, "environ": plan.proc_closed,
            "fd1": plan.proc_closed or plan.writes_confined}.get(kind, plan.signals_confined)


ATTACKS = ("pth", "SIGSTOP", "SIGKILL", "SIGTERM", "fd1", "environ", "classmate")
SECRET = f"nanoserve-secret-{os.getpid()}"


@pytest.fixture(scope="module")
def graded_at(tmp_path_factory):
    """level -> (what `grade` made of every attack file and the classmate, the folders): one run per level, every
    attacker sorted before the classmate, each in its own checker (so they cannot reach one another either)."""
    runs = {}

    def run(level: str):
        if level not in runs:
            base = tmp_path_factory.mktemp(f"attacks-{level}")
            where = {"site": base / "site", "submissions": base / "submissions"}
            for folder in where.values():
                folder.mkdir()
            for kind in ATTACKS:
                if not skipped(kind, level):
                    (where["submissions"] / f"a_{kind}.py").write_text(attack(kind, where))
            (where["submissions"] / "b_victim.py").write_text(VICTIM)
            old = os.environ.get("NANOSERVE_TEST_SECRET")
            os.environ["NANOSERVE_TEST_SECRET"] = SECRET        # in every checker's environment
            try:
                runs[level] = grade(get_lab("block-pool"), read_submissions(where["submissions"]), LIMIT,
                                    confine=level, watch_dirs=[str(where["site"])]), where
            finally:
                if old is None:
                    del os.environ["NANOSERVE_TEST_SECRET"]
                else:
                    os.environ["NANOSERVE_TEST_SECRET"] = old
        return runs[level]
    return run


def skipped(kind: str, level: str) -> str:
    """Why this attack is not run at this level ("" when it is)."""
    plan = confine.plan(level)
    if level == "landlock" and not plan.landlock_abi:
        return "this kernel has no Landlock"
    if level == "namespace" and not plan.namespace:
        return "unprivileged user namespaces are not allowed here"
    if level == "namespace" and kind in ("pth", "classmate"):
        return "a namespace does not confine writes: the same as level 'none'"
    if kind == "environ" and not plan.proc_closed:
        return f"at level {level!r} nothing closes the checker's /proc/PID/environ ({plan.text()})"
    return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the attacks go through Linux's /proc")
# The fast set grades the attacks at the level this machine reaches (one `lab grade` run); the weaker levels
# (each one more run of every attack file) are in the slow set.
@pytest.mark.parametrize("level", ["landlock", pytest.param("namespace", marks=pytest.mark.slow),
                                   pytest.param("none", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ATTACKS)
def test_an_attack_ends_in_a_verdict_for_that_file_alone(kind, level, graded_at):
    if skipped(kind, level):
        pytest.skip(skipped(kind, level))
    plan = confine.plan(level)
    graded, where = graded_at(level)

    victim = graded["b_victim.py"]                  # the classmate: its own grade, untouched
    assert victim.verdict == CHECKED and not any(r.passed for r in victim.results)
    assert "syntax error" in victim.results[0].detail, victim.results[0].detail
    mine = graded[f"a_{kind}.py"]
    details = " ".join(r.detail for r in mine.results)
    assert not any(r.passed for r in mine.results), details
    assert "no checker found" not in details, details
    assert SECRET not in details
    assert list(where["site"].iterdir()) == []      # nothing written into the (fake) import path survives
    if holds(kind, plan):                           # refused by the kernel: its import raised, a plain verdict
        assert mine.verdict == CHECKED, mine.verdict
        assert "Error" in details, details
        if kind == "classmate":
            assert (where["submissions"] / "b_victim.py").read_text() == VICTIM
    elif kind in ("SIGSTOP", "SIGKILL", "SIGTERM"):
        assert mine.verdict == f"{STOPPED} ({'SIGSTOP' if kind == 'SIGSTOP' else 'killed by ' + kind})"
    elif kind == "pth":
        assert mine.verdict.startswith("wrote into the import path") and "zz_forge.pth" in mine.verdict
    elif kind == "fd1":
        assert mine.verdict.startswith("its checker's output was not the lab's rows"), mine.verdict


def test_grade_writes_the_csv_when_a_file_kills_its_checker(tmp_path, capsys):
    """`lab grade` end to end, the killer sorted first: every file has a row and a verdict."""
    from nanoserve.cli import main
    where = {"site": tmp_path / "site", "submissions": tmp_path}
    (tmp_path / "a_attack.py").write_text(attack("SIGKILL", where))
    (tmp_path / "b_victim.py").write_text(VICTIM)
    assert main(["lab", "grade", "block-pool", str(tmp_path), "--time-limit", str(LIMIT)]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert set(rows) == {"a_attack.py", "b_victim.py"}
    assert rows["b_victim.py"]["verdict"] == CHECKED and rows["b_victim.py"]["passed"] == "0"
    assert rows["a_attack.py"]["passed"] == "0"
    assert rows["a_attack.py"]["verdict"] in (CHECKED, f"{STOPPED} (killed by SIGKILL)")


def test_the_checker_ignores_the_import_path_it_is_given(tmp_path, monkeypatch):
    """PYTHONPATH and a user site's sitecustomize reach neither the checker nor the worker (`python -I`)."""
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "marker"
    (planted / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    monkeypatch.setenv("PYTHONPATH", f"{planted}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    graded = grade(get_lab("block-pool"), {"b_victim.py": VICTIM.encode()}, LIMIT, watch_dirs=[])
    assert graded["b_victim.py"].verdict == CHECKED
    assert not marker.exists()


def test_installed_files_are_checked_against_the_record(tmp_path):
    """A wheel's files against its RECORD: a changed file and an added one are named; an editable install is not
    checked."""
    import base64
    import hashlib
    from importlib.metadata import PathDistribution

    package = tmp_path / "nanoserve"
    package.mkdir()
    (package / "engine.py").write_text("x = 1\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"x = 1\n").digest()).rstrip(b"=").decode()
    info = tmp_path / "nanoserve-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nanoserve\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"nanoserve/engine.py,sha256={digest},6\nnanoserve-0.1.0.dist-info/RECORD,,\n")
    dist = PathDistribution(info)
    assert changed_files(dist) == []
    (package / "engine.py").write_text("x = 2\n")
    (package / "forged.py").write_text("")
    assert changed_files(dist) == ["nanoserve/engine.py", "nanoserve/forged.py (added)"]
    (info / "direct_url.json").write_text('{"dir_info": {"editable": true}, "url": "file:///src"}')
    assert changed_files(dist) == []


def test_the_import_path_watch_names_and_removes_what_appeared(tmp_path):
    from nanoserve_labkit.integrity import ImportPathWatch
    (tmp_path / "teacher.py").write_text("")
    watch = ImportPathWatch([str(tmp_path)])
    (tmp_path / "zz.pth").write_text("import zz\n")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "__init__.py").write_text("")
    assert watch.remove_added() == [str(tmp_path / "zz"), str(tmp_path / "zz.pth")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher.py"]
