"""The shared code behind the lessons, small enough to read in one sitting:

    cli.py          flags every lesson shares, one-line errors instead of tracebacks
    device.py       --device auto|cpu|cuda and the matching backend (nccl / gloo)
    distributed.py  the rendezvous store on loopback, process groups with a timeout,
                    starting N ranks (spawn) and a clean teardown
    recipe.py       Part 1's recipe (lesson 01): data, model, optimizer, sample order
    transformer.py  Part 2's recipe (lesson 13): a small transformer and its data

Each helper first appears *inline* in the lesson that teaches it; later lessons call it so
they can focus on their own idea. What only measures or guards a lesson (output and step
mode, metrics files, state_dict loading, real data files, process supervision) lives in
apparatus/; the launcher that simulates several machines is tools/nodes.py.
"""
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit: for mistakes the learner can fix."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)
