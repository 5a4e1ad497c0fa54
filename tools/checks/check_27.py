"""Check exercise 27: name the zoo's bug that a mystery run shows.

The learner's file holds data only: SEED and BUG, read in the answer's process (the harness's
answer(): the file runs there, never here). The check then draws the truth itself, from SEED,
with lesson 27's own draw (lessons/27_bug_zoo/bug_zoo.py's mystery: a hash of the seed, the
same the lesson's --bug mystery uses), and compares. A wrong name gets, as its hint, what that
bug would have shown, never what the hidden one is.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/27_mystery_bug.py"
NAMES = ("SEED", "BUG")


def _names(module) -> dict:
    """In the answer's process: the two names, as plain data (anything else as its repr)."""
    said = {}
    for name in NAMES:
        value = getattr(module, name, None)
        said[name] = value if isinstance(value, (str, int)) and not isinstance(value, bool) else repr(value)
    return said


def check(path: Path) -> str:
    """BUG is the zoo's name of the bug that lesson 27's --bug mystery runs for SEED."""
    from check_exercise import NotYet, answer

    import bug_zoo

    said = answer(path, _names)
    seed = said["SEED"]
    if not isinstance(seed, int) or not 0 <= seed < 2 ** 31:
        raise NotYet(f"SEED must be a whole number from 0 to {2 ** 31 - 1} (your teacher may give you one); it is {seed}")
    bug = said["BUG"].strip() if isinstance(said["BUG"], str) else said["BUG"]
    if not isinstance(bug, str) or not bug:
        raise NotYet(f"BUG is not filled in yet. Run the mystery (.venv/bin/python {STARTER}, or make lesson-27 "
                     f"ARGS=\"--bug mystery --seed {seed}\"), read its Steps 2 and 3, and name the bug")
    if bug not in bug_zoo.ZOO:
        raise NotYet(f"BUG is one of lesson 27's names ({', '.join(bug_zoo.ZOO)}), not {bug!r}")
    truth = bug_zoo.ZOO[bug_zoo.mystery(seed)]
    if bug != truth.NAME:
        raise NotYet(f"SEED {seed}'s mystery is not {bug}. {bug} would have shown this: {bug_zoo.ZOO[bug].SIGNS}. "
                     f"Compare with what your run printed in Steps 2 and 3")
    return (f"SEED {seed}: the mystery is {truth.NAME}, {truth.UPSTREAM} \"{truth.TITLE}\": {truth.MISTAKE}; "
            f"the fix: {truth.FIX}")
