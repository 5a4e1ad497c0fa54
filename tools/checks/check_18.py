"""Check exercise 18: the learner's 1F1B action lists, run through lesson 18's timeline.

For several (p ranks, m micro-batches), schedule(p, m) must give every rank its own stage's
forwards and backwards, each micro-batch once; pipeline.timeline must be able to
run them (no rank waits forever); stage r may hold at most min(p - r, m) micro-batches at once
(counted along its list: +1 per forward, -1 per backward); and the idle time must be
(p-1)/(m+p-1), as GPipe's.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/18_one_f_one_b.py"
CASES = [(2, 4), (4, 8), (4, 4), (3, 6), (4, 2), (2, 1)]


def _plain(value):
    """A value of the learner's, as torch.save can send it back: ints and strings as they are."""
    return value if isinstance(value, (int, str)) else str(value)


def _schedules(module) -> list:
    """In the answer's process: schedule(p, m) for every case, as {rank: [action tuples]}."""
    from check_exercise import NotYet

    if not hasattr(module, "schedule"):
        raise NotYet(f"{module.__file__} has no function schedule(p, m)")
    out = []
    for p, m in CASES:
        try:
            actions = module.schedule(p, m)
            out.append({_plain(r): [tuple(_plain(x) for x in a) for a in acts] for r, acts in actions.items()})
        except Exception as exc:
            raise NotYet(f"schedule({p}, {m}) failed: {type(exc).__name__}: {exc}")
    return out


def check(path: Path) -> str:
    """1F1B: every action once, no deadlock, at most p - r held on stage r, GPipe's idle time."""
    import pipeline
    from check_exercise import NotYet, answer

    for (p, m), actions in zip(CASES, answer(path, _schedules), strict=True):  # run there, judged here
        where = f"with p={p} ranks and m={m} micro-batches"
        if sorted(actions) != list(range(p)):
            raise NotYet(f"{where}, schedule must return one list per rank 0..{p - 1}, got ranks {sorted(actions)}")
        for r, acts in actions.items():
            want = sorted((r, kind, i) for kind in "BF" for i in range(m))
            if sorted(tuple(a) for a in acts) != want:
                raise NotYet(f"{where}, rank {r} must run each of its stage's {m} forwards and {m} "
                             f"backwards exactly once, as (stage, 'F' or 'B', micro-batch); got {list(acts)[:8]}...")
            held, peak = 0, 0
            for _, kind, i in acts:
                if kind == "B" and (r, "F", i) not in [tuple(a) for a in acts[:acts.index((r, kind, i))]]:
                    raise NotYet(f"{where}, rank {r} runs the backward of micro-batch {i} before its forward")
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            if peak > min(p - r, m):
                raise NotYet(f"{where}, stage {r} holds {peak} micro-batches at once; 1F1B holds at most "
                             f"{min(p - r, m)} there (p - r). Start backwards sooner: that is the 1B in 1F1B")
        try:
            tl = pipeline.timeline({r: [tuple(a) for a in acts] for r, acts in actions.items()})
        except RuntimeError:
            raise NotYet(f"{where}, the ranks wait on each other forever: a backward is scheduled "
                         f"before the forward it needs can have reached the last stage")
        idle, want = pipeline.idle_fraction(tl), pipeline.bubble_formula(p, m)
        if abs(idle - want) > 1e-9:
            raise NotYet(f"{where}, the ranks are idle {idle:.1%} of the time; 1F1B's bubble is "
                         f"(p-1)/(m+p-1) = {want:.1%}: a rank waits where it could already work")
    return (f"1F1B for {len(CASES)} shapes: stage r holds at most p - r micro-batches, the idle time "
            f"is (p-1)/(m+p-1), as GPipe's")
