"""Show what changed between two lessons' code, highlighted: what a new idea costs.

    make diff FROM=04 TO=05
    .venv/bin/python tools/lesson_diff.py 01 05 [--context 3]
"""
from __future__ import annotations

import difflib
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


def main(argv: list[str]) -> None:
    parser = LessonParser(prog="make diff FROM=NN TO=NN", description=__doc__.splitlines()[0],
                          formatter_class=HelpFormatter)
    parser.add_argument("from_lesson", metavar="FROM", help="the earlier lesson's number, e.g. 04")
    parser.add_argument("to_lesson", metavar="TO", help="the later lesson's number, e.g. 05")
    parser.add_argument("--context", type=nonnegative_int, default=3,
                        help="unchanged lines shown around each change")
    args = parser.parse_args(argv)
    a, b = lesson_file(args.from_lesson), lesson_file(args.to_lesson)
    old, new = a.read_text().splitlines(), b.read_text().splitlines()
    diff = list(difflib.unified_diff(old, new, f"lessons/{a.name}", f"lessons/{b.name}",
                                     n=args.context, lineterm=""))
    added = sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))
    removed = sum(1 for l in diff if l.startswith("-") and not l.startswith("---"))
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]{a.name} -> {b.name}[/bold]: {added} lines added, {removed} removed "
                  f"({len(old)} -> {len(new)} lines)\n")
    if diff:
        console.print(Syntax("\n".join(diff), "diff", theme="ansi_dark", background_color="default"))


if __name__ == "__main__":
    main(sys.argv[1:])
