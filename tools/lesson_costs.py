"""What each lesson costs a classroom, measured: `make lesson-NN`'s default run (wall time and
the peak memory of all its processes together) and `make check-NN` on the solution (what
grading one student's file takes). Writes the table between the markers in docs/TEACHING.md
and docs/zh/TEACHING.md, so the guide's numbers are this machine's, never typed by hand.

    .venv/bin/python tools/lesson_costs.py            # every lesson and check; rewrites both guides
    .venv/bin/python tools/lesson_costs.py 01 15      # some lessons; prints the rows only

Run it on an otherwise idle machine: the numbers are wall-clock seconds. Memory is the sum of
the proportional set sizes (PSS) of the lesson's process and everything under it, sampled
every 0.1 s: the peak a laptop must hold (summed RSS would count torch's shared libraries
once per process). One run each; expect a few percent from run to run.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
BEGIN, END = "<!-- lesson-costs:begin -->", "<!-- lesson-costs:end -->"
CLASS = 30  # students whose files a teacher checks one after the other


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def pss_bytes(pids: set[int]) -> int:
    """Memory the processes hold together: each one's proportional set size (PSS: a page
    shared by k processes, as torch's libraries and a forked rank's pages are, counts 1/k in
    each), so the sum is what the machine holds, not N times the shared libraries."""
    total = 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def measure(cmd: list[str], timeout: float = 600) -> tuple[float, int, int]:
    """(wall seconds, peak summed PSS in bytes, exit code) of `cmd` and all it starts."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    peak = 0
    while proc.poll() is None:
        peak = max(peak, pss_bytes(descendants(proc.pid)))
        if time.monotonic() - start > timeout:
            proc.kill()
        time.sleep(0.1)
    return time.monotonic() - start, peak, proc.returncode


def lessons(wanted: list[str]) -> list[str]:
    found = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    return [n for n in found if not wanted or n in wanted]


def shown(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 1 else "under 1 s"


def row(num: str, out: Path) -> str:
    lesson = sorted((ROOT / "lessons").glob(f"{num}_*.py"))[0]
    makefile = (ROOT / "Makefile").read_text()
    launcher = re.search(rf"^RUN_{num} := (.*)$", makefile, re.M)
    cmd = [PY, *(launcher.group(1).split() if launcher else []), str(lesson), "--out", str(out / num)]
    seconds, peak, code = measure(cmd)
    cells = [num, shown(seconds) if code == 0 else f"failed ({code})", f"{peak / 2**20:,.0f} MiB"]
    solutions = sorted((ROOT / "tests" / "solutions").glob(f"{num}_*.py"))
    if solutions:
        check_s, check_peak, check_code = measure([PY, "tools/check_exercise.py", num, str(solutions[0])])
        cells += [shown(check_s) if check_code == 0 else f"failed ({check_code})",
                  f"{check_s * CLASS / 60:.0f} min" if check_s * CLASS >= 60 else "under 1 min"]
    else:
        cells += ["-", "-"]
    print(" | ".join(cells), file=sys.stderr, flush=True)
    return "| " + " | ".join(cells) + " |"


def table(rows: list[str], zh: bool) -> str:
    cpu = f"{os.cpu_count()} cores, {platform.machine()}"
    when = time.strftime("%Y-%m-%d")
    if zh:
        head = (f"由 `.venv/bin/python tools/lesson_costs.py` 在 {cpu} 的空闲机器上测得（{when}）："
                f"默认运行的墙钟时间和它所有进程合计的内存峰值（PSS：共享的页按进程数分摊）；对参考答案运行一次检查的时间；"
                f"依次检查 {CLASS} 名学生的文件所需的时间。\n\n"
                "| 课 | 默认运行 | 内存峰值（所有进程） | 检查一个文件 | 检查 30 个文件 |\n"
                "|----|----------|----------------------|--------------|----------------|")
    else:
        head = (f"Measured by `.venv/bin/python tools/lesson_costs.py` on an idle machine with {cpu} "
                f"({when}): the default run's wall time and the peak memory of all its processes "
                f"together (PSS: a page shared by k processes counts once); one check of the solution; checking {CLASS} students' files one after "
                f"the other.\n\n"
                "| lesson | default run | peak memory (all processes) | check one file | check 30 files |\n"
                "|--------|-------------|-----------------------------|----------------|----------------|")
    return "\n".join([BEGIN, head, *rows, END])


def write(path: Path, text: str) -> None:
    old = path.read_text()
    if BEGIN not in old:
        raise SystemExit(f"error: {path} has no {BEGIN} marker; add one where the table goes")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, old, flags=re.S)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def main() -> None:
    wanted = [a.zfill(2) for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as folder:
        rows = [row(n, Path(folder)) for n in lessons(wanted)]
    if wanted:
        print("\n".join(rows))
        return
    write(ROOT / "docs" / "TEACHING.md", table(rows, zh=False))
    write(ROOT / "docs" / "zh" / "TEACHING.md", table(rows, zh=True))
    print("wrote docs/TEACHING.md and docs/zh/TEACHING.md")


if __name__ == "__main__":
    main()
