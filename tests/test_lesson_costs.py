"""tools/lesson_costs.py: the guide's table of what each lesson costs is measured, not typed."""
import os
import sys

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
    lc.write(guide, lc.table(["| 01 | 8 s | 700 MiB | - | - |"], zh=False))
    text = guide.read_text()
    assert text.startswith("# Guide\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text and "| 01 | 8 s | 700 MiB | - | - |" in text
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "none.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- lesson-costs:begin --> marker"):
        lc.write(tmp_path / "none.md", "x")


@pytest.mark.parametrize("guide", ["docs/TEACHING.md", "docs/zh/TEACHING.md"])
def test_the_guides_hold_a_measured_row_for_every_lesson(guide):
    text = (ROOT / guide).read_text()
    inside = text.split(lc.BEGIN, 1)[1].split(lc.END, 1)[0]
    rows = [line for line in inside.splitlines() if line.startswith("| ") and line[2:4].isdigit()]
    assert [r[2:4] for r in rows] == lc.lessons([]), "rerun: .venv/bin/python tools/lesson_costs.py"
    assert all(" s |" in r and "MiB" in r and "failed" not in r for r in rows), rows
    assert os.cpu_count() and "tools/lesson_costs.py" in inside
