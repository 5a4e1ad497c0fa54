"""Check a learner's exercise: `make check-NN [FILE=path]`.

Every check runs the learner's code for real and prints either "ok: ..." (exit 0) or what
is still wrong and a hint (exit 1). Checks live in this file, one function per exercise,
registered in CHECKS; the starter files are in exercises/.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.cli import fail  # noqa: E402


class NotYet(Exception):
    """The learner's answer is not right yet; the message says why."""


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise NotYet(f"{path} does not run: {type(exc).__name__}: {exc}")
    return module


def check_05(path: Path) -> str:
    """Orders differ between epochs, and the ranks still split every epoch exactly."""
    module = load(path)
    size, world, epochs = 96, 3, 3
    per_rank = [module.epoch_orders(size, world, r, epochs) for r in range(world)]
    for epoch in range(epochs):
        together = sorted(i for r in range(world) for i in per_rank[r][epoch])
        if together != list(range(size)):
            raise NotYet(f"in epoch {epoch} the {world} ranks together do not read every sample "
                         f"exactly once; each epoch must still be split between the ranks")
    for r in range(world):
        if per_rank[r][0] == per_rank[r][1] or per_rank[r][1] == per_rank[r][2]:
            raise NotYet(f"rank {r} reads the same order in two epochs: "
                         f"{per_rank[r][0][:6]}... both times. Where does the epoch enter the sampler?")
    if module.epoch_orders(size, world, 0, 2) != module.epoch_orders(size, world, 0, 2):
        raise NotYet("two calls with the same seed give different orders; keep it deterministic")
    return f"every epoch has a new order on each of {world} ranks, and every epoch is split exactly"


def check_06(path: Path) -> str:
    """Run the file under two simulated torchrun nodes and compare with the real layout."""
    proc = subprocess.run([sys.executable, "-m", "common.nodes", "--nnodes", "2",
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


CHECKS = {
    "05": ("exercises/05_set_epoch.py", check_05),
    "06": ("exercises/06_who_am_i.py", check_06),
}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("Checked exercises (make check-NN [FILE=path]):")
        for n, (starter, fn) in sorted(CHECKS.items()):
            print(f"  make check-{n}   {starter}: {fn.__doc__.strip().splitlines()[0]}")
        return
    number = argv[0].zfill(2)
    if number not in CHECKS:
        fail(f"lesson {number} has no checked exercise; these do: {' '.join(sorted(CHECKS))}")
    starter, check = CHECKS[number]
    path = Path(argv[1]) if len(argv) > 1 and argv[1] else ROOT / starter
    if not path.exists():
        fail(f"{path} not found; give the learner's file as FILE=path")
    try:
        message = check(path.resolve())
    except NotYet as exc:
        print(f"not yet: {exc}")
        raise SystemExit(1)
    except subprocess.TimeoutExpired:
        print("not yet: the exercise did not finish in time (does something wait forever?)")
        raise SystemExit(1)
    print(f"ok: {message}")


if __name__ == "__main__":
    main(sys.argv[1:])
