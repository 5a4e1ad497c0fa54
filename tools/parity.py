"""Compare two parity recordings: is every difference rounding, and if not, where does it start?

    .venv/bin/python tools/parity.py runs/lesson-26/reference.pt runs/lesson-26/parallel.pt
    .venv/bin/python tools/parity.py A.pt B.pt --float64 A64.pt B64.pt   # the floors from float64 twins
    .venv/bin/python tools/parity.py A.pt B.pt --limit 2                # a looser verdict

A and B are recordings: what lesson 26 writes (runs/lesson-26/reference.pt and parallel.pt), or
what your own training writes with lessons/26_parity_oracle/parity_oracle.py (Recorder, then
save(); its docstring describes the file). Both are read with torch.load(weights_only=True):
tensors, strings and numbers, never code. The comparison is lesson 26's own (parity_oracle.py):
every entry of A, in A's order, against the same entry of B; each difference against its floor,
the rounding each run carries, measured against its float64 twin (stored in the recording by
measure_rounding, or measured here from --float64's two recordings of the same runs in float64).

It prints, per step, the largest ratio of difference to floor; the entries in order up to the
first divergence (or the largest ratios); and "within rounding everywhere" or where the first
difference leaves its floor. Exit code 0: within rounding; 1: a divergence; 2: a usage mistake
or a file that is not a recording (one `error:` line).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lessons" / "26_parity_oracle"))  # the comparison lesson 26 teaches

from common.cli import HelpFormatter, LessonParser, fail, positive_float  # noqa: E402


def parse_args(argv=None):
    parser = LessonParser(description=__doc__.strip().splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("a", type=Path, help="the recording to compare against (e.g. one process)")
    parser.add_argument("b", type=Path, help="the recording to check (e.g. the parallel run)")
    parser.add_argument("--float64", nargs=2, type=Path, metavar=("A64", "B64"), default=None,
                        help="recordings of the same two runs in float64: their floors are measured from them")
    parser.add_argument("--limit", type=positive_float, default=1.0,
                        help="a ratio of difference to floor above this is not rounding (1: the proven bound)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import parity_oracle  # late: --help and a usage mistake answer before torch is imported
    from apparatus.ui import UI

    try:
        a, b = parity_oracle.load(args.a), parity_oracle.load(args.b)
        if args.float64:
            for recording, twin in zip((a, b), map(parity_oracle.load, args.float64)):
                recording["rounding"] = {}
                parity_oracle.measure_rounding(recording, twin)
    except (ValueError, KeyError) as exc:
        fail(str(exc).strip("'\""))
    ui = UI()
    for name, recording, path in (("A", a, args.a), ("B", b, args.b)):
        measured = sum(k in recording["rounding"] for k in recording["names"])
        ui.print(f"{name}: {path} ({len(recording['names'])} entries; {recording['about'] or 'no description'})")
        if measured < len(recording["names"]):
            ui.print(f"   [yellow]{len(recording['names']) - measured} of its entries carry no measured rounding:"
                     f"[/yellow] their floor is one float32 rounding step only; record the same run in float64 "
                     f"and pass --float64 (lesson 26, Step 2)")
    rows = parity_oracle.compare(a, b)
    if not rows:
        fail(f"{args.a} holds no entries to compare")
    for step in sorted(parity_oracle.by_step(rows)):
        ui.print(parity_oracle.step_line(step, rows, args.limit))
    first = parity_oracle.first_divergence(rows, args.limit)
    ui.table("In the order they happened: " + ("the entries up to the first divergence" if first else
             f"the largest ratios (none above {args.limit:g})"), parity_oracle.COLUMNS,
             parity_oracle.table_rows(rows, args.limit))
    ui.print(parity_oracle.verdict_line(rows, args.limit))
    return 0 if first is None else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
