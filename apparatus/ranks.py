"""Start N ranks and get back what each one returns: the one way the exercise checks, the
benchmarks and the tests start ranks (the lessons use common.distributed.spawn, mp.spawn,
because lesson 05 teaches it).

    from apparatus.ranks import RankFailed, run_ranks
    results = run_ranks(target, 3, (arg,))   # target(rank, 3, arg) in 3 new processes

* Each rank is a fresh process in a gloo group (`backend=None`: the target joins one itself)
  whose store listens on 127.0.0.1 only (common.distributed.env_store, on a free port), with
  a timeout on every collective (`group_timeout_s`) and on the whole run (`timeout_s`).
* It returns every rank's return value, by rank (sent back with torch.save and read with
  torch.load(weights_only=True): tensors, numbers, strings, lists, dicts, None).
* Or it raises RankFailed for the first rank that raised, died or did not finish in time;
  the other ranks are stopped at once (they may be waiting for it).
* Nothing is left behind: the ranks die with their parent (Linux's parent-death signal, as
  apparatus/processes.py's die_with_parent), SIGTERM and SIGHUP stop them as Ctrl-C does, and
  a rank still alive when the run ends, well or not, is killed.

Where it can, the ranks are forked from a server process that has imported torch once
(multiprocessing's "forkserver"), so starting a rank does not import torch again.
"""
from __future__ import annotations

import io
import os
import time

from apparatus.processes import leave_fork_server, set_parent_death_signal, stop_signals

PRELOAD = ["torch", "torch.distributed", "common.recipe"]  # imported once, by the fork server


class RankFailed(Exception):
    """A rank of run_ranks() failed. kind: "raised" (error: the exception's type name, text:
    its message, frames: (file, line) of its traceback, code: a SystemExit's code), "died"
    (code: the exit code, negative for a signal) or "timeout" (no rank failed, but the run
    did not end within `seconds`)."""

    def __init__(self, kind: str, rank: int | None, world: int, error: str = "", text: str = "",
                 frames: tuple = (), code: int | None = None, seconds: float | None = None):
        self.kind, self.rank, self.world, self.error, self.text = kind, rank, world, error, text
        self.frames, self.code, self.seconds = frames, code, seconds
        if kind == "timeout":
            message = f"the {world} ranks did not finish within {seconds:g}s"
        elif kind == "died":
            message = f"rank {rank} died (exit code {code}) without an error message"
        elif error == "SystemExit":
            message = f"rank {rank} exited with code {code}"
        else:
            message = f"rank {rank} failed with {error}: {' '.join(text.split())[:300]}"
        super().__init__(message)


def _rank_main(rank: int, world: int, port: int, target, args: tuple, backend: str | None,
               group_timeout_s: float, threads: int | None, results) -> None:
    """One rank: join the group, run target(rank, world, *args), report, leave."""
    leave_fork_server()
    set_parent_death_signal()  # our parent (the fork server, or run_ranks' process) dies: so do we
    if os.getppid() == 1:      # it died before that took effect
        os._exit(1)
    import datetime
    import gc
    import traceback

    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)  # several ranks share few cores: one thread each

    def report(kind: str, payload) -> None:
        results.put((rank, kind, payload))
        results.close()
        results.join_thread()  # the message is in the pipe before this process may end

    try:
        from common.distributed import LOOPBACK, env_store

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
        if backend is not None:
            dist.init_process_group(backend, store=env_store(rank, world, group_timeout_s),
                                    rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=group_timeout_s))
        value = target(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - reported, with where it was raised
        frames = tuple((f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__))
        code = exc.code if isinstance(exc, SystemExit) else None
        report("raised", (type(exc).__name__, str(exc), frames,
                          code if code is None or isinstance(code, int) else 1))
        os._exit(1)  # no destroy_process_group after a failure: the others may be stuck
    buffer = io.BytesIO()
    torch.save(value, buffer)
    report("ok", buffer.getvalue())
    del value
    gc.collect()  # free anything (a DDP reducer) that still holds the group, then leave
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(target, world: int, args: tuple = (), *, timeout_s: float | None = 120,
              group_timeout_s: float = 20, backend: str | None = "gloo",
              threads: int | None = 1) -> list:
    """target(rank, world, *args) on `world` new processes: what each returned, by rank.

    backend: the group every rank joins before target runs (None: target joins one itself,
    MASTER_ADDR and MASTER_PORT are set for common.distributed.env_store). timeout_s: the
    whole run, start-up included (None: no limit; every collective still has
    group_timeout_s). threads: torch threads per rank (None: torch's default).
    Raises RankFailed (see there); KeyboardInterrupt (also for SIGTERM and SIGHUP, as
    apparatus.processes.Stopped) after stopping every rank.
    """
    import multiprocessing
    import queue

    import torch

    from common.distributed import free_port

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    else:
        ctx = multiprocessing.get_context("spawn")  # as mp.spawn does
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, target, args, backend, group_timeout_s, threads,
                               results))
             for r in range(world)]
    got: dict = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    quiet_since = None
    with stop_signals():
        try:
            for p in procs:
                p.start()
            while len(got) < world:
                try:
                    rank, kind, payload = results.get(timeout=0.5)
                    quiet_since = None
                except queue.Empty:
                    if deadline is not None and time.monotonic() > deadline:
                        raise RankFailed("timeout", None, world, seconds=timeout_s)
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode is not None and r not in got]
                    if dead:  # give a message still in the pipe a moment to arrive
                        quiet_since = quiet_since or time.monotonic()
                        if time.monotonic() - quiet_since > 3:
                            raise RankFailed("died", dead[0], world, code=procs[dead[0]].exitcode)
                    continue
                if kind != "ok":
                    error, text, frames, code = payload
                    raise RankFailed("raised", rank, world, error, text, frames, code)
                got[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        finally:
            finished = len(got) == world
            for p in procs:
                if p.pid is None:  # never started
                    continue
                p.join(timeout=15 if finished else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [got[r] for r in range(world)]
