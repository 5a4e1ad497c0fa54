"""The Makefile: the learner's entry point."""
import re

from conftest import ROOT, one_error_line, run


def lesson_numbers():
    return sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def test_help_lists_every_lesson_with_its_title():
    out = run(["make", "-s", "help"]).stdout
    for n in lesson_numbers():
        line = next(l for l in out.splitlines() if f"make lesson-{n}" in l)
        assert len(line.split(f"lesson-{n}", 1)[1].strip()) > 10, line
    for target in ("make test", "make lessons", "make clean"):
        assert target in out


def test_unknown_lesson_is_one_line_listing_the_lessons():
    proc = run(["make", "-s", "lesson-99"], check=False)
    line = one_error_line(proc)
    assert "99" in line and all(n in line for n in lesson_numbers())


def test_make_lesson_passes_args_through(tmp_path):
    out = run(["make", "-s", "lesson-01", f"ARGS=--epochs 1 --out {tmp_path}"]).stdout
    assert re.search(r"step\s+32/32", out)
    assert (tmp_path / "metrics.json").exists()
