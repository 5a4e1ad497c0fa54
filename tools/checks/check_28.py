"""Check exercise 28: name the culprit of lesson 28's mystery hang: rank, operation, file:line.

The learner's file holds data only: SEED, WORLD_SIZE, RANK, OPERATION and WHERE, read in the
answer's process (the harness's answer(): the file runs there, never here). The check then
works out the truth itself, from SEED alone: lessons/28_hang_lab/hang_faults.py's mystery()
picks the hang, the rank and the step as the lesson does, and truth() reads the line the hang
is planted on from the lesson's own source. Nothing of the learner's run is trusted: a file
could claim anything about it.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/28_hang_mystery.py"
NAMES = ("SEED", "WORLD_SIZE", "RANK", "OPERATION", "WHERE")
STEPS = 8  # lesson 28's default --steps; the truth does not depend on it (only the step does)

# What to look at again, by what the hidden hang is (never the answer itself)
LOOK = {"order": "Step 5: the first row where the recorders differ, and the line each rank called there",
        "skip": "Step 5: the first row where the recorders differ; what did the odd rank call instead, "
                "and which call comes before that one on the other ranks?",
        "die": "Steps 5-7: a rank with no dump, no check-in and no stack; the others wait for it somewhere",
        "shapes": "the logs (log_rank_N.txt): which rank did gloo abort, and in which call?",
        "p2p": "Step 7: a rank that is alive and checked in, but never reached the collective the others wait in",
        "stuck": "Steps 6 and 7: a rank that is alive (its stack answered) but never checked in"}


def _names(module) -> dict:
    """In the answer's process: the five names, as plain data (anything else as its repr)."""
    said = {}
    for name in NAMES:
        value = getattr(module, name, None)
        said[name] = value if isinstance(value, (str, int, type(None))) and not isinstance(value, bool) else repr(value)
    return said


def check(path: Path) -> str:
    """Name the rank, the operation and the file:line of lesson 28's mystery hang."""
    from check_exercise import NotYet, answer, one_line

    import hang_faults

    said = answer(path, _names)
    seed, world = said["SEED"], said["WORLD_SIZE"]
    if not isinstance(seed, int) or not 0 <= seed < 2 ** 31:
        raise NotYet(f"SEED must be the --seed you ran with, a whole number from 0 to {2 ** 31 - 1}; it is {seed}")
    if not isinstance(world, int) or world not in (3, 4, 6, 8):
        raise NotYet(f"WORLD_SIZE must be the --world-size you ran with (3, 4, 6 or 8; 3 unless you passed one); "
                     f"it is {world}")
    if not isinstance(said["RANK"], int):
        raise NotYet(f"RANK is not filled in yet. Hang the job (make lesson-28 ARGS=\"--hang mystery"
                     f"{'' if seed == 0 else f' --seed {seed}'}\"), read its Steps 5-7, and name the culprit rank")
    for name in ("OPERATION", "WHERE"):
        if not isinstance(said[name], str) or not said[name].strip():
            raise NotYet(f"{name} is not filled in yet: the call that went wrong and its file:line, as Steps 5-7 print them")
    fault = hang_faults.mystery(seed, world, STEPS)
    truth = hang_faults.truth(fault)
    rank, operation, where = said["RANK"], one_line(said["OPERATION"], 60), one_line(said["WHERE"], 120)
    if not 0 <= rank < world:
        raise NotYet(f"RANK {rank} is not a rank of a {world}-rank job (0 to {world - 1})")
    if rank != truth["rank"]:
        raise NotYet(f"SEED {seed}: rank {rank} is not the culprit. Look again at {LOOK[fault.kind]}")
    if not hang_faults.same_operation(operation, truth["operation"]):
        raise NotYet(f"SEED {seed}: rank {rank} is right; {operation!r} is not the call that went wrong. "
                     f"Look again at {LOOK[fault.kind]}")
    if not hang_faults.same_place(where, truth["where"]):
        raise NotYet(f"SEED {seed}: rank {rank} and {truth['operation']} are right; {where!r} is not the line "
                     f"(a file:line such as lessons/28_hang_lab.py:123: the culprit's own call, or for a call it "
                     f"left out or never reached, the line where the others wait)")
    return (f"SEED {seed}: rank {rank}, {truth['operation']} at {truth['where']}: "
            f"{hang_faults.HANGS[fault.kind]}")
