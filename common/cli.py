"""Flags shared by every lesson, and errors a learner can act on.

argparse normally answers a bad flag with a usage block and a traceback-free error; we
shorten that to one line that names the problem and the fix, and exit with code 2.
"""
from __future__ import annotations

import argparse
import gc
import re
import signal
import sys
from pathlib import Path
from typing import NoReturn

from common import ROOT, fail  # noqa: F401 (lessons import fail from here)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, except where it says nothing (None, False) or the help
    text already explains it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


class LessonParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        self.given = list(sys.argv[1:] if args is None else args)  # for error(), below
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # called by argparse on a bad flag
        # argparse reads "-7e9" (not "-7") as a flag, and says "expected one argument"
        missing = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        given = getattr(self, "given", [])
        for i, token in enumerate(given[:-1]):
            if missing and token in missing[1].split("/") and _is_number(given[i + 1]):
                fail(f"argument {token}: {given[i + 1]} is a negative number, which argparse took for "
                     f"a flag; {token} takes a positive one (run with --help to see every flag)")
        fail(f"{message} (run with --help to see every flag)")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _number(text: str, kind, ok, expected: str):
    """argparse's type= check: the flag's value as `kind`, or one line naming what was expected."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a whole number of 1 or more")


def nonnegative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "a whole number of 0 or more")


def positive_float(text: str) -> float:
    # inf and nan fail too: a timeout must end (timedelta overflows)
    return _number(text, float, lambda v: 0 < v < 1e9, "a number above 0 (and below 1e9)")


def seed_number(text: str) -> int:
    """A seed torch.manual_seed and the per-rank seeds derived from it accept."""
    return _number(text, int, lambda v: 0 <= v < 2**31, f"a seed between 0 and {2**31 - 1}")


def port_number(text: str) -> int:
    return _number(text, int, lambda v: 1024 <= v <= 65535, "a port number between 1024 and 65535")


def lesson_parser(doc: str | None, *, recipe: bool = True, distributed: bool = False,
                  world_size: int | None = None, out: str = "runs/lesson-NN") -> LessonParser:
    """The flags every lesson shares, with the same names everywhere.

    recipe:      --epochs/--seed/--dataset flags of the shared training recipe
    distributed: --timeout and --master-port for lessons that start a process group
    world_size:  add --world-size with this default
    out:         --out's default folder, as --help names it (a companion script's own)
    """
    from common.recipe import EPOCHS, SEED  # late import keeps `--help` fast

    first_line = (doc or "").strip().splitlines()[0] if doc else None
    parser = LessonParser(description=first_line,
                          formatter_class=HelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to compute: auto picks cuda when available, else cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for final.pt and metrics.json (default: {out})")
    parser.add_argument("--step", action="store_true",
                        help="pause after each step until Enter (only when stdin is a terminal)")
    if recipe:
        parser.add_argument("--epochs", type=positive_int, default=EPOCHS,
                            help="passes over the training set")
        parser.add_argument("--seed", type=seed_number, default=SEED,
                            help="seed for the initial weights and the sample order")
        parser.add_argument("--dataset", choices=["synthetic", "mnist", "cifar10"],
                            default="synthetic",
                            help="synthetic needs no download; mnist/cifar10 read --data-dir")
        parser.add_argument("--data-dir", type=Path, default=ROOT / "data",
                            help="where mnist/cifar10 files live (or are downloaded to)")
        parser.add_argument("--download", action="store_true",
                            help="download mnist/cifar10 into --data-dir if missing")
    if world_size is not None:
        parser.add_argument("--world-size", type=positive_int, default=world_size,
                            help="how many processes (ranks) to start")
    if distributed:
        parser.add_argument("--timeout", type=positive_float, default=60.0,
                            help="seconds a collective may wait before the job fails")
        parser.add_argument("--master-port", type=port_number, default=None,
                            help="TCP port of the rendezvous store (default: a free one)")
    return parser


def run(main) -> None:
    """Run a lesson's main(); Ctrl-C ends it with one line instead of a traceback. Started
    by make, it dies with make (common/processes.py: die_with_make)."""
    from common import _interrupted_while_starting
    from common.processes import die_with_make, forkable_from_here

    die_with_make()
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # started: Python's own again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not gc.isenabled():  # off while the script imported torch (common/__init__.py)
        gc.freeze()  # what it imported: kept, and never walked by a collection again
        gc.enable()
    forkable_from_here()  # its ranks are forked from it while it starts no thread (start_ranks)
    try:
        main()
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted (Ctrl-C): nothing was saved for this run\n")
        raise SystemExit(130)
