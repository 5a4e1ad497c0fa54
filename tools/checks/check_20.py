"""Check exercise 20: name the straggler from every rank's profiler trace.

Three gloo ranks run a few steps under torch.profiler, as lesson 20 profiles its training:
compute, then all-reduce. One rank (1 or 2, chosen at random) sleeps before each all-reduce.
Each rank writes its Chrome trace; the learner's slowest_rank(traces) must name that rank.
"""
from __future__ import annotations

import contextlib
import random
import tempfile
from pathlib import Path

STARTER = "exercises/20_slowest_rank.py"
STEPS, DELAY_S = 5, 0.1


def _rank_20(rank: int, world: int, folder: str, slow: int) -> str:
    """One rank: STEPS profiled steps of compute + all-reduce; the slow rank sleeps first."""
    import time

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    path = Path(folder) / f"trace_rank{rank}.json"
    x = torch.ones(1000)
    dist.all_reduce(x.clone())  # every rank has started (and set up gloo) before the profiler
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.barrier()  # absorbs the ranks' different profiler start-up times (a gloo:barrier)
        for _ in range(STEPS):
            if rank == slow:
                time.sleep(DELAY_S)  # a straggler: a slow disk, a busy core, a longer batch
            dist.all_reduce(x)
    prof.export_chrome_trace(str(path))
    return str(path)


def _slowest(module, traces: dict):
    """In the answer's process: the learner's slowest_rank on the traces (and nothing else: the
    rank that slept is known to the check alone)."""
    from check_exercise import NotYet

    if not hasattr(module, "slowest_rank"):
        raise NotYet(f"{module.__file__} has no function slowest_rank(traces)")
    try:
        answer = module.slowest_rank({rank: Path(p) for rank, p in traces.items()})
    except Exception as exc:  # noqa: BLE001 - the learner's error, in one line
        raise NotYet(f"slowest_rank raised {type(exc).__name__}: {exc}")
    with contextlib.suppress(TypeError, ValueError, RuntimeError):  # numpy's and torch's ints too
        if not isinstance(answer, bool) and hasattr(answer, "__index__"):
            return int(answer)
    return answer if isinstance(answer, (str, float, type(None))) else repr(answer)


def check(path: Path) -> str:
    """Read 3 ranks' traces and name the rank the others waited for."""
    from check_exercise import NotYet, answer, one_line, run_world

    slow = random.choice([1, 2])  # drawn here, in the check's process: the answer never sees it
    with tempfile.TemporaryDirectory() as folder:
        paths = run_world(3, _rank_20, (folder, slow), path)  # the check's own ranks
        said = answer(path, _slowest, {rank: str(p) for rank, p in enumerate(paths)})
    if said != slow or isinstance(said, bool):
        raise NotYet(f"rank {slow} slept {DELAY_S * 1000:.0f} ms before each of its {STEPS} "
                     f"all-reduces, but slowest_rank answered {one_line(repr(said), 100)}. In whose "
                     f"trace are the gloo:all_reduce events long, and why? (lesson 20, Step 8)")
    return (f"rank {slow} slept before every all-reduce and slowest_rank found it: the others "
            f"waited for it inside their all-reduces")
