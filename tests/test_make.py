"""The Makefile: the learner's entry point."""
import re

from conftest import ROOT, one_error_line, run

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)


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


def test_diff_between_two_lessons_counts_and_shows_the_changes():
    out = run(["make", "-s", "diff", "FROM=01", "TO=05"]).stdout
    first = out.splitlines()[0]
    assert first.startswith("01_single_device.py -> 05_ddp_spawn.py:")
    added = int(re.search(r"(\d+) lines added", first)[1])
    assert added > 50 and "+++ lessons/05_ddp_spawn.py" in out
    assert "+from torch.nn.parallel import DistributedDataParallel as DDP" in out
    assert "\x1b[" not in out  # plain text when piped


def test_diff_with_an_unknown_lesson_is_one_line():
    line = one_error_line(run(["make", "-s", "diff", "FROM=01", "TO=77"], check=False))
    assert "'77'" in line and "01" in line
    line = one_error_line(run(["make", "-s", "diff", "FROM=01"], check=False))
    assert "FROM=04 TO=05" in line


def test_one_digit_lesson_number_means_that_lesson_and_no_number_is_one_line():
    # make lesson-1 is lesson 01, as make diff FROM=1 is; flags still pass through
    out = run(["make", "-s", "lesson-1", "ARGS=--help"]).stdout
    assert "lessons/01_single_device.py" in out or "01_single_device" in out, out
    line = one_error_line(run(["make", "-s", "lesson-"], check=False))
    assert "make lesson-01" in line and all(n in line for n in lesson_numbers())


def test_first_setup_shows_pips_progress():
    """The first make lesson-01 installs torch for minutes: pip must not be silenced."""
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("$(STAMP): requirements.txt", 1)[1].split("\n\n", 1)[0]
    assert "pip install" in recipe and "--quiet" not in recipe and " -q " not in recipe
    assert "--progress-bar on" in recipe
