"""Checked exercises: each check fails on the shipped starter and passes on a real solution.

A check that passes on the starter could not tell a learner anything; one that fails on the
solution would reject correct work. Both directions are tested for every checked exercise.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, _zygote, run

sys.path.insert(0, str(ROOT / "tools"))
from check_exercise import all_checks, main  # noqa: E402

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

CHECKS = all_checks()

CHECK = [sys.executable, "tools/check_exercise.py"]


_REAL_RUN = subprocess.run


def _forked_run(cmd, *, cwd=None, capture_output=False, text=False, timeout=None, check=False,
                stdin=None, **other):
    """subprocess.run as the checks call it; `python FILE.py ...` from the repository root runs
    as a fork of the test zygote (torch imported already, instead of a new Python importing
    it: about 5 CPU s for each of check 06's tools/nodes.py and check 23's lesson runs), with
    the same environment, exit code and output. Whatever the zygote cannot run (usable: other
    options, another program, a changed import-time variable) goes to the real one."""
    env = dict(os.environ)
    if not (capture_output and stdin in (None, subprocess.DEVNULL) and isinstance(cmd, list)
            and cwd is not None and Path(cwd).resolve() == ROOT
            and _zygote().usable(cmd, env, other, cwd=ROOT)):
        return _REAL_RUN(cmd, cwd=cwd, capture_output=capture_output, text=text,
                         timeout=timeout, check=check, stdin=stdin, **other)
    proc = _zygote().run([str(c) for c in cmd], cwd=ROOT, env=env, timeout=timeout)
    out, err = (proc.stdout, proc.stderr) if text else (proc.stdout.encode(), proc.stderr.encode())
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check_in_process(number: str, path: Path, capsys, monkeypatch) -> tuple[int, str]:
    """The harness's own main(), as `make check-NN` runs it, but in this process: no second
    Python importing torch for each of the 2 x 16 checks (the CLI itself is run below). The
    commands a check starts itself run as forks of the test zygote (_forked_run)."""
    monkeypatch.setattr(subprocess, "run", _forked_run)
    try:
        main([number, str(path)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        monkeypatch.setattr(subprocess, "run", _REAL_RUN)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_checks_commands_run_as_they_would_alone():
    """_forked_run gives what subprocess.run gives: output, exit code, bytes or text, and the
    error of check=True; other commands it leaves to subprocess.run."""
    script = "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); sys.exit(3)"
    cmd = [sys.executable, "tools/check_exercise.py", "99"]  # exits 2 with one line on stderr
    for text in (True, False):
        want = _REAL_RUN(cmd, cwd=ROOT, capture_output=True, text=text, timeout=60)
        got = _forked_run(cmd, cwd=ROOT, capture_output=True, text=text, timeout=60,
                          stdin=subprocess.DEVNULL)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
        assert got.returncode == 2 and got.stderr
    with pytest.raises(subprocess.CalledProcessError) as raised:
        _forked_run(cmd, cwd=ROOT, capture_output=True, check=True, timeout=60)
    assert raised.value.returncode == 2
    other = _forked_run([sys.executable, "-c", script, "x"], cwd=ROOT, capture_output=True, text=True)
    assert (other.returncode, other.stdout, other.stderr) == (3, "out ['x']\n", "err\n")


# check 23 measures lesson 23 once per mesh and process: its two tests share one xdist worker
NUMBERS = [pytest.param(n, marks=pytest.mark.xdist_group("exercise_23")) if n == "23" else n
           for n in sorted(CHECKS)]


@pytest.mark.parametrize("number", NUMBERS)
def test_starter_is_not_yet_right(number, capsys, monkeypatch):
    code, text = check_in_process(number, ROOT / CHECKS[number][0], capsys, monkeypatch)
    assert code == 1, text
    assert text.startswith("not yet: ") and "Traceback" not in text


@pytest.mark.parametrize("number", NUMBERS)
def test_reference_solution_passes_wherever_it_is(number, capsys, tmp_path, monkeypatch):
    """A teacher checks a learner's copy from anywhere (make check-15 FILE=~/ana.py): the
    solution, copied outside the repository, passes (exercise 15's starter once found lesson
    15 through its own path, and a correct answer elsewhere failed with StopIteration)."""
    starter = ROOT / CHECKS[number][0]
    copy = tmp_path / "submissions" / f"ana_{starter.name}"
    copy.parent.mkdir()
    copy.write_text((ROOT / "tests" / "solutions" / starter.name).read_text())
    code, text = check_in_process(number, copy, capsys, monkeypatch)
    assert code == 0 and text.startswith("ok: "), text


def test_the_command_line_runs_a_check():
    """What a learner types, in a subprocess of its own: the starter of lesson 05 is 'not yet'
    (exit 1), a solution is 'ok' (exit 0)."""
    proc = run([*CHECK, "05"], check=False, timeout=240)
    assert proc.returncode == 1 and proc.stdout.startswith("not yet: "), proc.stdout + proc.stderr
    proc = run([*CHECK, "05", str(ROOT / "tests" / "solutions" / "05_set_epoch.py")], timeout=240)
    assert proc.stdout.startswith("ok: ")


def test_every_lesson_from_05_has_a_checked_exercise():
    lessons = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    missing = [n for n in lessons if n >= "05" and n not in CHECKS]
    assert not missing, f"lessons without a checked exercise: {missing}"


def test_make_check_and_unknown_lesson():
    out = run(["make", "-s", "checks"]).stdout
    assert all(f"make check-{n}" in out for n in CHECKS)
    proc = run([*CHECK, "99"], check=False)
    assert proc.returncode == 2 and "has no checked exercise" in proc.stderr
