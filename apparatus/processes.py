"""Nobody outlives the job: the process plumbing behind common.distributed.spawn and
tools/nodes.py (not the lessons' idea, so it lives here).

* `die_with_parent`: call first thing in a rank; if its parent is killed, even with SIGKILL,
  the kernel kills the rank too (Linux's parent-death signal).
* `supervise`: around mp.spawn, Ctrl-C, SIGTERM and SIGHUP stop every rank *first*, then
  one line is printed and the job exits (130, 143, 129).

Starting N ranks and getting their results back (the exercise checks, bench/, the tests) is
apparatus/ranks.py's run_ranks, built on these: it needs common.distributed's loopback store,
and common.distributed imports this module, so it lives in a module of its own.
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


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
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
    set_parent_death_signal(signal.SIGKILL)
    leave_fork_server()
    expected = os.environ.get(PARENT_ENV)
    # the job may have ended before prctl took effect: then we are an orphan already
    if os.getppid() == 1 or (expected and expected.isdigit() and mp.parent_process() is not None
                             and not _alive(int(expected))):
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
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _raise_stopped)
        except (ValueError, OSError):  # not the main thread, or no such signal here
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


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
    """Around mp.spawn: Ctrl-C, SIGTERM and SIGHUP stop every rank *first*, then print one
    line and exit (130, 143, 129). With die_with_parent() in each rank, a parent killed
    with SIGKILL takes its ranks along too."""
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


def _end_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


@contextlib.contextmanager
def end_early_on_error():
    """Around a rank's work under mp.spawn. If it raises, mp.spawn still sends the error to the
    parent and exits with 1, but the process then ends at the start of interpreter exit
    (atexit), before its objects are destroyed: a gloo process group left in a timed-out
    collective can otherwise abort there with "terminate called without an active exception"
    (seen in 1 of 6 runs of lesson 11's straggler, torch 2.14.1)."""
    try:
        yield
    except Exception:
        atexit.register(_end_now)
        raise
