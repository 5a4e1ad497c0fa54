"""tools/lesson_costs.py: the guide's table of what each lesson costs is measured, not typed."""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import lesson_costs as lc  # noqa: E402


def test_memory_is_counted_over_the_whole_process_tree():
    """A parent that starts a child holding 200 MB: the peak counts the child too."""
    child = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    seconds, peak, code = lc.measure([sys.executable, "-c", parent])
    assert code == 0 and seconds >= 1.5
    assert peak > 200 * 2**20, peak


def test_the_table_goes_between_the_markers_and_nowhere_else(tmp_path):
    guide = tmp_path / "guide.md"
    guide.write_text(f"# Guide\n\nbefore\n\n{lc.BEGIN}\nold\n{lc.END}\n\nafter\n")
    lc.write(guide, lc.table(["| 01 | 30 s | 8-9 s | 700 MiB | - | - | - |"], zh=False,
                             extra=["| `make lesson-21 ARGS=...` | 1 s | 1 s | 1 MiB |"], loads=[0.2, 0.4]))
    text = guide.read_text()
    assert text.startswith("# Guide\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text and "| 01 | 30 s | 8-9 s | 700 MiB | - | - | - |" in text
    assert "heavier runs the exercises ask for" in text and "`make lesson-21 ARGS=...`" in text
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "none.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- lesson-costs:begin --> marker"):
        lc.write(tmp_path / "none.md", "x")


def test_the_load_during_the_runs_is_sampled_and_said():
    """Wall times depend on what else the machine does: every run samples the load average,
    and the table's first line says whether the machine was idle or busy, and how busy."""
    before = len(lc.LOADS)
    lc.measure([sys.executable, "-c", "import time; time.sleep(2.5)"])
    assert len(lc.LOADS) >= before + 2 and all(x >= 0 for x in lc.LOADS[before:])
    idle, _ = lc.conditions([0.1, 0.6], cores=2)
    busy, busy_zh = lc.conditions([3.0, 9.0], cores=2)
    assert "idle" in idle and "0.1-0.6" in idle
    assert "busy" in busy and "3.0-9.0" in busy and "4.5 processes wanting each core" in busy
    assert "3.0-9.0" in busy_zh


def test_the_first_run_is_measured_in_a_copy_with_nothing_cached(tmp_path):
    """A lesson that caches its baseline in runs/ (as Part 2's reference, lesson 22's runs):
    the first run, in a scratch copy whose runs/ is empty, pays for it; the later ones read
    it. Here a stand-in lesson sleeps 2 s when its cache is missing."""
    copy = lc.scratch_copy(tmp_path)
    assert (copy / "lessons").is_dir() and (copy / "Makefile").exists() and not (copy / "runs").exists()
    assert (copy / ".venv").resolve() == (ROOT / ".venv").resolve() and not (copy / ".git").exists()
    (copy / "lessons" / "99_probe.py").write_text(
        "import pathlib, sys, time\n"
        "cache = pathlib.Path(__file__).resolve().parent.parent / 'runs' / 'cache'\n"
        "if not cache.exists():\n"
        "    time.sleep(2); cache.parent.mkdir(parents=True, exist_ok=True); cache.write_text('x')\n")
    (copy / "runs").mkdir()
    (copy / "runs" / "cache").write_text("left by an earlier run: the first run must not see it")
    first, later, peak = lc.first_and_later("99", copy, [])
    seconds = [0.5 if text.startswith("under") else float(text.split()[0].split("-")[-1])
               for text in (first, later)]
    assert seconds[0] >= 2 and seconds[1] <= seconds[0] - 1 and peak > 0, (first, later)
    assert [lc.spread(x) for x in ([0.2, 0.4], [0.4, 1.2], [8.2, 10.6], [9.1, 9.4])] == \
        ["under 1 s", "1 s", "8-11 s", "9 s"]


def test_update_measures_some_rows_again_and_keeps_the_others(tmp_path, monkeypatch):
    """A row that failed while someone edited its check is measured again (--update NN); the
    other rows, the exercise runs and the load range of the first run stay, the range widens."""
    en, zh = tmp_path / "en.md", tmp_path / "zh.md"
    rows = ["| 01 | 9 s | 8-9 s | 700 MiB | - | - | - |", "| 02 | 9 s | failed (1) | 0 MiB | - | - | - |"]
    extra = ["| `make lesson-21 ARGS=\"--world-size 8\"` (x) | 1 s | 1 s | 1 MiB |"]
    for path, is_zh in ((en, False), (zh, True)):
        path.write_text(f"# Guide\n\n{lc.BEGIN}\n{lc.END}\n")
        lc.write(path, lc.table(rows, zh=is_zh, extra=extra, loads=[4.0, 6.0]))
    def measured_again(num, copy):  # a stand-in for a real run: its row, the load it saw
        lc.LOADS.append(9.0)
        return f"| {num} | 10 s | 9-10 s | 710 MiB | - | - | - |"

    monkeypatch.setattr(lc, "lessons", lambda wanted: ["01", "02"])
    monkeypatch.setattr(lc, "row", measured_again)
    monkeypatch.setattr(lc, "LOADS", [])
    lc.update(["02"], guides=(en, zh))
    for path in (en, zh):
        text = path.read_text()
        assert rows[0] in text and "| 02 | 10 s | 9-10 s | 710 MiB |" in text and "failed" not in text
        assert extra[0] in text
    assert "load average 4.0-9.0" in en.read_text() and "平均负载 4.0-9.0" in zh.read_text()


def test_what_other_jobs_took_is_measured_apart_from_the_lessons_own_load(tmp_path, monkeypatch):
    """The load average counts the lesson's own processes: 4 ranks alone on 2 cores gave 4-6,
    and the header said "a machine other jobs kept busy" about an idle machine. Before each
    run the cores other jobs keep busy are measured (1 s, nothing of ours running); they decide
    idle or busy, and an --update keeps and widens them."""
    before = len(lc.OTHERS)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # another job: one core
    try:
        time.sleep(0.5)
        lc.measure([sys.executable, "-c", "pass"])
    finally:
        spin.kill()
        spin.wait()
    assert len(lc.OTHERS) == before + 1 and lc.OTHERS[-1] > 0.5, lc.OTHERS
    idle, idle_zh = lc.conditions([1.0, 6.0], cores=2, others=[0.0, 0.1])
    busy, busy_zh = lc.conditions([1.0, 6.0], cores=2, others=[0.0, 1.2])
    assert idle.startswith("an otherwise idle machine") and "up to 0.1 of 2 cores" in idle
    assert "load average 1.0-6.0" in idle and "their own processes included" in idle
    assert "other jobs kept busy" in busy and "up to 1.2 of 2 cores" in busy
    assert "最多占用 0.1 个核" in idle_zh and "最多占用 1.2 个核" in busy_zh
    en, zh = tmp_path / "en.md", tmp_path / "zh.md"
    rows = ["| 01 | 9 s | 8-9 s | 700 MiB | - | - | - |"]
    for path, is_zh in ((en, False), (zh, True)):
        path.write_text(f"# Guide\n\n{lc.BEGIN}\n{lc.END}\n")
        lc.write(path, lc.table(rows, zh=is_zh, loads=[1.0, 6.0], others=[0.0, 0.1]))
    assert lc.current_table(en)[2:] == ([1.0, 6.0], [0.1]) and lc.current_table(zh)[2:] == ([1.0, 6.0], [0.1])

    def measured_again(num, copy):  # a stand-in for a real run: another job took a core meanwhile
        lc.OTHERS.append(1.0)
        return f"| {num} | 10 s | 9-10 s | 710 MiB | - | - | - |"

    monkeypatch.setattr(lc, "lessons", lambda wanted: ["01"])
    monkeypatch.setattr(lc, "row", measured_again)
    monkeypatch.setattr(lc, "OTHERS", [])
    lc.update(["01"], guides=(en, zh))
    assert "other jobs kept busy (other jobs: up to 1.0 of" in en.read_text()


def test_the_lines_an_answer_changes_are_counted_from_the_files():
    assert lc.answer_lines("01") is None  # no checked exercise
    assert lc.answer_lines("21") and lc.answer_lines("21") < lc.answer_lines("23") + 50


@pytest.mark.parametrize("guide", ["docs/TEACHING.md", "docs/zh/TEACHING.md"])
def test_the_guides_hold_a_measured_row_for_every_lesson(guide):
    """Each lesson's first and later runs, its peak memory and its check; the heavier runs the
    exercises ask for; and what the machine was doing meanwhile."""
    text = (ROOT / guide).read_text()
    inside = text.split(lc.BEGIN, 1)[1].split(lc.END, 1)[0]
    rows = [line for line in inside.splitlines() if line.startswith("| ") and line[2:4].isdigit()]
    assert [r[2:4] for r in rows] == lc.lessons([]), "rerun: make lesson-costs"
    assert all(len(re.findall(r"\d s \||under 1 s \|", r)) >= 2 and "MiB" in r and "failed" not in r
               for r in rows), rows
    load = "平均负载" if "/zh/" in guide else "load average"
    assert os.cpu_count() and "make lesson-costs" in inside and re.search(load + r" [\d.]+-[\d.]+", inside)
    for num, flags, _ in lc.EXERCISE_RUNS:
        assert f"`make lesson-{num} ARGS=\"{' '.join(flags)}\"`" in inside, "rerun: make lesson-costs"
