"""Process-group plumbing that lessons 05 and 06 first write out by hand.

* `host_store` / `env_store`: the rendezvous store, listening on one address only (a
  TCPStore master listens on every interface whatever host you give it, torch 2.14.1, so we
  bind the socket ourselves and hand it over with `master_listen_fd`); with a loopback
  store, gloo's own listeners stay on loopback too (`keep_gloo_on_loopback`).
* `init_from_env`: `dist.init_process_group` with a timeout, from torchrun's RANK/WORLD_SIZE.
* `spawn`: mp.spawn's job, forked from a fork server; a failing rank's error in one line.
* `teardown`: gc.collect() before destroy_process_group(); see its docstring.
"""
from __future__ import annotations

import datetime
import errno
import gc
import ipaddress
import os
import signal
import socket

import torch.distributed as dist

from common import fail
from common.processes import RankFailed, die_with_parent, start_ranks, supervise  # noqa: F401

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """Ask the OS for a port nobody listens on (bind to port 0, read what we got)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def busy_port_message(port: int, host: str = LOOPBACK) -> str:
    return (f"port {port} on {host} is already in use (another job, or a run that has "
            f"not exited yet); pass another --master-port, or leave it out to pick a free one")


def ensure_port_free(port: int, host: str = LOOPBACK) -> None:
    """Fail with one clear line if something already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, as the store itself uses: a port left in TIME_WAIT is not "busy"
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            fail(busy_port_message(port, host))


def choose_port(requested: int | None) -> int:
    if requested is None:
        return free_port()
    ensure_port_free(requested)
    return requested


def master_address(requested_port: int | None) -> tuple[str, int]:
    """Where a single-machine job's store listens: (address, port; 0 = pick a free one).

    --master-port wins; else MASTER_ADDR / MASTER_PORT from the environment, as PyTorch's
    own docs teach; else 127.0.0.1 and a free port.
    """
    addr = os.environ.get("MASTER_ADDR") or LOOPBACK
    if requested_port is not None:
        return addr, requested_port
    text = os.environ.get("MASTER_PORT")
    if not text:
        return addr, 0
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        fail(f"MASTER_PORT={text!r} in the environment is not a port number (1-65535); "
             f"unset it or pass --master-port")
    return addr, int(text)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port only, or one clear line if that cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as exc:
        fail(f"cannot resolve the store address {host!r} ({exc.strerror or exc}); "
             f"check MASTER_ADDR / --master-addr")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            fail(busy_port_message(port, host))
        fail(f"cannot listen on {host}:{port} ({exc.strerror or exc}); check MASTER_ADDR, "
             f"which must be an address of this machine")
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def keep_gloo_on_loopback(host: str) -> None:
    """A job whose store is on loopback runs on one machine: keep gloo's own sockets there too.

    Each gloo rank opens a listener of its own, beside the store, on the address this
    machine's hostname resolves to (torch 2.14.1 ProcessGroupGloo's default device). On
    cloud VMs and in containers that is a real network address, so a one-machine job would
    accept connections from the network. GLOO_SOCKET_IFNAME names the interface instead:
    the loopback one. Set by whoever hosts or joins a loopback store, before the process
    group exists; a value you set yourself wins.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME") or not is_loopback(host):
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]  # lo, lo0
    if names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]


def host_store(host: str, port: int, timeout_s: float, world_size: int | None = None):
    """Start a TCPStore server that listens on host:port only; returns (store, port).

    port 0 asks the OS for a free one. The store owns the socket from here on and closes
    it when it is deleted. use_libuv=False: the libuv server does not take a socket it did
    not open itself (with libuv it hung, measured on torch 2.14.1).
    """
    keep_gloo_on_loopback(host)  # and the ranks this process starts afterwards
    sock = listen_socket(host, port)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, world_size, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=False)
    return store, port


def _agent_serves(addr: str, port: int) -> bool:
    """torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT (the same test
    torch/distributed/rendezvous.py makes): then every rank is a client."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("MASTER_ADDR") == addr and os.environ.get("MASTER_PORT") == str(port))


def env_store(rank: int, world_size: int, timeout_s: float):
    """The store that init_method="env://" would make, but listening on MASTER_ADDR only.

    Rank 0 hosts it at MASTER_ADDR:MASTER_PORT (unless torchrun's agent already does); the
    other ranks connect to it. Pass the result to init_process_group(store=...).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    keep_gloo_on_loopback(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0 and not _agent_serves(addr, port):
        store, _ = host_store(addr, port, timeout_s, world_size)
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    # the agent's store outlives restarts: keep each attempt's keys apart
    return dist.PrefixStore(f"lesson/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                            store)


def init_from_env(backend: str, timeout_s: float, device=None) -> tuple[int, int]:
    """Join the process group described by the environment; returns (rank, world_size).

    Under plain `python` there is no torchrun to set MASTER_ADDR/MASTER_PORT, so we make
    a world of one on a free local port. The store listens on MASTER_ADDR only (env_store).
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = LOOPBACK
        os.environ["MASTER_PORT"] = str(free_port())
    kwargs = {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device  # lets NCCL set up its communicator eagerly
    try:
        store = env_store(rank, world_size, timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
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


def _lesson_rank(rank: int, world: int, fn, args: tuple) -> None:
    fn(rank, *args)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """mp.spawn(fn, args, nprocs, join=True), through common/processes.py's start_ranks:
    each rank is forked from this process, which has imported torch already (from a fork
    server that imports it once, if this process has started threads since), where mp.spawn
    starts a fresh Python per rank, which imports torch again. A failing rank stops the
    others, and the job ends with one short line. supervise(): Ctrl-C stops every rank."""
    try:
        with supervise():
            start_ranks(_lesson_rank, nprocs, (fn, args), preload=["__main__"])
    except RankFailed as exc:
        code, left = exc.code, "the other ranks were stopped"
        if exc.kind == "stopped":  # alive but silent: its peers' timeouts are its doing
            fail(f"{exc}; every rank was ended", code=1)
        if exc.error == "SystemExit" or (exc.kind == "died" and code in (1, 2)):
            # it printed its own one-line error (common.fail) and left
            fail(f"rank {exc.rank} exited with code {code}; {left}",
                 code=code if code in (1, 2) else 1)
        if exc.kind == "raised":  # the last line of its traceback, as Python would print it
            last = f"{exc.error}: {exc.text}".strip().splitlines()[-1] if exc.text else exc.error
            fail(f"rank {exc.rank} failed with {last}; {left}", code=1)
        how = signal.Signals(-code).name if (code or 0) < 0 else f"exit code {code}"
        fail(f"rank {exc.rank} died ({how}); {left}", code=1)


RUN_RANKS_PRELOAD = ["torch", "torch.distributed", "common.recipe"]  # imported once, by the fork server


def _rank_in_group(rank: int, world: int, port: int, backend: str | None, group_timeout_s: float,
                   target, args: tuple):
    """One rank of run_ranks: join the group (a store on 127.0.0.1:port), then run target."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
    if backend is not None:
        dist.init_process_group(backend, store=env_store(rank, world, group_timeout_s),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
    return target(rank, world, *args)


def run_ranks(target, world: int, args: tuple = (), *, timeout_s: float | None = 120,
              group_timeout_s: float = 20, backend: str | None = "gloo",
              threads: int | None = 1) -> list:
    """target(rank, world, *args) on `world` new processes in a gloo group: what each returned,
    by rank. How the exercise checks, bench/ and the tests start ranks (the lessons use spawn,
    above; both are start_ranks underneath).

    Each rank joins a group whose store listens on 127.0.0.1 only, on a free port (backend
    None: target joins one itself; MASTER_ADDR and MASTER_PORT are set for env_store), with
    a timeout on every collective (group_timeout_s) and on the whole run, start-up included
    (timeout_s; None: no limit). threads: torch threads per rank (None: torch's default).
    Raises RankFailed for the first rank that raised, died or did not finish in time, after
    stopping the others; KeyboardInterrupt (also for SIGTERM and SIGHUP) after stopping every
    rank. The ranks die with their parent, and a rank still alive at the end is killed.
    """
    return start_ranks(_rank_in_group, world, (free_port(), backend, group_timeout_s, target, args),
                       timeout_s=timeout_s, threads=threads, preload=RUN_RANKS_PRELOAD)


def say_each(ui, message: str) -> None:
    """Every rank's line, printed by rank 0 in rank order, each under `[rank N]`.

    A barrier does not order the output of separate processes (each has its own buffers),
    so rank 1's line could land above rank 0's heading; gathering the text to rank 0 can't.
    """
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, message)
    from rich.markup import escape

    for rank, text in enumerate(lines):
        prefix = f"[cyan]{escape(f'[rank {rank}]')}[/cyan] " if len(lines) > 1 else ""
        ui.print(prefix + text)
