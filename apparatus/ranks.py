"""Start N ranks in a gloo group and get back what each one returns: how the exercise checks,
the benchmarks and the tests start ranks (common/processes.py's start_ranks, the one way
the package starts ranks, plus a process group; the lessons' spawn is start_ranks too).

    from apparatus.ranks import RankFailed, run_ranks
    results = run_ranks(target, 3, (arg,))   # target(rank, 3, arg) in 3 new processes

* Each rank is a process forked from a fork server that has imported torch once, in a gloo
  group (`backend=None`: the target joins one itself) whose store listens on 127.0.0.1 only
  (common.distributed.env_store, on a free port), with a timeout on every collective
  (`group_timeout_s`) and on the whole run (`timeout_s`).
* It returns every rank's return value, by rank, or raises RankFailed for the first rank that
  raised, died or did not finish in time; the other ranks are stopped at once.
* Nothing is left behind: the ranks die with their parent (Linux's parent-death signal),
  SIGTERM and SIGHUP stop them as Ctrl-C does, and a rank still alive at the end is killed.
"""
from __future__ import annotations

import os

from common.distributed import LOOPBACK, env_store, free_port
from common.processes import RankFailed, start_ranks  # noqa: F401  (RankFailed: for callers)

PRELOAD = ["torch", "torch.distributed", "common.recipe"]  # imported once, by the fork server


def _in_group(rank: int, world: int, port: int, backend: str | None, group_timeout_s: float,
              target, args: tuple):
    """One rank: join the group (a store on 127.0.0.1:port), then run target."""
    import datetime

    import torch.distributed as dist


    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
    if backend is not None:
        dist.init_process_group(backend, store=env_store(rank, world, group_timeout_s),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
    return target(rank, world, *args)


def run_ranks(target, world: int, args: tuple = (), *, timeout_s: float | None = 120,
              group_timeout_s: float = 20, backend: str | None = "gloo",
              threads: int | None = 1) -> list:
    """target(rank, world, *args) on `world` new processes: what each returned, by rank.

    backend: the group every rank joins before target runs (None: target joins one itself,
    MASTER_ADDR and MASTER_PORT are set for common.distributed.env_store). timeout_s: the
    whole run, start-up included (None: no limit; every collective still has
    group_timeout_s). threads: torch threads per rank (None: torch's default).
    Raises RankFailed (see common/processes.py); KeyboardInterrupt (also for SIGTERM and
    SIGHUP, as common.processes.Stopped) after stopping every rank.
    """
    return start_ranks(_in_group, world, (free_port(), backend, group_timeout_s, target, args),
                       timeout_s=timeout_s, threads=threads, preload=PRELOAD)
