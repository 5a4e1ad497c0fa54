"""The hangs lesson 28 plants in its job, the mystery a seed picks, and the truth of each.

Lesson 28 (lessons/28_hang_lab.py, docs/28_hang_lab.md) plants one bug on one rank at one
step; this module only says which. Each bug is a few lines of the lesson's own loop (Step 3),
each marked by a comment naming its --hang flag, so a learner reads it where it happens.

* `HANGS`: every --hang name, with one line on what goes wrong and where it happens for real.
* `Fault`: which hang, on which rank, at which step; `fault.here(rank, step, kind)` is True on
  the one rank and step where that kind of bug fires.
* `mystery(seed, world, steps)`: the hidden fault of `--hang mystery` (exercise 28).
* `truth(fault)`: what a correct diagnosis says (rank, operation, where), found from the
  lesson's source without running anything: how check-28 grades an answer.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "28_hang_lab.py"
ROOT = LESSON.parent.parent

# name: what goes wrong (the cause it stands for)
HANGS = {
    "order": "one rank calls the broadcast before the all_reduce, the others after it "
             "(a refactor that moved a call on one code path)",
    "skip": "one rank leaves the loss's all_reduce out (a rank-local `if` around a collective)",
    "die": "one rank stops dead mid-step, its connections left open (a machine that lost power)",
    "shapes": "one rank all_gathers a tensor one element shorter (an uneven last batch)",
    "p2p": "one rank waits for a message rank 0 never sends (two versions of the code on "
           "two machines)",
    "stuck": "one rank waits in Python, on a queue nothing will ever fill, before a collective "
             "(a helper thread that died)",
}

# What the culprit did, as a diagnosis names it: the call, and the line that shows it.
# order/shapes/p2p/stuck: the culprit's own call; skip: the call it left out; die: the call
# the others wait in, which it never reached (it has no stack to show).
OPERATION = {"order": "broadcast", "skip": "all_reduce", "die": "all_reduce",
             "shapes": "all_gather", "p2p": "recv", "stuck": "get"}


@dataclass(frozen=True)
class Fault:
    kind: str | None = None  # one of HANGS, or None: a healthy job
    rank: int = 1
    step: int = 3

    def here(self, rank: int, step: int, kind: str) -> bool:
        """True on the one rank and step where this fault's bug fires, for its own kind."""
        return self.kind == kind and rank == self.rank and step == self.step

    def fires(self, rank: int, step: int) -> bool:
        return self.kind is not None and rank == self.rank and step == self.step


def mystery(seed: int, world: int, steps: int) -> Fault:
    """The fault `--hang mystery --seed SEED` plants: a hash of the seed picks the hang, the
    rank (p2p: not rank 0, which sends) and the step (neither the first nor the last)."""
    digest = hashlib.sha256(f"lesson 28 mystery {seed}".encode()).digest()
    kind = sorted(HANGS)[digest[0] % len(HANGS)]
    lowest = 1 if kind == "p2p" else 0
    rank = lowest + digest[1] % (world - lowest)
    step = 1 + digest[2] % max(1, steps - 2)
    return Fault(kind, rank, step)


def site(kind: str, source: Path = LESSON) -> str:
    """'lessons/28_hang_lab.py:LINE': the one code line whose comment names `--hang KIND`."""
    found = [n for n, line in enumerate(source.read_text().splitlines(), 1)
             if re.search(rf"#.*--hang {kind}\b", line)]
    if len(found) != 1:
        raise LookupError(f"{source.name} marks --hang {kind} on lines {found}, not on exactly one")
    return f"{source.relative_to(ROOT).as_posix()}:{found[0]}"


def truth(fault: Fault) -> dict:
    """What a right diagnosis of `fault` says: the culprit rank, the operation, its file:line."""
    return {"rank": fault.rank, "operation": OPERATION[fault.kind], "where": site(fault.kind)}


def same_operation(said: str, right: str) -> bool:
    """'dist.all_reduce()', 'gloo:all_reduce' and 'all_reduce' name one call; 'Queue.get' is 'get'."""
    name = re.split(r"[.:]", str(said).strip().removesuffix("()").strip())[-1]
    return name.strip().lower() == right.lower()


def same_place(said: str, right: str) -> bool:
    """'lessons/28_hang_lab.py:171', '28_hang_lab.py:171', '/home/me/.../28_hang_lab.py, line 171'."""
    file, line = right.rsplit(":", 1)
    found = re.search(r"([\w.\-/\\]+\.py)\D{0,12}?(\d+)", str(said))
    return bool(found) and Path(found[1]).name == Path(file).name and found[2] == line


def matches(verdict: dict | None, right: dict | None) -> bool | None:
    """Does a diagnosis name the truth's rank, operation and line? None when there is no truth."""
    if right is None or verdict is None:
        return None if right is None else False
    return (verdict.get("rank") == right["rank"] and same_operation(verdict.get("operation") or "", right["operation"])
            and same_place(verdict.get("where") or "", right["where"]))
