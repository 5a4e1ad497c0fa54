"""Starting ranks, and nobody outliving the job: the process plumbing behind the lessons'
spawn and run_ranks (common/distributed.py: the lessons; the checks, bench/ and the tests)
and tools/nodes.py. No lesson's idea (lesson 05 teaches mp.spawn itself), so the
lessons call it through spawn.

* `start_ranks`: the one way the package starts N ranks and gets back what each returns,
  or RankFailed naming the first rank that failed (the others are stopped at once).
  With a terminal on stdin, rank 0 asks on it in step mode (share_terminal_with_children).
* `die_with_parent`: call first thing in a rank; if its parent is killed, even with SIGKILL,
  the kernel kills the rank too (Linux's parent-death signal). `die_with_make`: the same for
  a launcher that `make lesson-NN` started.
* `supervise`: around starting ranks, Ctrl-C, SIGTERM and SIGHUP stop every rank *first*,
  then one line is printed and the job exits (130, 143, 129).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time

import torch.multiprocessing as mp

from common import fail

PARENT_ENV = "LESSON_PARENT_PID"  # set by supervise(): the pid a spawned rank must outlive
TIDY_ENV = "LESSON_FORK_SERVER_TIDY"  # set for the fork server only (common/fork_server_exit.py)


def set_parent_death_signal(sig: int = getattr(signal, "SIGKILL", 9)) -> None:
    """Linux: the kernel sends `sig` to this process when its parent dies. Nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def leave_fork_server() -> None:
    """In a process started by multiprocessing's fork server: close our copy of the pipe end
    that keeps the server alive. The server exits when the job's own process does (its end
    of that pipe closes), and our parent-death signal then takes us along; holding a copy,
    we would keep the server, and the server us, alive after the job was killed (measured:
    without this, SIGKILL left the ranks). Does nothing in any other process."""
    from multiprocessing import forkserver
    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def die_with_parent() -> None:
    """Call first thing in a rank: if its parent (the job's process, the fork server it
    started, torchrun's agent) is killed, even with SIGKILL, the kernel kills this rank
    too, so it never trains on alone and writes files after its job has been stopped."""
    set_parent_death_signal()
    leave_fork_server()
    expected = os.environ.get(PARENT_ENV)
    # the job may have ended before prctl took effect: then we are an orphan already
    if os.getppid() == 1 or (expected and expected.isdigit() and mp.parent_process() is not None
                             and not _alive(int(expected))):
        os._exit(1)


MAKE_PID_ENV = "LESSON_MAKE_PID"  # set by the Makefile's lesson-% rule: make's own pid


def die_with_make() -> None:
    """Call first thing in a launcher (common.cli.run, tools/nodes.py). Started by `make
    lesson-NN`, whose recipe execs the Python (so make is its parent): if make is killed, even
    with SIGKILL, the kernel kills the launcher too, and its ranks die with it. The variable is
    taken out of the environment: the ranks and agents have parents of their own."""
    pid = os.environ.pop(MAKE_PID_ENV, None)
    if not pid or not pid.isdigit():
        return
    set_parent_death_signal()
    if os.getppid() != int(pid):  # make was killed while we started: it cannot signal us now
        os._exit(1)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into an exception like Ctrl-C's, so cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals():
    """Inside: SIGTERM and SIGHUP raise Stopped (a KeyboardInterrupt), as Ctrl-C does."""
    old = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):  # no SIGHUP on Windows
        if sig is None:
            continue
        try:
            old[sig] = signal.signal(sig, _raise_stopped)
        except (ValueError, OSError):  # not the main thread, or no such signal here
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def error_file_whole(fn):
    """Under torchrun, put it below @record: once `fn` raises, SIGTERM is ignored while
    @record writes the worker's error file, and as the worker exits. When one worker fails,
    the agent SIGTERMs the others, and reads each failed worker's error.json; a worker cut off
    between opening that file and writing it left it empty, and the agent then died on it
    (json.JSONDecodeError in ProcessFailure, torch 2.14.1) instead of restarting the group.
    A worker that hangs on its way out still ends: the agent follows with SIGKILL.
    Only an Exception, which @record writes down: SystemExit (--help, a bad flag) and Ctrl-C
    change nothing (--help once left a test process deaf to SIGTERM, and every Python it
    started after, which inherits what is ignored)."""
    import functools

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            with contextlib.suppress(ValueError):  # (not the main thread: leave it)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise
    return guarded


def signal_name(exc: KeyboardInterrupt) -> tuple[str, int]:
    """('Ctrl-C', 130) or ('SIGTERM', 143) ...: what stopped us, and the exit code for it."""
    if isinstance(exc, Stopped):
        return signal.Signals(exc.signum).name, 128 + exc.signum
    return "Ctrl-C", 130


def stop_processes(procs, grace: float = 3.0) -> None:
    """SIGTERM each process, wait up to `grace` seconds in all, then SIGKILL the rest."""
    procs = [p for p in procs if p.is_alive()]
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(timeout=5)


@contextlib.contextmanager
def supervise():
    """Around mp.spawn or start_ranks: Ctrl-C, SIGTERM and SIGHUP stop every rank *first*,
    then print one line and exit (130, 143, 129). With die_with_parent() in each rank, a
    parent killed with SIGKILL takes its ranks along too."""
    os.environ[PARENT_ENV] = str(os.getpid())
    with stop_signals():
        try:
            yield
        except KeyboardInterrupt as exc:
            stop_processes(mp.active_children())
            restore_terminal(end_line=True)
            name, code = signal_name(exc)
            fail(f"interrupted ({name}): every rank was stopped; nothing was saved for this run",
                 code=code)


def restore_terminal(end_line: bool = False) -> None:
    """Show the cursor again: a rank killed while rich drew its progress bar leaves it hidden
    (and, with end_line, the bar's line unfinished: start the next message on a new line)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream.isatty():
                stream.write("\x1b[?25h" + ("\n" if end_line else ""))
                stream.flush()
                return


def share_terminal_with_children() -> None:
    """Call in a parent before starting ranks, so that rank 0 can ask on the same terminal
    (start_ranks calls it; lesson 05 calls it itself before mp.spawn).

    Rank 0 switches the terminal to one-key (cbreak) mode while it waits, and switches it
    back; if it is killed meanwhile (a launcher stopping every rank), this parent restores
    the terminal's settings when it exits, so the learner's shell still echoes.
    """
    if sys.stdin is not None and sys.stdin.isatty():
        os.environ["LESSON_STEP_TTY"] = os.ttyname(sys.stdin.fileno())
        try:
            import termios
            fd = sys.stdin.fileno()
            atexit.register(termios.tcsetattr, fd, termios.TCSANOW, termios.tcgetattr(fd))
        except Exception:  # no termios (not POSIX), or not a real terminal: nothing to keep
            pass


class RankFailed(Exception):
    """A rank of start_ranks() failed. kind: "raised" (error: the exception's type name, text:
    its message, frames: (file, line) of its traceback, code: a SystemExit's code), "died"
    (code: the exit code, negative for a signal), "stopped" (pid: a rank that SIGSTOP or
    Ctrl-Z stopped, found when another gave up waiting for it) or "timeout" (no rank failed,
    but the run did not end within `seconds`)."""

    def __init__(self, kind: str, rank: int | None, world: int, error: str = "", text: str = "",
                 frames: tuple = (), code: int | None = None, seconds: float | None = None,
                 pid: int | None = None):
        self.kind, self.rank, self.world, self.error, self.text = kind, rank, world, error, text
        self.frames, self.code, self.seconds, self.pid = frames, code, seconds, pid
        if kind == "stopped":
            message = (f"rank {rank} (pid {pid}) was stopped (SIGSTOP, or Ctrl-Z) and did not answer: "
                       f"the others gave up waiting for it")
        elif kind == "timeout":
            message = f"the {world} ranks did not finish within {seconds:g}s"
        elif kind == "died":
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            message = f"rank {rank} died ({how}) without an error message"
        elif error == "SystemExit":
            message = f"rank {rank} exited with code {code}"
        else:
            message = f"rank {rank} failed with {error}: {' '.join(text.split())[:300]}"
        super().__init__(message)


def _rank_main(rank: int, world: int, environ: dict, target, args: tuple,
               threads: int | None, results) -> None:
    """One rank: run target(rank, world, *args) and send back what it returned (or raised)."""
    os.environ.clear()
    os.environ.update(environ)  # the job's environment now, not the fork server's at its start
    die_with_parent()  # our parent (the fork server, or the job's process) dies: so do we
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored Ctrl-C
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        # forked from the job's own process: its stop_signals() handler came along; a rank
        # ends on SIGTERM as any process does
        if sig is not None and signal.getsignal(sig) is _raise_stopped:
            signal.signal(sig, signal.SIG_DFL)
    import faulthandler
    import gc
    import io

    # A crash in C++ (SIGSEGV, SIGABRT: "munmap_chunk(): invalid pointer" once in lesson 16
    # on CI) prints where each of this rank's threads was in Python, before the one line the
    # job prints ("rank 1 died (SIGABRT)"): without it nothing says which call it was.
    faulthandler.enable(all_threads=True)
    import traceback

    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)  # several ranks share few cores: one thread each

    def report(kind: str, payload) -> None:
        results.send((rank, kind, payload))  # returns once the parent has it all (a pipe)
        results.close()

    try:
        try:
            value = target(rank, world, *args)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
            value = None  # sys.exit(0): done, as for any process
    except BaseException as exc:  # noqa: BLE001 - reported, with where it was raised
        frames = tuple((f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__))
        code = exc.code if isinstance(exc, SystemExit) else None
        report("raised", (type(exc).__name__, str(exc), frames,
                          code if code is None or isinstance(code, int) else 1))
        # End here: no interpreter teardown, no destroy_process_group. Another rank may be
        # stuck in a collective with us, and gloo can abort at exit from a timed-out one
        # ("terminate called without an active exception", torch 2.14.1).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    report("ok", buffer.getvalue())
    del value
    gc.collect()  # free anything (a DDP reducer) that still holds the group, then leave
    if dist.is_initialized():
        dist.destroy_process_group()


_FORKABLE: list = []  # [threads, variables read at start-up] when this process said it may fork
# Variables that a process reads as it starts (Python, the loader, malloc), or torch as it is
# imported: a rank forked from this process keeps what they were then (lesson 12's
# TORCH_DISTRIBUTED_DEBUG=DETAIL, set for its ranks, did nothing in ranks forked from it), so a
# change sends the ranks to a fork server. tests/zygote.py forks commands by the same list.
READ_AT_START = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP", "CUDA", "NCCL", "LD_",
                 "MALLOC")


def _read_at_start() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(READ_AT_START)}


def forkable_from_here() -> None:
    """Say, once the imports are done, that this process may fork its ranks itself (start_ranks)
    for as long as it starts no thread: a lesson's own process (common.cli.run, before main())
    and an exercise check's answer say so. Linux only (it counts /proc/self/task)."""
    with contextlib.suppress(OSError):
        _FORKABLE[:] = [len(os.listdir("/proc/self/task")), _read_at_start()]


_GPU_DRIVERS = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's, AMD's (ROCm)


def _may_fork_here() -> bool:
    """True while this process has said forkable_from_here() and has started no thread since,
    and not changed a variable of READ_AT_START; never on a machine with a GPU driver. A thread
    more may be one of OpenMP's: GNU OpenMP's threads do not survive a fork, and the child's
    first parallel operation then waits forever (measured with torch 2.14.1: a 2-thread matmul,
    a fork, an exp() in the child). CUDA does not survive a fork either, and merely asking
    torch.cuda.is_available() (lesson 05's plan_device does) "poisons fork" (its docstring,
    torch 2.14.1): with a GPU, the ranks come from the fork server, as they always did."""
    if not _FORKABLE or any(os.path.exists(driver) for driver in _GPU_DRIVERS):
        return False
    try:
        return len(os.listdir("/proc/self/task")) <= _FORKABLE[0] and _read_at_start() == _FORKABLE[1]
    except OSError:
        return False


_FORK_SERVER_STOP: list = []  # the atexit handler below, once registered


def _start_fork_server_deaf_to_ctrl_c() -> None:
    """Start the fork server, if it is not running, with SIGINT ignored. A Ctrl-C reaches
    every process of the terminal's group; the server ignores SIGINT itself only once its
    preloads are imported, so one typed during its first seconds printed a KeyboardInterrupt
    traceback after our one line. This process stops the ranks itself (supervise); each
    rank takes Python's usual SIGINT handler back (_rank_main)."""
    import tempfile
    from multiprocessing import forkserver, util

    # Its socket lives in $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a Unix socket's path
    # has at most 107 bytes: under a deep $TMPDIR, Python 3.11 failed with "AF_UNIX path too
    # long". Then this process's temporary files go to /tmp (removed at exit, as always).
    if len(os.fsencode(tempfile.gettempdir())) > 70 and os.path.isdir("/tmp"):
        tempfile.tempdir = "/tmp"
    # For the new server only: the folder that common/fork_server_exit.py removes, and where
    # to find it. (Python 3.11's server ignores the sys.path it is handed, and "__main__" in
    # its preloads: it starts with the job's working directory as its only path to us.)
    saved = {name: os.environ.get(name) for name in (TIDY_ENV, "PYTHONPATH")}
    os.environ[TIDY_ENV] = util.get_temp_dir()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    saved["PYTHONPATH"]) if p)
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the new server
    except ValueError:  # not the main thread: leave it as it is
        old = None
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if old is not None:
            signal.signal(signal.SIGINT, old)


def _stop_fork_server() -> None:
    """At exit: end the fork server now. It ends by itself when this process's end of its pipe
    closes, but only once it has finished importing its preloads (torch, the lesson): after a
    `q` at the first pause, or an early error, that kept it alive for 4-11 s after the job."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # private: no public handle
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
            os.waitpid(pid, 0)


def _stopped(procs) -> int | None:
    """The first rank whose process is stopped (SIGSTOP, Ctrl-Z: Linux's /proc/PID/stat state
    T). It is alive and silent, so its peers time out and the first of them to say so would
    otherwise take the blame."""
    for r, p in enumerate(procs):
        with contextlib.suppress(OSError, ValueError, IndexError, TypeError):
            with open(f"/proc/{p.pid}/stat") as f:
                text = f.read()
            if text[text.rindex(")") + 2:].split()[0] in ("T", "t"):
                return r
    return None


def _silent_death(procs, results, spoke: set, wait_s: float = 1.0) -> int | None:
    """The first rank that ended with no word (killed, or exited non-zero without reporting),
    looking for up to wait_s: the fork server hands on a rank's exit status a moment late."""
    deadline = time.monotonic() + wait_s
    while True:
        for conn in list(results):  # other ranks' errors, already sent: they spoke, not silent
            with contextlib.suppress(OSError, EOFError):
                if conn.poll():
                    spoke.add(conn.recv()[0])
        silent = [r for r, p in enumerate(procs)
                  if r not in spoke and p.exitcode is not None and p.exitcode != 0]
        if silent:
            return min(silent, key=lambda r: (procs[r].exitcode >= 0, r))  # a signal first
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def start_ranks(target, world: int, args: tuple = (), *, timeout_s: float | None = None,
                threads: int | None = None, preload: list[str] | None = None) -> list:
    """target(rank, world, *args) on `world` new processes: what each returned, by rank.

    Each rank is forked, so it does not import torch again, as each of mp.spawn's fresh
    Pythons does. From this very process when it may be (forkable_from_here: a lesson's own
    process, or an exercise check's answer, that has started no thread since its imports),
    with `preload` and torch._dynamo imported here first. Otherwise from multiprocessing's
    "fork server", a fresh Python that imports `preload` once (about 2.5 s of CPU more): a
    process that has started OpenMP's threads or used CUDA cannot be forked safely.
    ("__main__", the job's script, is a no-op in the server on Python 3.11: it is handed the
    script's path under a key it does not read; each rank imports it. "spawn" where there is
    no fork server.) Each rank gets this process's environment as it is now.

    Values go back with torch.save and torch.load(weights_only=True): tensors, numbers,
    strings, lists, dicts, None. A rank that ends itself with exit code 0 (os._exit(0), as
    step mode's "q" does) returns None. timeout_s: the whole run (None: no limit).
    threads: torch threads per rank (None: torch's default). Raises RankFailed for the first
    rank that raised, died or did not finish in time, after stopping the others (they may be
    waiting for it); KeyboardInterrupt (also for SIGTERM and SIGHUP, as Stopped) after
    stopping every rank. A rank still alive when the run ends, well or not, is killed.
    """
    import io
    import multiprocessing
    from multiprocessing.connection import wait

    import torch

    fork_here = _may_fork_here()
    if fork_here:
        # What the server would have imported, imported here once: each rank has it then.
        import gc
        import importlib

        gc.disable()  # as the server does (common/fork_server_start.py, fork_server_exit.py):
        try:  # no collection during the imports; what exists now is never scanned again,
            # here or in a rank (this process's own objects too: a cycle of them stays)
            for name in ["torch._dynamo", *(preload or [])]:
                importlib.import_module(name)
        finally:
            gc.freeze()
            gc.enable()
        ctx = multiprocessing.get_context("fork")
    elif "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Preloads take effect only when this process's server starts. torch._dynamo is one:
        # the first DDP, FSDP, DTensor or pipeline in a process imports it (torch 2.14.1:
        # DistributedDataParallel.__init__ asks it for its optimize_ddp mode), about 1.5 s
        # of CPU that each rank would otherwise spend on its own.
        # First: common/fork_server_start.py, which turns the garbage collector off for the
        # imports (a third of the server's start). Last: common/fork_server_exit.py, which
        # turns it back on, and whose exit handler runs first when the server ends.
        ctx.set_forkserver_preload(["common.fork_server_start", "torch._dynamo", *(preload or []),
                                    "common.fork_server_exit"])
        if not _FORK_SERVER_STOP:
            _FORK_SERVER_STOP.append(atexit.register(_stop_fork_server))
        _start_fork_server_deaf_to_ctrl_c()
    else:
        ctx = multiprocessing.get_context("spawn")  # as mp.spawn does
    share_terminal_with_children()  # --step: rank 0 asks on our terminal, in every lesson
    environ = dict(os.environ)
    results: list = []  # what each rank sends back, by rank
    procs: list = []
    got: dict = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    quiet_since = None
    with stop_signals():
        try:
            for r in range(world):
                # One pipe per rank for its one message back (what it returned, or raised): a
                # pipe, not a multiprocessing Queue, whose locks are named semaphores that
                # outlive a killed job ("There appear to be 1 leaked semaphore objects" after
                # the shell's prompt). Made as its rank starts: a rank forked from here holds
                # no copy of another rank's end, which would keep that pipe open.
                reader, writer = ctx.Pipe(duplex=False)
                results.append(reader)
                procs.append(ctx.Process(target=_rank_main, daemon=True,
                                         args=(r, world, environ, target, args, threads, writer)))
                procs[r].start()
                writer.close()  # the rank has its own copy: the pipe ends when the rank does
            while len(got) < world:
                message = None
                for conn in wait(results, timeout=0.5):
                    try:
                        message = conn.recv()
                        break
                    except (EOFError, OSError):  # the rank ended without a word: see below
                        results.remove(conn)
                if message is not None:
                    rank, kind, payload = message
                    quiet_since = None
                else:
                    if deadline is not None and time.monotonic() > deadline:
                        stopped = _stopped(procs)
                        if stopped is not None:
                            raise RankFailed("stopped", stopped, world, pid=procs[stopped].pid)
                        raise RankFailed("timeout", None, world, seconds=timeout_s)
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode is not None and r not in got]
                    if dead:  # give a message still in the pipe a moment to arrive
                        quiet_since = quiet_since or time.monotonic()
                        failed = [r for r in dead if procs[r].exitcode != 0]
                        if time.monotonic() - quiet_since > 0.4:  # one more wait() has come back empty
                            if failed:
                                raise RankFailed("died", failed[0], world,
                                                 code=procs[failed[0]].exitcode)
                            got.update({r: None for r in dead})  # ended itself, quietly
                    continue
                if kind != "ok":
                    error, text, frames, code = payload
                    # A rank killed in a collective says nothing, and its peers then fail
                    # ("Connection reset by peer") and say so first: blame the silent dead.
                    dead = _silent_death(procs, results, spoke={*got, rank})
                    if dead is not None:
                        raise RankFailed("died", dead, world, code=procs[dead].exitcode)
                    stopped = _stopped(procs)  # alive, silent: the one they waited for
                    if stopped is not None:
                        raise RankFailed("stopped", stopped, world, pid=procs[stopped].pid)
                    raise RankFailed("raised", rank, world, error, text, frames, code)
                got[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        finally:
            finished = len(got) == world
            # Each rank's exit status, not join(timeout): for a rank forked from here, that
            # waits on a pipe which a process the rank started and left running also holds
            # (a learner's file that forks as it is imported: each join waited its whole 15 s).
            ends = time.monotonic() + (15 if finished else 0.1)
            for p in procs:
                if p.pid is None:  # never started
                    continue
                while p.exitcode is None and time.monotonic() < ends:
                    time.sleep(0.01)
                if p.exitcode is None:
                    p.kill()
                    p.join()
    return [got[r] for r in range(world)]
