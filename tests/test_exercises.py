"""Checked exercises: each check fails on the shipped starter and passes on a real solution.

A check that passes on the starter could not tell a learner anything; one that fails on the
solution would reject correct work. Both directions are tested for every checked exercise.
"""
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "tools"))
from check_exercise import all_checks, main  # noqa: E402

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

CHECKS = all_checks()

CHECK = [sys.executable, "tools/check_exercise.py"]


def check_in_process(number: str, path: Path, capsys) -> tuple[int, str]:
    """The harness's own main(), as `make check-NN` runs it, but in this process: no second
    Python importing torch for each of the 2 x 16 checks (the CLI itself is run below)."""
    try:
        main([number, str(path)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("number", sorted(CHECKS))
def test_starter_is_not_yet_right(number, capsys):
    code, text = check_in_process(number, ROOT / CHECKS[number][0], capsys)
    assert code == 1, text
    assert text.startswith("not yet: ") and "Traceback" not in text


@pytest.mark.parametrize("number", sorted(CHECKS))
def test_reference_solution_passes_wherever_it_is(number, capsys, tmp_path):
    """A teacher checks a learner's copy from anywhere (make check-15 FILE=~/ana.py): the
    solution, copied outside the repository, passes (exercise 15's starter once found lesson
    15 through its own path, and a correct answer elsewhere failed with StopIteration)."""
    starter = ROOT / CHECKS[number][0]
    copy = tmp_path / "submissions" / f"ana_{starter.name}"
    copy.parent.mkdir()
    copy.write_text((ROOT / "tests" / "solutions" / starter.name).read_text())
    code, text = check_in_process(number, copy, capsys)
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
