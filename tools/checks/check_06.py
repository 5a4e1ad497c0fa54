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
    import json
    import re
    import subprocess
    import sys

    from check_exercise import ROOT, NotYet

    proc = subprocess.run([sys.executable, "tools/nodes.py", "--nnodes", "2",
                           "--nproc-per-node", "2", "--rdzv-timeout", "30", "--", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise NotYet(f"the file did not run under torchrun: {proc.stderr.strip().splitlines()[-1:]}")
    # workers share one stdout: find every {...} report, even if two landed on one line
    reports = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
    if len(reports) != 4:
        raise NotYet(f"expected 4 workers to report one JSON line each, got {len(reports)}")
    got = sorted((r["rank"], r["local_rank"], r["world_size"], r["node"]) for r in reports)
    want = [(0, 0, 4, 0), (1, 1, 4, 0), (2, 0, 4, 1), (3, 1, 4, 1)]
    if got != want:
        raise NotYet(f"the 4 workers answered (rank, local_rank, world_size, node) = {got}; "
                     f"torchrun had started {want}. Which variables does torchrun set?")
    alone = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    found = re.findall(r"\{[^{}]*\}", alone.stdout)
    if alone.returncode != 0 or not found:
        raise NotYet(f"under plain python the file failed: {alone.stderr.strip().splitlines()[-1:]}")
    answer = json.loads(found[-1])
    if (answer["rank"], answer["local_rank"], answer["world_size"], answer["node"]) != (0, 0, 1, 0):
        raise NotYet(f"under plain python it answered {answer}; expected a world of one")
    return "all 4 workers on 2 nodes know who they are, and plain python is a world of one"
