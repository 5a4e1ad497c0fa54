"""Run `python script.py ...` for the tests without paying for a new Python each time.

A Python that imports torch spends about 3 s of CPU doing it (the CUDA build of torch 2.14.1),
and the suite runs a few hundred commands. So each test process keeps one "zygote": a Python
that has imported torch, torch.distributed, torch._dynamo and rich, and run nothing else (no
OpenMP thread, no CUDA: forking it is safe). Each command is a child forked from it that then
becomes `python script.py args` (or `python -m module args`): the command's environment,
working directory, argv and sys.path[0]; stdin /dev/null or a terminal; stdout and stderr to
files; the script run as __main__ (runpy); errors and exit as Python's own.

How a forked command differs from a new Python, so that no test depends on it:

* Every forked command has the zygote's string-hash seed (`hash("x")` is the same in each;
  a new Python draws its own).
* torch, torch.distributed, torch._dynamo and rich are imported already, and were imported
  with the zygote's environment. A command whose environment differs where Python or torch
  read it while starting (PYTHON*, TORCH*, OMP_*, CUDA*, NCCL*, LD_* ...: READ_AT_START) runs as
  a new Python instead (`usable` says which).
* It pays no start-up time: a timeout too tight for a laptop cannot show here. That is one
  reason every lesson also runs through `make`, in a new Python, in its own test.
* Its /proc/PID/cmdline and /proc/PID/environ are the zygote's.

What a command starts itself (the ranks' fork server, torchrun's agents and workers, make)
is a new Python, exactly as on a learner's machine: nothing here reaches into subprocess or
multiprocessing. tests/test_zygote.py checks the promises above.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading

UNBUFFERED = "PYTHONUNBUFFERED"  # the one that may differ: set up again in the child


def import_time_changes(env: dict, started_with: dict) -> set[str]:
    """The variables read while Python starts or torch is imported (common.processes'
    READ_AT_START, the list start_ranks forks ranks by) whose value in `env` differs from
    `started_with`'s: a command that sets one of them differently runs in a new Python.
    Called in the test process only: the zygote itself imports nothing of the package, so a
    forked command imports it as a new Python would."""
    from common.processes import READ_AT_START

    return {k for k in env.keys() | started_with.keys()
            if k.startswith(READ_AT_START) and k != UNBUFFERED and env.get(k) != started_with.get(k)}


# --- the zygote (this file run as a script) ----------------------------------------------

class _Child(Exception):
    """Raised in a newly forked child: it unwinds the server's loop, so the command runs at
    the top of the stack, as a script does."""

    def __init__(self, request: dict):
        self.request = request


def _die_with_parent() -> None:
    """Linux: SIGKILL us when our parent dies (the zygote's parent is the test process)."""
    import ctypes
    import signal
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _serve() -> None:
    """One JSON request per line on stdin ({"id", ...} to start a command, {"kill": pid});
    one JSON reply per line on stdout ({"id", "pid"} when it starts, {"id", "code"} when it
    ends). Ends when stdin closes (the test process is gone)."""
    children: dict[int, int] = {}  # pid -> request id
    buffer = b""

    def reply(message: dict) -> None:
        os.write(1, (json.dumps(message) + "\n").encode())

    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 65536)
            if not data:
                os._exit(0)
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    if request["kill"] in children:
                        os.kill(request["kill"], 9)
                    continue
                pid = os.fork()
                if pid == 0:
                    raise _Child(request)
                children[pid] = request["id"]
                reply({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict) -> None:
    """In the child: the command's session, stdio, directory, environment and argv."""
    import io
    import signal
    _die_with_parent()
    if request.get("tty"):  # a terminal of its own, as Popen(start_new_session=True) on a pty
        import fcntl
        import termios
        os.setsid()
        tty = os.open(request["tty"], os.O_RDWR)
        fcntl.ioctl(tty, termios.TIOCSCTTY, 0)
        stdio = [tty, tty, tty]
    else:
        if request.get("new_session"):
            os.setsid()
        stdio = [os.open(os.devnull, os.O_RDONLY),
                 os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC | os.O_NOCTTY),
                 os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC | os.O_NOCTTY)]
    for fd, source in enumerate(stdio):
        os.dup2(source, fd)
    for source in set(stdio):
        if source > 2:
            os.close(source)
    if request.get("sigint_default"):  # Ctrl-C raises KeyboardInterrupt, as in a terminal
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read $TMPDIR again: the command's, not the zygote's
    unbuffered = bool(request["env"].get(UNBUFFERED))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered,
                                  line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(request["argv"])


def main() -> None:
    _die_with_parent()
    import torch  # noqa: F401  (the point of the zygote)
    import torch.distributed  # noqa: F401
    import torch._dynamo  # noqa: F401  (what DDP, FSDP2 and DTensor import on first use)
    import rich.console  # noqa: F401
    import gc
    gc.freeze()  # what is here now stays out of every child's collections (copy-on-write)
    os.write(1, b'{"ready": true}\n')
    try:
        _serve()
    except _Child as child:
        request = child.request
    _become(request)
    import runpy
    if sys.argv[0] == "-m":  # python -m module: sys.path[0] is the working directory
        sys.argv.pop(0)
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:  # sys.path[0] is the script's folder; errors and SystemExit end us as Python would
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


# --- the test process's side -----------------------------------------------------------------

class Zygote:
    """start() once, then run() or start_command() / start_in_terminal() from any thread."""

    def __init__(self):
        self.env: dict = {}
        self.lock = threading.Lock()
        self.slots: dict[int, dict] = {}
        self.next_id = 0

    def start(self) -> None:
        self.env = dict(os.environ)
        self.log = tempfile.TemporaryFile("w+")
        started = threading.Event()

        # Started from a thread that lives as long as this process: Linux sends the
        # parent-death signal when the *thread* that started a process ends.
        def keeper():
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, env=self.env)
            started.set()
            threading.Event().wait()

        threading.Thread(target=keeper, daemon=True, name="zygote-keeper").start()
        started.wait()
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError(f"the test zygote did not start: {self._last_words()}")
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                slot = self.slots.get(message["id"])
            if slot is not None:
                slot.update(message)
                (slot["done"] if "code" in message else slot["started"]).set()
        with self.lock:  # the zygote died: nobody will answer
            for slot in self.slots.values():
                slot.setdefault("code", None)
                slot["started"].set()
                slot["done"].set()

    def _last_words(self) -> str:
        self.log.seek(0)
        return f"exit code {self.proc.poll()}, stderr {self.log.read()[-2000:]!r}"

    def stale(self, env: dict) -> bool:
        """The test process's environment now differs where torch reads it as it is
        imported, and no command is running: time for a new zygote."""
        with self.lock:
            busy = any(not s["done"].is_set() for s in self.slots.values())
        return not busy and bool(import_time_changes(env, self.env))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(10)

    def usable(self, cmd, env: dict, kwargs: dict | None = None, cwd=".") -> bool:
        """`cmd` is `python script.py ...` or `python -m module ...` with this Python, with no
        subprocess option of its own (kwargs), and `env` changes nothing that Python or torch
        read as they start."""
        cmd = [str(c) for c in cmd]
        if kwargs:
            return False
        if len(cmd) < 2 or not (cmd[1].endswith(".py") or (cmd[1] == "-m" and len(cmd) > 2)):
            return False
        if os.path.abspath(os.path.join(cwd, cmd[0])) != os.path.abspath(sys.executable):
            return False
        return not import_time_changes(env, self.env)

    def _send(self, message: dict) -> None:
        with self.lock:
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"the test zygote has died: {self._last_words()}") from None

    def _start(self, cmd, cwd, env: dict, **request) -> "Started":
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            slot = self.slots[rid] = {"started": threading.Event(), "done": threading.Event()}
        self._send({"id": rid, "argv": [str(c) for c in cmd[1:]], "cwd": str(cwd), "env": env,
                    **request})
        if not slot["started"].wait(60) or slot.get("pid") is None:
            raise RuntimeError(f"{' '.join(map(str, cmd))} did not start: {self._last_words()}")
        return Started(self, rid, slot)

    def start_command(self, cmd, cwd, env: dict, stdout, stderr) -> "Started":
        """As Popen(cmd, stdin=DEVNULL, stdout=open(stdout, "w"), stderr=open(stderr, "w"),
        start_new_session=True), Ctrl-C raising KeyboardInterrupt as in a terminal."""
        return self._start(cmd, cwd, env, stdout=str(stdout), stderr=str(stderr),
                           new_session=True, sigint_default=True)

    def start_in_terminal(self, cmd, cwd, env: dict, tty: str) -> "Started":
        """As Popen(cmd, stdin=stdout=stderr=the pty slave `tty`, start_new_session=True),
        the pty its controlling terminal."""
        return self._start(cmd, cwd, env, tty=tty)

    def run(self, cmd, cwd, env: dict, timeout: float | None,
            stdout: str | None = None) -> subprocess.CompletedProcess:
        """As subprocess.run(cmd, capture_output=True, text=True, timeout=...). stdout: a path
        (a FIFO the caller reads as lines come) for its stdout, which is then not captured."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as folder:
            out, err = (os.path.join(folder, n) for n in ("stdout", "stderr"))
            for path in (out, err):
                open(path, "w").close()
            started = self._start(cmd, cwd, env, stdout=stdout or out, stderr=err)
            try:
                code = started.wait(timeout)
            except subprocess.TimeoutExpired:
                started.kill()
                started.wait(10)
                raise subprocess.TimeoutExpired([str(c) for c in cmd], timeout,
                                                open(out).read(), open(err).read()) from None
            text = ["" if stdout else open(out, errors="replace").read(),
                    open(err, errors="replace").read()]
        if code is None:
            raise RuntimeError(f"{' '.join(map(str, cmd))}: {self._last_words()}")
        return subprocess.CompletedProcess([str(c) for c in cmd], code, *text)


class Started:
    """A command the zygote started: what of subprocess.Popen a test needs (pid, poll,
    returncode, wait, kill)."""

    def __init__(self, zygote: Zygote, rid: int, slot: dict):
        self.zygote, self.rid, self.slot, self.pid = zygote, rid, slot, slot["pid"]

    def poll(self) -> int | None:
        return self.slot.get("code") if self.slot["done"].is_set() else None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.slot["done"].wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        with self.zygote.lock:
            self.zygote.slots.pop(self.rid, None)
        return self.slot.get("code")

    def kill(self) -> None:
        if self.poll() is None:
            self.zygote._send({"kill": self.pid})


if __name__ == "__main__":
    main()
