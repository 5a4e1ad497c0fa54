"""Show what changed between two lessons' code, highlighted: what a new idea costs.

    make diff TO=14                 # lesson 14 against its parent (named in its docstring)
    make diff FROM=01 TO=05
    .venv/bin/python tools/lesson_diff.py 13 14 [--context 3] [--all]

What a lesson leaves out of its parent (the parent's own demonstrations: lesson 15 does not
re-measure lesson 13's activations) is not its idea: a run of FOLD or more removed lines is
shown as its first line and one line saying how many follow. --all shows every line.

A lesson that grows from another names it in its docstring, on a line of its own:
`Parent: lesson 13 (lessons/13_transformer_memory.py)`. `parent_of` reads that line.
"""
from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.syntax import Syntax  # noqa: E402

from common.cli import HelpFormatter, LessonParser, fail, nonnegative_int  # noqa: E402


def lesson_file(number: str) -> Path:
    number = number.zfill(2)
    matches = sorted((ROOT / "lessons").glob(f"{number}_*.py"))
    if not matches:
        have = " ".join(sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")))
        fail(f"there is no lesson {number!r}; the lessons are: {have} (e.g. make diff FROM=04 TO=05)")
    return matches[0]


PARENT = re.compile(r"^Parent: lesson (\d\d)\b", re.M)


def parent_of(path: Path) -> str | None:
    """The number of the lesson `path` grows from, or None for a lesson that opens a topic."""
    match = PARENT.search(path.read_text())
    return match[1] if match else None


def added_lines(a: Path, b: Path) -> int:
    """Lines of b that are not in a, as `diff` counts them: what lesson b adds to lesson a.
    (What b drops of a, the parent's own demonstrations, costs nothing.)"""
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0, lineterm="")
    return sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))


FOLD = 10  # removed lines in a row, from which on they are folded into one line


def folded(diff: list[str], parent: str, child: str) -> list[str]:
    """The unified diff with each run of FOLD or more removed lines cut to its first line and
    "-   ... N more lines of lesson NN that this lesson leaves out ...". Added lines and
    context are kept whole: they are the new idea and where it goes."""
    out: list[str] = []
    run: list[str] = []

    def flush():
        if len(run) >= FOLD:
            out.extend([run[0], f"-   ... {len(run) - 1} more lines of lesson {parent} that lesson "
                                 f"{child} leaves out (make diff TO={child} ARGS=--all shows them) ..."])
        else:
            out.extend(run)
        run.clear()

    for line in diff:
        if line.startswith("-") and not line.startswith("---"):
            run.append(line)
            continue
        flush()
        out.append(line)
    flush()
    return out


def main(argv: list[str]) -> None:
    parser = LessonParser(prog="make diff FROM=NN TO=NN", description=__doc__.splitlines()[0],
                          formatter_class=HelpFormatter)
    parser.add_argument("from_lesson", metavar="FROM", nargs="?", default="",
                        help="the earlier lesson's number, e.g. 04 (default: TO's parent)")
    parser.add_argument("to_lesson", metavar="TO", help="the later lesson's number, e.g. 05")
    parser.add_argument("--context", type=nonnegative_int, default=3,
                        help="unchanged lines shown around each change")
    parser.add_argument("--all", action="store_true",
                        help=f"show every removed line (by default a run of {FOLD} or more is folded)")
    args = parser.parse_args(argv)
    b = lesson_file(args.to_lesson)
    if not args.from_lesson:
        args.from_lesson = parent_of(b) or ""
        if not args.from_lesson:
            fail(f"lesson {b.name[:2]} names no parent lesson (it opens a topic); "
                 f"compare two lessons with make diff FROM=NN TO={b.name[:2]}")
    a = lesson_file(args.from_lesson)
    old, new = a.read_text().splitlines(), b.read_text().splitlines()
    diff = list(difflib.unified_diff(old, new, f"lessons/{a.name}", f"lessons/{b.name}",
                                     n=args.context, lineterm=""))
    added = sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))
    removed = sum(1 for l in diff if l.startswith("-") and not l.startswith("---"))
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]{a.name} -> {b.name}[/bold]: {added} lines added, {removed} removed "
                  f"({len(old)} -> {len(new)} lines)\n")
    if diff:
        shown = diff if args.all else folded(diff, a.name[:2], b.name[:2])
        console.print(Syntax("\n".join(shown), "diff", theme="ansi_dark", background_color="default"))


if __name__ == "__main__":
    main(sys.argv[1:])
