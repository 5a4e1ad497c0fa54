"""What each lesson costs a classroom, measured: `make lesson-NN`'s default run (wall time and
the peak memory of all its processes together), its first run apart from the later ones, the
heavier runs the exercises ask for, and `make check-NN` on the solution (what grading one
student's file takes). Writes the tables between the markers in docs/TEACHING.md and
docs/zh/TEACHING.md, so the guide's numbers are this machine's, never typed by hand.

    make lesson-costs                                 # the same as the next line
    .venv/bin/python tools/lesson_costs.py            # everything; rewrites both guides (about 30 min on 2 idle cores)
    .venv/bin/python tools/lesson_costs.py 01 15      # some lessons; prints the rows only
    .venv/bin/python tools/lesson_costs.py --update 07  # measure lesson 07 again, in both guides' tables

Each lesson runs in a scratch copy of the repository whose runs/ starts empty, as in a fresh
clone: its first run trains and caches what it compares with (lesson 13's reference for Part
2, lesson 22's one-process runs), then it runs twice more (the later runs, read from that
cache). The numbers are wall-clock seconds, so they depend on what else the machine does:
before every run, the cores other jobs keep busy are measured for 1 s (/proc/stat, while
nothing of ours runs), the load average (processes wanting a core, from /proc/loadavg, the
lesson's own included) is sampled during every run, and the table says both. Memory is the
sum of the proportional set sizes (PSS) of the lesson's process and everything under it,
sampled every 0.1 s: the peak a laptop must hold (summed RSS would count torch's shared
libraries once per process; /usr/bin/time -v reports the largest single process only).
"""
from __future__ import annotations

import difflib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
BEGIN, END = "<!-- lesson-costs:begin -->", "<!-- lesson-costs:end -->"
CLASS = 30  # students whose files a teacher checks one after the other
# The heavier runs the exercises ask for (docs 21 and 22): (lesson, flags, what the doc asks)
EXERCISE_RUNS = [("21", ["--world-size", "8"], "exercise 2: N = 8"),
                 ("22", ["--world-size", "4", "--experts", "8", "--top-k", "2"], "exercises: E = 8, k = 2 on 4 ranks")]
LATER_RUNS = 2  # after the first: their spread is the range a teacher plans with


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


def load_average() -> float:
    """The 1-minute load average: processes running or wanting a core (Linux /proc/loadavg)."""
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


LOADS: list[float] = []  # every load average sampled during a measured run
OTHERS: list[float] = []  # cores kept busy by other jobs, sampled just before each measured run


def busy_core_seconds() -> float:
    """CPU seconds all of this machine's cores have spent busy since it started (Linux /proc/stat)."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    except (OSError, ValueError):
        return float("nan")
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_busy(seconds: float = 1.0) -> float:
    """How many cores other jobs keep busy: measured over `seconds` while nothing of ours runs.
    The load average cannot say it: it counts the lesson's own processes too (a 4-rank lesson
    alone on 2 cores gives about 4), and it lags a minute behind."""
    before, start = busy_core_seconds(), time.monotonic()
    time.sleep(seconds)
    return (busy_core_seconds() - before) / (time.monotonic() - start)


def measure(cmd: list[str], timeout: float = 900, cwd: Path = ROOT) -> tuple[float, int, int]:
    """(wall seconds, peak summed PSS in bytes, exit code) of `cmd` and all it starts."""
    OTHERS.append(others_busy())
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    peak, sampled = 0, time.monotonic()
    while proc.poll() is None:
        peak = max(peak, pss_bytes(descendants(proc.pid)))
        if time.monotonic() - start > timeout:
            proc.kill()
        if time.monotonic() - sampled >= 1:
            LOADS.append(load_average())
            sampled = time.monotonic()
        time.sleep(0.1)
    return time.monotonic() - start, peak, proc.returncode


def scratch_copy(folder: Path) -> Path:
    """The repository's files (not .git, runs/, data/) in `folder`, its .venv a link to ours:
    lessons there find ROOT = folder, so their caches (runs/reference-*) start empty."""
    copy = folder / "repo"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "data", "__pycache__", ".pytest_cache"))
    (copy / ".venv").symlink_to(ROOT / ".venv")
    return copy


def answer_lines(num: str) -> int | None:
    """How many lines of the starter the checked answer changes (a diff of the two files)."""
    starters = sorted((ROOT / "exercises").glob(f"{num}_*.py"))
    answers = sorted((ROOT / "tests" / "solutions").glob(f"{num}_*.py"))
    if not starters or not answers:
        return None
    old = [line for line in starters[0].read_text().splitlines() if line.strip()]  # blank lines
    new = [line for line in answers[0].read_text().splitlines() if line.strip()]   # do not count
    diff = difflib.unified_diff(old, new, lineterm="", n=0)
    return sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))


def lessons(wanted: list[str]) -> list[str]:
    found = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    return [n for n in found if not wanted or n in wanted]


def shown(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 1 else "under 1 s"


def spread(seconds: list[float]) -> str:
    """The range of several runs: "8-11 s" (or "9 s", "under 1 s")."""
    if max(seconds) < 1:
        return "under 1 s"
    low, high = max(1, round(min(seconds))), round(max(seconds))
    return f"{high} s" if low == high else f"{low}-{high} s"


def lesson_command(num: str, copy: Path, flags: list[str]) -> list[str]:
    """What `make lesson-NN ARGS=...` runs (the Makefile's launcher for 06 and 07), in `copy`."""
    lesson = sorted((copy / "lessons").glob(f"{num}_*.py"))[0]
    launcher = re.search(rf"^RUN_{num} := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return [PY, *(launcher.group(1).split() if launcher else []), str(lesson), *flags]


def first_and_later(num: str, copy: Path, flags: list[str]) -> tuple[str, str, int]:
    """(first run, later runs, peak bytes): the first in a copy whose runs/ is empty."""
    shutil.rmtree(copy / "runs", ignore_errors=True)
    out = ["--out", str(copy / "runs" / "measured")]
    runs = [measure(lesson_command(num, copy, flags + out), cwd=copy) for _ in range(1 + LATER_RUNS)]
    failed = next((code for _, _, code in runs if code != 0), None)
    if failed is not None:
        return f"failed ({failed})", f"failed ({failed})", 0
    return shown(runs[0][0]), spread([s for s, _, _ in runs[1:]]), max(p for _, p, _ in runs)


def row(num: str, copy: Path) -> str:
    first, later, peak = first_and_later(num, copy, [])
    cells = [num, first, later, f"{peak / 2**20:,.0f} MiB"]
    solutions = sorted((ROOT / "tests" / "solutions").glob(f"{num}_*.py"))
    if solutions:
        check_s, check_peak, check_code = measure([PY, "tools/check_exercise.py", num, str(solutions[0])])
        cells += [shown(check_s) if check_code == 0 else f"failed ({check_code})",
                  f"{check_s * CLASS / 60:.0f} min" if check_s * CLASS >= 60 else "under 1 min",
                  str(answer_lines(num))]
    else:
        cells += ["-", "-", "-"]
    print(" | ".join(cells), file=sys.stderr, flush=True)
    return "| " + " | ".join(cells) + " |"


def exercise_row(num: str, flags: list[str], why: str, copy: Path) -> str:
    first, later, peak = first_and_later(num, copy, flags)
    cells = [f"`make lesson-{num} ARGS=\"{' '.join(flags)}\"` ({why})", first, later, f"{peak / 2**20:,.0f} MiB"]
    print(" | ".join(cells), file=sys.stderr, flush=True)
    return "| " + " | ".join(cells) + " |"


def conditions(loads: list[float], cores: int, others: list[float] = ()) -> tuple[str, str]:
    """How busy the machine was while it measured (en, zh). With `others` (cores other jobs
    kept busy, sampled before each run): idle when they never took more than a quarter of a
    core; the load average's range is given beside, for what it is. Without them (a table
    measured before they were sampled), the load average alone decides."""
    loads = [x for x in loads if x == x] or [0.0]
    low, high = min(loads), max(loads)
    others = [x for x in others if x == x]
    if others:
        most = max(others)
        load_en = f"load average {low:.1f}-{high:.1f} while the lessons ran, their own processes included"
        load_zh = f"课程运行时平均负载 {low:.1f}-{high:.1f}，其中包括课程自己的进程"
        if most <= 0.25:
            return (f"an otherwise idle machine (other jobs: up to {most:.1f} of {cores} cores busy, "
                    f"sampled for 1 s before each run; {load_en})",
                    f"空闲的机器上（其他任务最多占用 {most:.1f} 个核，共 {cores} 个，每次运行前采样 1 秒；{load_zh}）")
        return (f"a machine other jobs kept busy (other jobs: up to {most:.1f} of {cores} cores busy, "
                f"sampled for 1 s before each run; {load_en}): on an idle laptop expect shorter times",
                f"被其他任务占得很忙的机器上（其他任务最多占用 {most:.1f} 个核，共 {cores} 个，每次运行前采样 1 秒；"
                f"{load_zh}）：空闲的笔记本上会更快")
    if high <= cores / 2:
        return (f"an otherwise idle machine (load average {low:.1f}-{high:.1f})",
                f"空闲的机器上（平均负载 {low:.1f}-{high:.1f}）")
    return (f"a machine other jobs kept busy (load average {low:.1f}-{high:.1f}, that is up to "
            f"{high / cores:.1f} processes wanting each core): on an idle laptop expect shorter times",
            f"被其他任务占得很忙的机器上（平均负载 {low:.1f}-{high:.1f}，即每个核最多有 {high / cores:.1f} 个进程在等）："
            f"空闲的笔记本上会更快")


def table(rows: list[str], zh: bool, extra: list[str] = (), loads: list[float] = (),
          others: list[float] = ()) -> str:
    cores = os.cpu_count() or 1
    cpu = f"{cores} cores, {platform.machine()}"
    when = time.strftime("%Y-%m-%d")
    busy_en, busy_zh = conditions(list(loads), cores, list(others))
    if zh:
        head = (f"由 `make lesson-costs`（`.venv/bin/python tools/lesson_costs.py`）在 {cpu} 的{busy_zh}测得（{when}）。"
                f"首次运行：在 runs/ 为空的副本里（如同新克隆），训练并缓存它要对照的基准；之后的运行：再运行 {LATER_RUNS} 次，"
                f"读缓存（给出范围）。内存峰值：它所有进程合计（PSS：共享的页按进程数分摊），取各次运行的最大值；"
                f"对参考答案运行一次检查的时间；依次检查 {CLASS} 名学生的文件所需的时间；答案改动起始文件的行数。\n\n"
                "| 课 | 首次运行 | 之后的运行 | 内存峰值（所有进程） | 检查一个文件 | 检查 30 个文件 | 答案改动的行数 |\n"
                "|----|----------|------------|----------------------|--------------|----------------|----------------|")
        tail = ("\n\n练习要求的较重的运行（同样测得）：\n\n"
                "| 运行 | 首次运行 | 之后的运行 | 内存峰值（所有进程） |\n"
                "|------|----------|------------|----------------------|") if extra else ""
    else:
        head = (f"Measured by `make lesson-costs` (`.venv/bin/python tools/lesson_costs.py`) on {busy_en}; "
                f"{cpu} ({when}). First run: in a copy whose runs/ is empty, as in a fresh clone; it "
                f"trains and caches what the lesson compares with. Later runs: {LATER_RUNS} more, "
                f"read from that cache (their range). Peak memory: all its processes together (PSS: a "
                f"page shared by k processes counts once), the largest of the runs. One check of the "
                f"solution; checking {CLASS} students' files one after the other; the lines the "
                f"answer changes in the starter.\n\n"
                "| lesson | first run | later runs | peak memory (all processes) | check one file | check 30 files | answer: lines changed |\n"
                "|--------|-----------|------------|-----------------------------|----------------|----------------|-----------------------|")
        tail = ("\n\nThe heavier runs the exercises ask for, measured the same way:\n\n"
                "| run | first run | later runs | peak memory (all processes) |\n"
                "|-----|-----------|------------|-----------------------------|") if extra else ""
    return "\n".join([BEGIN, head, *rows]) + (tail + "\n" + "\n".join(extra) if extra else "") + "\n" + END


def write(path: Path, text: str) -> None:
    old = path.read_text()
    if BEGIN not in old:
        raise SystemExit(f"error: {path} has no {BEGIN} marker; add one where the table goes")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, old, flags=re.S)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def current_table(path: Path) -> tuple[dict[str, str], list[str], list[float], list[float]]:
    """What the guide's table holds now: its lesson rows by number, the exercise runs' rows,
    the load average's range and the other jobs' cores its header states (to update a few
    rows, not all)."""
    inside = path.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {line[2:4]: line for line in inside.splitlines() if line.startswith("| ") and line[2:4].isdigit()}
    extra = [line for line in inside.splitlines() if line.startswith("| `make lesson-")]
    loads = re.search(r"load average ([\d.]+)-([\d.]+)", inside) or re.search(r"平均负载 ([\d.]+)-([\d.]+)", inside)
    others = re.search(r"other jobs: up to ([\d.]+) of", inside) or re.search(r"其他任务最多占用 ([\d.]+) 个核", inside)
    return (rows, extra, [float(loads[1]), float(loads[2])] if loads else [],
            [float(others[1])] if others else [])


GUIDES = (ROOT / "docs" / "TEACHING.md", ROOT / "docs" / "zh" / "TEACHING.md")


def update(wanted: list[str], guides: tuple[Path, Path] = GUIDES) -> None:
    """Measure `wanted` again (a row that failed while someone edited its check) and rewrite
    both guides' tables with them, the other rows as they were; the header's load range
    widens to this run's."""
    rows, extra, loads, others = current_table(guides[0])
    start, start_others = len(LOADS), len(OTHERS)
    with tempfile.TemporaryDirectory(prefix="lesson-costs-") as folder:
        copy = scratch_copy(Path(folder))
        rows.update({n: row(n, copy) for n in wanted})
    # A header from before the other jobs' cores were sampled gives only its load range: with
    # no share for its rows, the load range alone must keep deciding idle or busy.
    if others or not loads:
        others = others + OTHERS[start_others:]
    ordered = [rows[n] for n in lessons([]) if n in rows]
    write(guides[0], table(ordered, zh=False, extra=extra, loads=loads + LOADS[start:], others=others))
    write(guides[1], table(ordered, zh=True, extra=extra, loads=loads + LOADS[start:], others=others))
    print(f"measured {' '.join(wanted)} again; wrote {guides[0].name} (en, zh)")


def main() -> None:
    if sys.argv[1:2] == ["--update"]:
        return update([a.zfill(2) for a in sys.argv[2:]])
    wanted = [a.zfill(2) for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory(prefix="lesson-costs-") as folder:
        copy = scratch_copy(Path(folder))
        rows = [row(n, copy) for n in lessons(wanted)]
        extra = [] if wanted else [exercise_row(n, flags, why, copy) for n, flags, why in EXERCISE_RUNS]
    if wanted:
        print("\n".join(rows))
        return
    write(ROOT / "docs" / "TEACHING.md", table(rows, zh=False, extra=extra, loads=LOADS, others=OTHERS))
    write(ROOT / "docs" / "zh" / "TEACHING.md", table(rows, zh=True, extra=extra, loads=LOADS, others=OTHERS))
    print("wrote docs/TEACHING.md and docs/zh/TEACHING.md")


if __name__ == "__main__":
    main()
