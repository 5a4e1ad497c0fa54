"""Checked exercises: each check fails on the shipped starter and passes on a real solution.

A check that passes on the starter could not tell a learner anything; one that fails on the
solution would reject correct work. Both directions are tested for every checked exercise.
"""
import sys

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "tools"))
from check_exercise import all_checks  # noqa: E402

CHECKS = all_checks()

CHECK = [sys.executable, "tools/check_exercise.py"]


@pytest.mark.parametrize("number", sorted(CHECKS))
def test_starter_is_not_yet_right(number):
    proc = run([*CHECK, number], check=False, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("not yet: ") and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("number", sorted(CHECKS))
def test_reference_solution_passes(number):
    starter = ROOT / CHECKS[number][0]
    solution = ROOT / "tests" / "solutions" / starter.name
    proc = run([*CHECK, number, str(solution)], timeout=240)
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
