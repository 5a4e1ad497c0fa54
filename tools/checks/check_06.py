"""Check exercise 06: who am I under torchrun.

The learner's file runs as the workers of two simulated nodes (tools/nodes.py: 2 nodes x 2
processes, torchrun underneath); each worker prints one JSON line with its rank, local rank,
world size and node, which must match the layout torchrun started. Under plain python the
same file must answer a world of one.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/06_who_am_i.py"


def check(path: Path) -> str:
    """Run the file under two simulated torchrun nodes and compare with the real layout."""
    import re
    import sys

    from check_exercise import NotYet, one_line, owned

    # owned: the learner's file runs in processes the check ends, all of them, within a time limit
    proc = owned([sys.executable, "tools/nodes.py", "--nnodes", "2", "--nproc-per-node", "2",
                  "--rdzv-timeout", "30", "--", str(path)], 180)
    if proc["reason"] != "exited":
        raise NotYet("the file did not finish under torchrun within 180s: does a worker wait forever?")
    if proc["code"] != 0:
        raise NotYet(f"the file did not run under torchrun: "
                     f"{[one_line(line, 300) for line in proc['stderr'].strip().splitlines()[-1:]]}")
    # workers share one stdout: find every {...} report, even if two landed on one line
    reports = [_report(m) for m in re.findall(r"\{[^{}]*\}", proc["stdout"])]
    if len(reports) != 4:
        raise NotYet(f"expected 4 workers to report one JSON line each, got {len(reports)}")
    got = sorted(reports)
    want = [(0, 0, 4, 0), (1, 1, 4, 0), (2, 0, 4, 1), (3, 1, 4, 1)]
    if got != want:
        raise NotYet(f"the 4 workers answered (rank, local_rank, world_size, node) = {got}; "
                     f"torchrun had started {want}. Which variables does torchrun set?")
    alone = owned([sys.executable, str(path)], 60)
    found = re.findall(r"\{[^{}]*\}", alone["stdout"])
    if alone["reason"] != "exited" or alone["code"] != 0 or not found:
        raise NotYet(f"under plain python the file failed: "
                     f"{[one_line(line, 300) for line in alone['stderr'].strip().splitlines()[-1:]]}")
    answer = _report(found[-1])
    if answer != (0, 0, 1, 0):
        raise NotYet(f"under plain python it answered {one_line(found[-1], 200)}; expected a world of one")
    return "all 4 workers on 2 nodes know who they are, and plain python is a world of one"


def _report(text: str) -> tuple:
    """(rank, local_rank, world_size, node) from one worker's JSON line; NotYet if it is not one."""
    import json

    from check_exercise import NotYet, one_line

    try:
        report = json.loads(text)
        return tuple(int(report[k]) for k in ("rank", "local_rank", "world_size", "node"))
    except (ValueError, KeyError, TypeError):
        raise NotYet(f"a worker printed {one_line(text, 200)}, not a JSON line with rank, local_rank, "
                     f"world_size and node as numbers") from None
