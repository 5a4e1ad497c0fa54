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

The Pythons a command starts itself (multiprocessing's fork server and "spawn" children,
`python script.py` through subprocess.Popen: tools/nodes.py's agents, torchrun's workers)
are forked too, from a copy the command made of itself before it ran (its "nursery", below).

What can differ from a fresh Python is what happens while torch is imported: an
environment that changes a variable torch reads then (TORCH_*, OMP_*, CUDA_* ...) runs in a
real new Python instead (`usable`), except the few that are read later or emulated here
(RUN_TIME). And /proc/PID/cmdline and environ of a forked command are the zygote's:
described() gives what a new Python's would say. tests/test_zygote.py checks the promises
above.
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
    from `started_with`'s, leaving out those `ignore` names (or begins)."""
    return {k for k in env.keys() | started_with.keys()
            if k.startswith(IMPORT_TIME) and not k.startswith(tuple(ignore))
            and env.get(k) != started_with.get(k)}


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
    if not request.get("launched"):  # a nursery's child keeps the parent its command gave it
        _set_parent_death_signal()  # the zygote (so the tests) gone: so are we
    _take_environment(request["cwd"], request["env"])
    if request.get("launched"):  # stdio is in place already (the nursery put it there)
        pass
    elif request.get("tty"):  # a terminal of its own, as `start_new_session=True` on a pty gives
        import fcntl
        import termios
        os.setsid()
        tty = os.open(request["tty"], os.O_RDWR)
        fcntl.ioctl(tty, termios.TIOCSCTTY, 0)  # its controlling terminal: keys, Ctrl-C, job control
        for fd in (0, 1, 2):
            os.dup2(tty, fd)
        os.close(tty)
    else:
        if request.get("new_session"):  # as Popen(start_new_session=True)
            os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOCTTY)  # (a pty: not ours)
            os.dup2(out, fd)
            os.close(out)
    if request.get("sigint_default"):  # Ctrl-C raises KeyboardInterrupt, as in a terminal
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    if request.get("unbuffered", True):  # python -u, or PYTHONUNBUFFERED (the tests set it)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    else:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(request["argv"])
    _register(request.get("python_args", request["argv"]), request["env"])
    if sys.argv[0] == "-m":  # python -m module: sys.path[0] is the working directory
        sys.argv.pop(0)
        sys.path[:] = _python_path(request["env"], os.getcwd())
        return "-m"
    # sys.path[0] is the script's folder (it was this file's)
    sys.path[:] = _python_path(request["env"], os.path.dirname(os.path.abspath(sys.argv[0])))
    return os.path.abspath(sys.argv[0])


def _take_environment(cwd: str, env: dict) -> None:
    """A new Python's working directory and environment, and what it would have made of the
    environment as it started."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # Python reads $TMPDIR once and keeps it (tempfile.tempdir; torch._dynamo's import asks):
    # the command's $TMPDIR, not the zygote's
    tempfile.tempdir = None
    import multiprocessing.process
    multiprocessing.process.current_process()._config.pop("tempdir", None)
    _emulate_import_time(env)


def _start_time(pid) -> str:
    stat = open(f"/proc/{pid}/stat").read()
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22: when it started, in clock ticks


def _register(python_args: list, env: dict) -> None:
    """/proc/PID/cmdline and environ of a forked command are the zygote's: write down what a
    new Python's would say, for described()."""
    registry = _STARTED_WITH.get("registry")
    if registry:
        with contextlib.suppress(OSError):
            with open(os.path.join(registry, f"{os.getpid()}.json"), "w") as f:
                json.dump({"cmdline": [sys.executable, *map(str, python_args)], "env": env,
                           "start": _start_time(os.getpid())}, f)


def described(pid: int, registry: str | None) -> tuple[list[str], dict] | None:
    """A process's command line and environment as `python ...` would have them: the
    registry's record when it is a command forked from the zygote, else /proc's. None when
    it is gone or not ours to read."""
    try:
        if registry:
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(registry, f"{pid}.json")) as f:
                    record = json.load(f)
                if record["start"] == _start_time(pid):  # not an older process with its pid
                    return record["cmdline"], record["env"]
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    return ([os.fsdecode(a) for a in cmdline],
            dict(os.fsdecode(e).split("=", 1) for e in environ if b"=" in e))


def main() -> None:
    _set_parent_death_signal()
    import warnings
    _STARTED_WITH.update(env=dict(os.environ), path=list(sys.path),
                         registry=sys.argv[1] if len(sys.argv) > 1 else None,
                         filters=list(warnings.filters))  # as Python starts: see _emulate_warnings
    import torch  # noqa: F401  (the point of the zygote)
    import torch.distributed  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import torch._dynamo  # noqa: F401  (what start_ranks preloads in its fork server)
    import rich.console  # noqa: F401
    import gc
    # PYTHONWARNINGS can be emulated (_emulate_warnings) when the imports only put filters in
    # front of Python's own, and the zygote itself started without it
    if (warnings.filters[len(warnings.filters) - len(_STARTED_WITH["filters"]):] == _STARTED_WITH["filters"]
            and not os.environ.get("PYTHONWARNINGS") and not sys.warnoptions):
        RUN_TIME.append("PYTHONWARNINGS")
    gc.freeze()  # what is here now stays out of every child's collections (copy-on-write)
    os.write(1, b'{"ready": true}\n')
    try:
        _serve()
    except _Child as child:
        request = child.request
    if request.get("netns"):
        _enter_network_namespace(request["netns"])  # returns in the command, the watcher's child
    while True:  # a command; if it starts Pythons of its own, they come back here (_Child)
        script = _become(request)
        try:
            _start_nursery()  # returns in the command; its nursery's children raise _Child
            break
        except _Child as child:
            request = child.request
    import runpy
    if script == "-m":  # sys.argv[0], the module's name for now, becomes its file's path
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:  # errors and SystemExit end us as Python would
        runpy.run_path(script, run_name="__main__")


def _enter_network_namespace(spec: dict) -> None:
    """tests/test_loopback.py: the command in a network and mount namespace of its own, set up
    by spec["setup"] (a shell script run as root), and every TCP listener it opens recorded:
    this process becomes a watcher that reads /proc/net/tcp and tcp6 (this namespace's
    sockets) every 20 ms until the command, its child, ends, then writes the listening
    addresses it saw, as JSON, to spec["listeners_file"] and ends with the command's code."""
    import ctypes
    import time
    report = spec["listeners_file"]
    # CLONE_NEWNET | CLONE_NEWNS; then nothing mounted here reaches the machine's namespace
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000 | 0x00020000) != 0:
        open(report, "w").write(json.dumps({"error": f"unshare: errno {ctypes.get_errno()}"}))
        os._exit(97)
    for cmd in (["mount", "--make-rprivate", "/"], ["bash", "-c", spec["setup"]]):
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env={**os.environ, **spec.get("env", {})})
        if done.returncode != 0:  # (stdout is the zygote's channel to the tests: not a word there)
            open(report, "w").write(json.dumps({"error": f"{cmd}: {done.stderr[-2000:]}"}))
            os._exit(97)
    command = os.fork()
    if command == 0:
        return
    seen: set[str] = set()
    while True:
        seen |= _tcp_listeners()
        done, status = os.waitpid(command, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    with open(report + ".part", "w") as f:
        json.dump({"listened": sorted(seen)}, f)
    os.replace(report + ".part", report)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _tcp_listeners() -> set[str]:
    """"address:port" of every listening TCP socket in this network namespace."""
    import socket
    out = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError):
            for line in open(path).read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return out


# --- the command's own Pythons, forked too -------------------------------------------------
# A command often starts Pythons of its own: a lesson's ranks come from multiprocessing's fork
# server (a new `python -c` that imports torch._dynamo), tools/nodes.py starts a torchrun agent
# per node (`python -m torch.distributed.run`), and each agent a `python -u lesson.py` per
# worker, every one of them about 6 CPU s of imports before its first line. So before a
# zygote child's command runs (nothing but imports has run in it yet: no OpenMP thread, no
# CUDA, so forking it is safe), it forks a "nursery", a copy of itself that waits. When the
# command starts one of those Pythons, util.spawnv_passfds (the fork server) or
# subprocess.Popen (anything `python [-u] script.py ...` or `python [-u] -m module ...`) hands
# the nursery what that Python would have had instead: its stdin, stdout, stderr and passed
# descriptors, its environment, directory, argv, session and ignored signals. The nursery
# forks twice; the first fork exits at once, so the second, the new command, is adopted by
# the command (which is a "child subreaper" for that instant): it is the command's child, as
# a real one is, and Popen.wait, poll and killpg work on it as usual. It then forks a nursery
# of its own, and runs. Anything else (a shell, `python -c`, preexec_fn, close_fds=False,
# another executable) or an environment that differs where torch reads it as it is imported
# runs the real way: a new Python.
_STARTED_WITH: dict = {}
_FORK_SERVER_CMD = "from multiprocessing.forkserver import main; main("
_SPAWN_CMD = "from multiprocessing.spawn import spawn_main; spawn_main("  # start method "spawn"
# read later than the zygote's imports (by torchrun's agent and workers, or by c10d when a
# process group starts): a command may change these and still be forked
RUN_TIME = ["TORCHELASTIC_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
            "PYTHONPATH", "PYTHONUNBUFFERED",
            "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG"]  # these two: _emulate_import_time
_NURSERY: dict = {}  # in a command: its nursery's socket, lock and pid
NURSERY_FD = 1000  # the lowest number the nursery's socket may have in its command


def _python_path(env: dict, first: str) -> list[str]:
    """sys.path of a new Python started with `env`: `first` (the script's folder, '' for -c),
    PYTHONPATH's entries, then the standard library and site-packages (the zygote's own path
    after its PYTHONPATH part)."""
    def entries(e):
        return [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = _STARTED_WITH["path"][1 + len(entries(_STARTED_WITH["env"])):]
    return [first, *entries(env), *base]


def _emulate_import_time(env: dict) -> None:
    """Do what two variables read while torch is imported would have done in a new Python:
    OMP_NUM_THREADS (read as OpenMP loads) sets how many threads torch's CPU ops use, and
    TORCH_DISTRIBUTED_DEBUG (read by `import torch.distributed`) c10d's debug level."""
    def changed(name):
        return env.get(name) != _STARTED_WITH["env"].get(name)
    value = env.get("OMP_NUM_THREADS")
    if changed("OMP_NUM_THREADS") and value and value.isdigit() and int(value) > 0:
        import torch
        torch.set_num_threads(int(value))
    if changed("TORCH_DISTRIBUTED_DEBUG"):
        import torch.distributed
        torch.distributed.set_debug_level_from_env()
    if changed("PYTHONWARNINGS"):
        _emulate_warnings(env.get("PYTHONWARNINGS", ""))


def _emulate_warnings(value: str) -> None:
    """A new Python started with PYTHONWARNINGS puts its filters in front of its own defaults
    as it starts, before the filters that importing torch adds in front of those: the same
    order here (the zygote checked at start that its imports only added filters in front)."""
    import warnings
    options = [o for o in value.split(",") if o]
    own = _STARTED_WITH["filters"]
    added = warnings.filters[:len(warnings.filters) - len(own)]
    warnings.filters[:] = list(own)
    sys.warnoptions[:] = options
    warnings._processoptions(options)
    warnings.filters[:0] = added
    warnings._filters_mutated()


def _subreaper(on: bool) -> bool | None:
    """Make this process a child subreaper (orphans below it become its children), or stop;
    return whether it was one, or None when the kernel refused."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    if libc.prctl(37, ctypes.byref(was), 0, 0, 0) != 0:  # PR_GET_CHILD_SUBREAPER
        return None
    if libc.prctl(36, int(on), 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        return None
    return bool(was.value)


def _ignored_signals() -> list[int]:
    """The signals this process ignores: a new process inherits that across exec."""
    import signal
    out = []
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_IGN and sig not in (signal.SIGPIPE, signal.SIGXFSZ):
                out.append(int(sig))
    return out


def _launch(request: dict, fds: list[int]) -> int | None:
    """In a command: ask its nursery for a new command; its pid (now our child), or None when
    it cannot serve (then the caller starts a real Python)."""
    import socket
    nursery = _NURSERY
    if not nursery or os.getpid() != nursery["command"]:
        return None  # a forked copy of the command (multiprocessing's fork): the real way
    with nursery["lock"]:
        sock = nursery.get("sock")
        if sock is None:
            return None
        request = {**request, "command": os.getpid()}
        was = _subreaper(True)
        if was is None:  # then the new process would not be ours: start a real one
            return None
        try:
            socket.send_fds(sock, [json.dumps(request).encode()], fds)
            ready, _, _ = select.select([sock], [], [], 60)
            reply = sock.recv(1 << 16) if ready else b""
        except OSError:
            reply = b""
        finally:
            _subreaper(was)
        if not reply:
            nursery["sock"] = None
            sock.close()
            return None
        return json.loads(reply)["pid"] or None  # 0: its fork failed (then a real one)


def _start_nursery() -> None:
    """Fork the nursery (which serves until the command ends, and whose children raise
    _Child), and in the command, route its Pythons to it."""
    import socket
    import multiprocessing.util as util
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        _nurse(theirs)  # returns only in a child it starts: that one raises _Child
    theirs.close()
    # its socket far above the command's own descriptors, whose numbers then come out as in a
    # new Python (the only descriptor a new Python would not have; closed on exec)
    import fcntl
    high = fcntl.fcntl(ours.fileno(), fcntl.F_DUPFD_CLOEXEC, NURSERY_FD)
    ours.close()
    ours = socket.socket(fileno=high)
    _NURSERY.clear()
    _NURSERY.update(sock=ours, lock=threading.Lock(), command=os.getpid(), pid=pid)
    real_spawnv, real_execute = util.spawnv_passfds, subprocess.Popen._execute_child

    def spawnv_passfds(path, args, passfds):
        request = _python_c_request(os.fsdecode(path), [os.fsdecode(a) for a in args],
                                    sorted(map(int, passfds)))
        if request is not None:
            pid = _launch(request, [0, 1, 2, *request["passfds"]])
            if pid is not None:
                return pid
        return real_spawnv(path, args, passfds)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):
        request = _popen_request(args, executable, preexec_fn, close_fds, cwd, env, shell,
                                 gid, gids, uid, umask, process_group)
        if request is not None:
            request.update(new_session=bool(start_new_session), pass_fds=sorted(map(int, pass_fds)))
            stdio = [p2cread, c2pwrite, errwrite]
            pid = _launch(request, [fd if fd != -1 else n for n, fd in enumerate(stdio)]
                          + request["pass_fds"])
            if pid is not None:
                self.pid = pid
                self._child_created = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
        return real_execute(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                            startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                            c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                            start_new_session, process_group)

    util.spawnv_passfds = spawnv_passfds
    subprocess.Popen._execute_child = _execute_child


def _python_c_request(path, args: list, passfds: list) -> dict | None:
    """What the nursery needs to start multiprocessing's fork server or a "spawn" child (each
    a `python -c ...` with descriptors of its own), or None for anything else."""
    if "-c" not in args or os.path.abspath(path) != os.path.abspath(sys.executable):
        return None
    at = args.index("-c")
    options, cmd, rest = args[1:at], "".join(args[at + 1:at + 2]), args[at + 2:]
    if cmd.startswith(_FORK_SERVER_CMD) and not rest:
        kind = "fork_server"
    elif cmd.startswith(_SPAWN_CMD) and rest == ["--multiprocessing-fork"]:
        kind = "spawn"
    else:
        return None
    env = dict(os.environ)
    changes = import_time_changes(env, _STARTED_WITH["env"], RUN_TIME)
    if set(options) - {"-B"} or changes:  # -B: write no .pyc (nothing else does here)
        _log(f"a new Python for {kind}: options {options}, changed {sorted(changes)}")
        return None
    return {"kind": kind, "cmd": cmd, "rest": rest, "passfds": passfds, "env": env,
            "cwd": os.getcwd(), "ignored": _ignored_signals()}


def _log(message: str) -> None:
    """ZYGOTE_LOG=FILE: say there which commands still start a new Python, and why."""
    if os.environ.get("ZYGOTE_LOG"):
        with contextlib.suppress(OSError), open(os.environ["ZYGOTE_LOG"], "a") as f:
            f.write(f"{os.getpid()} {' '.join(sys.argv[:2])}: {message}\n")


def _popen_request(args, executable, preexec_fn, close_fds, cwd, env, shell, gid, gids, uid,
                   umask, process_group) -> dict | None:
    """What the nursery needs to start Popen's command, or None when it is not
    `python [-u] script.py|-m module ...` with this Python and Popen's usual settings."""
    if shell or isinstance(args, (str, bytes, os.PathLike)) or not close_fds:
        return None
    if gid is not None or gids is not None or uid is not None or umask >= 0 or process_group != -1:
        return None
    # tools/nodes.py's agents die with it (prctl in preexec_fn): the nursery's child does that
    # itself once it is the command's child. Any other preexec_fn: the real way.
    if preexec_fn is not None and getattr(preexec_fn, "__name__", "") != "set_parent_death_signal":
        return None
    args = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args]
    if not all(isinstance(a, str) for a in args) or len(args) < 2:
        return None
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    program = executable if executable is not None else args[0]
    if os.path.abspath(os.path.join(cwd, program)) != os.path.abspath(sys.executable):
        return None
    rest, unbuffered = args[1:], False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if not rest or not (rest[0] == "-m" and len(rest) > 1 or rest[0].endswith(".py")):
        return None
    env = dict(os.environ if env is None else env)
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    changes = import_time_changes(env, _STARTED_WITH["env"], RUN_TIME)
    if changes:
        _log(f"a new Python for {rest[:2]}: changed {sorted(changes)}")
        return None
    return {"kind": "popen", "argv": rest, "python_args": args[1:], "env": env, "cwd": os.path.abspath(cwd),
            "unbuffered": unbuffered or bool(env.get("PYTHONUNBUFFERED")),
            "pdeathsig": preexec_fn is not None, "ignored": _ignored_signals()}


def _nurse(sock) -> None:
    """The nursery's loop: for each request, fork twice (the middle one exits, so the command
    adopts the new one), tell the command its pid; end when the command does."""
    import signal
    import socket
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the command's to handle
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold none of the command's pipes open
        os.dup2(null, fd)
    os.close(null)
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.5)
        if not ready:
            if os.getppid() != parent:
                os._exit(0)
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 256)
        except OSError:
            os._exit(0)
        if not message:  # the command is gone
            os._exit(0)
        request = json.loads(message)
        report_r, report_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(report_r)
            child = os.fork()
            if child == 0:
                os.close(report_w)
                os.close(sock.detach())
                _take_over(request, fds)  # raises _Child, or runs the fork server
            os.write(report_w, str(child).encode())
            os._exit(0)
        os.close(report_w)
        child = int(os.read(report_r, 64) or 0)
        os.close(report_r)
        os.waitpid(middle, 0)  # once reaped, its child has been adopted by the command
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": child}).encode())


def _take_over(request: dict, fds: list[int]) -> None:
    """In the nursery's new child: wait to be the command's child, put the descriptors where
    the new Python would have them, then become it (fork server, or raise _Child)."""
    import fcntl
    import signal
    import time
    deadline = time.monotonic() + 30
    while os.getppid() != request["command"]:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.001)
    if request.get("pdeathsig"):
        _set_parent_death_signal()
        if os.getppid() != request["command"]:
            os._exit(70)
    python_c = request["kind"] in ("fork_server", "spawn")
    targets = [0, 1, 2] if python_c else [0, 1, 2, *request["pass_fds"]]
    # above every target first, so that no dup2 below overwrites a descriptor still needed
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, high):
        os.dup2(fd, target)  # inheritable, as exec leaves 0-2 and Popen's pass_fds
    if python_c:  # its own descriptors keep numbers of their own: its command line names them
        renumbered = {n: os.dup(fd) for n, fd in zip(request["passfds"], high[3:])}
        keep = {0, 1, 2, *renumbered.values()}
    else:
        keep = set(targets)
    for entry in os.listdir("/proc/self/fd"):
        if int(entry) not in keep:
            with contextlib.suppress(OSError):
                os.close(int(entry))
    if request.get("new_session"):
        os.setsid()
    for sig in signal.valid_signals():  # what exec leaves, then what Python sets as it starts
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in request["ignored"] or sig in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN
        elif sig == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, handler)
    if python_c:
        _run_python_c(request, renumbered)
    raise _Child({"launched": True, "argv": request["argv"], "env": request["env"],
                  "cwd": request["cwd"], "unbuffered": request["unbuffered"],
                  "python_args": request["python_args"]})


def _run_python_c(request: dict, renumbered: dict) -> None:
    """Become the command's multiprocessing fork server or "spawn" child: `python -c CMD ...`,
    CMD naming the descriptors it was given by their new numbers. Ends with SystemExit."""
    import re
    import types
    for fd in renumbered.values():
        os.set_inheritable(fd, True)
    _take_environment(request["cwd"], request["env"])
    sys.path[:] = _python_path(request["env"], "")
    sys.argv = ["-c", *request["rest"]]
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    if request["kind"] == "fork_server":  # main(listener_fd, alive_r, ...)
        cmd = re.sub(r"main\((\d+), (\d+),",
                     lambda m: f"main({renumbered[int(m[1])]}, {renumbered[int(m[2])]},",
                     request["cmd"], count=1)
    else:  # spawn_main(tracker_fd=N, pipe_handle=M)
        cmd = re.sub(r"(tracker_fd|pipe_handle)=(\d+)",
                     lambda m: f"{m[1]}={renumbered[int(m[2])]}", request["cmd"])
    exec(cmd, main_module.__dict__)  # the server's loop, or the child's work: ends with SystemExit
    raise SystemExit(0)


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
        self.registry = tempfile.mkdtemp(prefix="zygote-commands-")  # see described()
        import atexit
        atexit.register(self._remove_files)  # an xdist worker may end without stop()
        # Started from a thread that lives as long as this process: Linux sends the
        # parent-death signal when the *thread* that started a process ends (a test's
        # worker thread would take the zygote along with it).
        started = threading.Event()

        def keeper():
            self.proc = subprocess.Popen([sys.executable, __file__, self.registry], stdin=subprocess.PIPE,
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
                    if slot.get("detached"):  # nobody else waits for it: not busy any more
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
        self._remove_files()

    def _remove_files(self) -> None:
        import shutil
        shutil.rmtree(self.registry, ignore_errors=True)
        with contextlib.suppress(Exception):
            self.log.close()  # a NamedTemporaryFile: removed as it closes

    def usable(self, cmd, env: dict, kwargs: dict, cwd=".") -> bool:
        """Whether `cmd` is `python script.py ...` with this Python (as a path from cwd) and
        nothing that needs a new one: no subprocess.run options of its own, and no change to
        what torch reads as it is imported."""
        if kwargs or len(cmd) < 2 or not (str(cmd[1]).endswith(".py") or cmd[1] == "-m"):
            return False
        if os.path.abspath(os.path.join(cwd, str(cmd[0]))) != os.path.abspath(sys.executable):
            return False
        changes = import_time_changes(env, self.env, tuple(RUN_TIME))  # the rest: emulated
        if changes:
            _log(f"a new Python for {' '.join(map(str, cmd[1:3]))}: changed {sorted(changes)}")
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
        return self._start(cmd, cwd, env, tty=tty)

    def start_command(self, cmd, cwd, env: dict, stdout: str, stderr: str) -> "Started":
        """As subprocess.Popen(cmd, stdout=open(stdout, "w"), stderr=open(stderr, "w"),
        stdin=DEVNULL, start_new_session=True), with SIGINT raising KeyboardInterrupt as in a
        terminal, however the tests were started; return at once."""
        return self._start(cmd, cwd, env, stdout=str(stdout), stderr=str(stderr),
                           new_session=True, sigint_default=True)

    def _start(self, cmd, cwd, env: dict, **request) -> "Started":
        """Send the request for `cmd` and return once it has a pid; nobody waits on its end
        (the reader thread frees its slot)."""
        rid, slot = self._new_slot(detached=True)
        self._send({"id": rid, "argv": [str(c) for c in cmd[1:]], "env": env, "cwd": str(cwd),
                    **request})
        if not slot["started"].wait(60) or slot.get("pid") is None:
            raise RuntimeError(f"{' '.join(map(str, cmd))}: {self._death()}")
        return Started(self, rid, slot)

    def run(self, cmd, cwd, env: dict, timeout: float | None, netns: dict | None = None,
            stdout: str | None = None) -> subprocess.CompletedProcess:
        """As subprocess.run(cmd, capture_output=True, text=True, timeout=...). netns: in a
        network namespace of its own (see _enter_network_namespace). stdout: a path (a FIFO
        the caller reads as it comes) for its stdout, which is then not captured."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as folder:
            paths = [os.path.join(folder, name) for name in ("stdout", "stderr")]
            for path in paths:
                open(path, "w").close()
            if stdout is not None:
                paths[0] = stdout
            rid, slot = self._new_slot()
            try:
                self._send({"id": rid, "argv": [str(c) for c in cmd[1:]], "env": env,
                            "cwd": str(cwd), "stdout": paths[0], "stderr": paths[1],
                            **({"netns": netns} if netns else {})})
                finished = slot["done"].wait(timeout)
                if not finished:
                    slot["started"].wait(10)
                    self._send({"id": 0, "kill": slot.get("pid")})
                    slot["done"].wait(10)
                out, err = ("" if stdout is not None and p == stdout else open(p, errors="replace").read()
                            for p in paths)
            finally:
                with self.lock:
                    self.waiting.pop(rid, None)
            if not finished:
                raise subprocess.TimeoutExpired(list(map(str, cmd)), timeout, out, err)
            if slot.get("code") is None:
                raise RuntimeError(f"{' '.join(map(str, cmd))}: {self._death()}")
            return subprocess.CompletedProcess(list(map(str, cmd)), slot["code"], out, err)


class Started:
    """A command started by Zygote.start_in_terminal or start_command: as much of
    subprocess.Popen as a test of it needs (pid, poll, returncode, wait, kill)."""

    def __init__(self, zygote: Zygote, rid: int, slot: dict):
        self.zygote, self.rid, self.slot, self.pid = zygote, rid, slot, slot["pid"]

    def poll(self) -> int | None:
        return self.slot.get("code") if self.slot["done"].is_set() else None

    @property
    def returncode(self) -> int | None:
        return self.poll()

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
