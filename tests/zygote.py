"""Run `python some_script.py ...` for the tests without paying for a new Python each time.

Most of the suite's time went to starting Pythons that import torch (about 3 s of CPU
each on the CUDA build of torch 2.14.1, and the suite runs a few hundred lesson commands).
This module keeps one "zygote" per test process: a Python that has imported torch and
nothing more (no OpenMP thread has run in it, CUDA is untouched: forking it is safe, as it
is for multiprocessing's fork server). Each command is a child forked from it, which then
behaves as `python script.py args` would:

* a process of its own (its own pid, exit code, signals; killed on timeout), its stdin
  /dev/null, its stdout and stderr captured, unbuffered (as PYTHONUNBUFFERED=1);
* the test's environment and working directory, sys.argv and sys.path[0] as Python sets
  them, the script (or `-m module`) run as __main__ (runpy), so `if __name__ == "__main__"` and
  multiprocessing (which reads __main__'s file to start its ranks) work as usual;
* interpreter exit as usual: atexit handlers run, an uncaught error prints its traceback.

What can differ from a fresh Python is what happens while torch is imported: an
environment that changes a variable torch reads then (TORCH_*, OMP_*, CUDA_* ...) runs in a
real new Python instead (`usable`). tests/test_zygote.py checks the promises above.
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

# read while torch is imported (or by Python at start-up): a command that sets one of these
# differently from the zygote runs in a new Python
IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP", "CUDA", "NCCL", "LD_", "PYTHON",
               "MALLOC")


def import_time_changes(env: dict, started_with: dict, ignore=("PYTHONUNBUFFERED",)) -> set:
    """The variables read while torch is imported (IMPORT_TIME) whose value in `env` differs
    from `started_with`'s."""
    return {k for k in env.keys() | started_with.keys()
            if k.startswith(IMPORT_TIME) and k not in ignore and env.get(k) != started_with.get(k)}


class _Child(Exception):
    def __init__(self, request: dict):
        self.request = request


def _set_parent_death_signal() -> None:
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _serve() -> None:
    """The zygote's loop: a JSON request per line on stdin; a JSON reply per line on stdout
    ({"id", "pid"} when the child starts, {"id", "code"} when it ends)."""
    children: dict[int, int] = {}  # pid -> request id
    buffer = b""

    def reply(message: dict) -> None:
        os.write(1, (json.dumps(message) + "\n").encode())

    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            data = os.read(0, 65536)
            if not data:  # the test process is gone
                os._exit(0)
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    pid = request["kill"]
                    if pid in children:
                        os.kill(pid, 9)
                    continue
                pid = os.fork()
                if pid == 0:
                    raise _Child(request)  # unwinds the loop: the child runs at the top
                children[pid] = request["id"]
                reply({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict) -> str:
    """In the child: take the command's stdio, environment, directory and argv."""
    import io
    _set_parent_death_signal()  # the zygote (so the tests) gone: so are we
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Python reads $TMPDIR once and keeps it (tempfile.tempdir; torch._dynamo's import asks):
    # the command's $TMPDIR, not the zygote's
    tempfile.tempdir = None
    import multiprocessing.process
    multiprocessing.process.current_process()._config.pop("tempdir", None)
    if request.get("tty"):  # a terminal of its own, as `start_new_session=True` on a pty gives
        import fcntl
        import termios
        os.setsid()
        tty = os.open(request["tty"], os.O_RDWR)
        fcntl.ioctl(tty, termios.TIOCSCTTY, 0)  # its controlling terminal: keys, Ctrl-C, job control
        for fd in (0, 1, 2):
            os.dup2(tty, fd)
        os.close(tty)
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(out, fd)
            os.close(out)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(request["argv"])
    if sys.argv[0] == "-m":  # python -m module: sys.path[0] is the working directory
        sys.argv.pop(0)
        sys.path[0] = os.getcwd()
        return "-m"
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # was this file's folder
    return os.path.abspath(sys.argv[0])


def main() -> None:
    _set_parent_death_signal()
    _STARTED_WITH.update(env=dict(os.environ), path=list(sys.path))
    import torch  # noqa: F401  (the point of the zygote)
    import torch.distributed  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import torch._dynamo  # noqa: F401  (what start_ranks preloads in its fork server)
    import rich.console  # noqa: F401
    import gc
    gc.freeze()  # what is here now stays out of every child's collections (copy-on-write)
    os.write(1, b'{"ready": true}\n')
    try:
        _serve()
    except _Child as child:
        script = _become(child.request)
    _stand_by_as_fork_server()
    import runpy
    if script == "-m":  # sys.argv[0], the module's name for now, becomes its file's path
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:  # errors and SystemExit end us as Python would
        runpy.run_path(script, run_name="__main__")


# --- the fork server, forked too ---------------------------------------------------------
# A lesson's ranks are forked from multiprocessing's fork server, a new Python that imports
# torch._dynamo (start_ranks' preload): about 7 s of CPU per multi-rank run, most of what a
# short lesson run costs. A child of the zygote gets one ready-made instead: before the
# command runs (nothing but imports has run in it yet: no OpenMP thread, no CUDA, so a fork
# is safe), it forks a standby copy of itself. When the command starts its fork server,
# util.spawnv_passfds (which would exec a new Python with `-c "from multiprocessing.forkserver
# import main; main(...)"`) hands the standby what that Python would have had instead: the
# listener and "alive" descriptors, stdin/stdout/stderr, the environment, the working
# directory, sys.path as `python -c` builds it from PYTHONPATH, SIGINT ignored or not; the
# standby closes every other descriptor and runs the same `main(...)`. It is the command's
# child, as the real server is, and it ends the same ways (its alive pipe, a signal, the
# exit handlers of its preloads). Anything else, or a second server, or an environment that
# differs where torch reads it at import, goes to the real spawnv_passfds: a new Python.
_STARTED_WITH: dict = {}
_FORK_SERVER_CMD = "from multiprocessing.forkserver import main; main("


def _python_c_path(env: dict) -> list[str]:
    """sys.path of `python -c ...` started with `env`: '', PYTHONPATH's entries, then the
    standard library and site-packages (the zygote's own path after its PYTHONPATH part)."""
    def entries(e):
        return [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = _STARTED_WITH["path"][1 + len(entries(_STARTED_WITH["env"])):]
    return ["", *entries(env), *base]


def _stand_by_as_fork_server() -> None:
    import multiprocessing.util as util
    import signal
    import socket
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    standby = os.fork()
    if standby == 0:
        ours.close()
        _serve_as_fork_server(theirs)
        raise SystemExit(0)  # not reached: the server's loop ends with SystemExit
    theirs.close()
    command, real = os.getpid(), util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        cmd = str(args[-1]) if len(args) >= 2 and args[-2] == "-c" else ""
        env = dict(os.environ)
        changed = import_time_changes(env, _STARTED_WITH["env"], ("PYTHONPATH", "PYTHONUNBUFFERED"))
        if (not cmd.startswith(_FORK_SERVER_CMD) or os.getpid() != command or ours.fileno() < 0
                or changed):
            return real(path, args, passfds)
        passfds = sorted(map(int, passfds))
        request = {"cmd": cmd, "passfds": passfds, "env": env, "cwd": os.getcwd(),
                   "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
        try:
            socket.send_fds(ours, [json.dumps(request).encode()], [0, 1, 2, *passfds])
        except OSError:
            return real(path, args, passfds)
        finally:
            ours.close()
        return standby

    util.spawnv_passfds = spawnv_passfds


def _serve_as_fork_server(sock) -> None:
    """The standby: wait for the command's request (or its end), then become its fork server."""
    import re
    import select
    import signal
    import socket
    import types
    parent = os.getppid()
    while True:  # the command may end without a word (killed): then so do we
        ready, _, _ = select.select([sock], [], [], 0.5)
        if ready or os.getppid() != parent:
            break
    try:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 16) if ready else (b"", [], 0, None)
    except OSError:
        message = b""
    os.close(sock.detach())  # closed below anyway: no socket object may close its number later
    if not message:
        os._exit(0)
    request = json.loads(message)
    for fd, received in zip((0, 1, 2), fds[:3]):
        os.dup2(received, fd)
    renumbered = dict(zip(request["passfds"], fds[3:]))
    keep = {0, 1, 2, *renumbered.values()}
    for entry in os.listdir("/proc/self/fd"):
        if int(entry) not in keep:
            with contextlib.suppress(OSError):
                os.close(int(entry))
    for fd in renumbered.values():
        os.set_inheritable(fd, True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = _python_c_path(request["env"])
    sys.argv = ["-c"]
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    cmd = re.sub(r"main\((\d+), (\d+),",
                 lambda m: f"main({renumbered[int(m.group(1))]}, {renumbered[int(m.group(2))]},",
                 request["cmd"], count=1)
    exec(cmd, main_module.__dict__)  # the fork server's loop: ends with SystemExit


class Zygote:
    """The test process's side: start() once, then run() from any thread."""

    def __init__(self):
        self.proc = None
        self.env: dict = {}
        self.lock = threading.Lock()
        self.waiting: dict[int, dict] = {}
        self.next_id = 0

    def start(self) -> None:
        self.env = dict(os.environ)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zygote-", suffix=".log")
        # Started from a thread that lives as long as this process: Linux sends the
        # parent-death signal when the *thread* that started a process ends (a test's
        # worker thread would take the zygote along with it).
        started = threading.Event()

        def keeper():
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, env=self.env)
            started.set()
            threading.Event().wait()  # forever

        threading.Thread(target=keeper, daemon=True, name="zygote-keeper").start()
        started.wait()
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError("the test zygote did not start")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                slot = self.waiting.get(message["id"])
            if slot is not None:
                slot.update(message)
                if "code" in message:
                    slot["done"].set()
                    if slot.get("in_terminal"):  # nobody else waits for it: not busy any more
                        with self.lock:
                            self.waiting.pop(message["id"], None)
                else:
                    slot["started"].set()
        with self.lock:  # the zygote died: nobody will answer
            for slot in self.waiting.values():
                slot.setdefault("code", None)
                slot["started"].set()
                slot["done"].set()

    def _import_time_changes(self, env) -> set:
        return import_time_changes(env, self.env)

    def _new_slot(self, **extra) -> tuple[int, dict]:
        """A request id, and the slot where the reader thread puts its pid and exit code."""
        with self.lock:
            self.next_id += 1
            slot = self.waiting[self.next_id] = {"started": threading.Event(),
                                                 "done": threading.Event(), **extra}
            return self.next_id, slot

    def stale(self, env) -> bool:
        """This process's environment now differs from the zygote's where torch's import reads
        it, and no command is running: start a new zygote."""
        with self.lock:
            busy = bool(self.waiting)
        return not busy and bool(self._import_time_changes(env))

    def stop(self) -> None:
        """End the zygote (it exits when its stdin closes)."""
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        with contextlib.suppress(Exception):
            self.proc.wait(10)

    def usable(self, cmd, env: dict, kwargs: dict, cwd=".") -> bool:
        """Whether `cmd` is `python script.py ...` with this Python (as a path from cwd) and
        nothing that needs a new one: no subprocess.run options of its own, and no change to
        what torch reads as it is imported."""
        if kwargs or len(cmd) < 2 or not (str(cmd[1]).endswith(".py") or cmd[1] == "-m"):
            return False
        if os.path.abspath(os.path.join(cwd, str(cmd[0]))) != os.path.abspath(sys.executable):
            return False
        changes = self._import_time_changes(env)
        if changes and os.environ.get("ZYGOTE_LOG"):  # which commands need a new Python, and why
            with open(os.environ["ZYGOTE_LOG"], "a") as log:
                log.write(f"{os.getpid()} {' '.join(map(str, cmd[1:3]))}: {sorted(changes)}\n")
        return not changes

    def _send(self, message: dict) -> None:
        with self.lock:
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(self._death()) from None

    def _death(self) -> str:
        self.log.seek(0)
        return (f"the test zygote has died (exit code {self.proc.poll()}); its last words: "
                f"{self.log.read()[-2000:]!r}")

    def start_in_terminal(self, cmd, cwd, env: dict, tty: str) -> "Started":
        """Start `python script.py ...` with the terminal `tty` (a pty's slave) as its stdin,
        stdout, stderr and controlling terminal, in a session of its own (as subprocess.Popen
        with start_new_session=True on that pty); return at once, with its pid."""
        rid, slot = self._new_slot(in_terminal=True)
        self._send({"id": rid, "argv": [str(c) for c in cmd[1:]], "env": env, "cwd": str(cwd),
                    "tty": tty})
        if not slot["started"].wait(60) or slot.get("pid") is None:
            raise RuntimeError(f"{' '.join(map(str, cmd))}: {self._death()}")
        return Started(self, rid, slot)

    def run(self, cmd, cwd, env: dict, timeout: float | None) -> subprocess.CompletedProcess:
        """As subprocess.run(cmd, capture_output=True, text=True, timeout=...)."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as folder:
            paths = [os.path.join(folder, name) for name in ("stdout", "stderr")]
            for path in paths:
                open(path, "w").close()
            rid, slot = self._new_slot()
            try:
                self._send({"id": rid, "argv": [str(c) for c in cmd[1:]], "env": env,
                            "cwd": str(cwd), "stdout": paths[0], "stderr": paths[1]})
                finished = slot["done"].wait(timeout)
                if not finished:
                    slot["started"].wait(10)
                    self._send({"id": 0, "kill": slot.get("pid")})
                    slot["done"].wait(10)
                out, err = (open(p, errors="replace").read() for p in paths)
            finally:
                with self.lock:
                    self.waiting.pop(rid, None)
            if not finished:
                raise subprocess.TimeoutExpired(list(map(str, cmd)), timeout, out, err)
            if slot.get("code") is None:
                raise RuntimeError(f"{' '.join(map(str, cmd))}: {self._death()}")
            return subprocess.CompletedProcess(list(map(str, cmd)), slot["code"], out, err)


class Started:
    """A command started by Zygote.start_in_terminal: as much of subprocess.Popen as a test
    of a terminal program needs (pid, poll, wait, kill)."""

    def __init__(self, zygote: Zygote, rid: int, slot: dict):
        self.zygote, self.rid, self.slot, self.pid = zygote, rid, slot, slot["pid"]

    def poll(self) -> int | None:
        return self.slot.get("code") if self.slot["done"].is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self.slot["done"].wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        with self.zygote.lock:
            self.zygote.waiting.pop(self.rid, None)
        return self.slot.get("code")

    def kill(self) -> None:
        if self.poll() is None:
            self.zygote._send({"id": 0, "kill": self.pid})


if __name__ == "__main__":
    main()
