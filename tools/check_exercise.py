"""Check a learner's exercise: `make check-NN [FILE=path]`.

Every check runs the learner's code for real and prints one line: "ok: ..." (exit 0) or
"not yet: ..." with what is still wrong and a hint (exit 1). Each check is a file of its own
beside this one, tools/checks/check_NN.py, that defines STARTER (the exercise's path, in
exercises/) and check(path), and shares this small harness.

A teacher grades thirty files with it, so a file that tries must not fool it. The learner's
code never runs in the checker's process:

* answer(path, probe, *args) runs probe(module, *args), a function of the check, in a new
  process (the "answer"), with the learner's file loaded as `module`. It hands back what
  the probe returned, as plain data (numbers, strings, lists, dicts, tensors), written with
  torch.save and read back with torch.load(weights_only=True), which rebuilds nothing else.
  The check then computes what the answer should have been, here, and compares: the verdict
  never comes from the answer's exit status, its output or a value it computed about itself.
  (What the answer measures about its own calls, such as collectives counted by CommLog or
  seconds spent in a step, is data from the answer's process like the rest: a file that
  patches the instruments it runs under could change those numbers, not the values.)
* The answer runs under a "keeper", a small process of this file that never runs learner
  code: it limits the time (IMPORT_LIMIT_S to import the file, then the probe's own limit),
  and when the answer ends, is stopped or times out, it ends everything the answer started:
  the keeper is a child subreaper (Linux), so even a daemonised fork (fork, setsid, fork)
  becomes its child, and it kills every process below it. Elsewhere the answer's process
  group is killed. What a keeper prints back is one JSON line, its own.
* owned(cmd) runs any command under a keeper the same way (check 06 runs the learner's
  file under tools/nodes.py with it).

Also here: NotYet, load (in the answer's process and its ranks), run_world (ranks, in the
answer's process, or for the check's own trusted measurements), and the messages' helpers
where, listed, max_diff and one_line.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = Path(__file__).resolve()
sys.path.insert(0, str(ROOT))
# the lessons' own folders (lessons/NN_topic/), for their helpers: `import pipeline`
sys.path[1:1] = [str(d) for d in sorted((ROOT / "lessons").glob("[0-9][0-9]_*/")) if d.name != "12_pitfalls"]

from common.cli import fail  # noqa: E402

if __name__ == "__main__":  # so that `from check_exercise import NotYet` finds this very module
    sys.modules.setdefault("check_exercise", sys.modules[__name__])

STARTUP_LIMIT_S = 180  # the answer's process, before it loads the learner's file (torch's imports)
IMPORT_LIMIT_S = 30   # to import the learner's file, on a busy laptop
ANSWER_LIMIT_S = 30   # a probe's default, after the import (rank checks give their own)
TOKEN_ENV = "CHECK_EXERCISE_ANSWER"  # every process of an answer inherits it (a last resort)
RESULT_LIMIT = 256 << 20  # bytes: far above what any probe returns


class NotYet(Exception):
    """The learner's answer is not right yet; the message says why."""


def one_line(text: str, limit: int = 400) -> str:
    """Text from the learner's side (an error message, a printed line) as one line: no control
    characters (a carriage return could paint over the verdict), at most `limit` characters."""
    text = " ".join(re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", str(text)).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def load(path: Path):
    """The learner's file as a module (in the answer's process, or in a rank it started):
    NotYet if it does not import, or if it exits as it is imported."""
    path = Path(path)
    name = f"exercise_{path.stem}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # before it runs: dataclasses look their module up there
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    except SystemExit as exc:
        raise NotYet(f"{path} exits as it is imported (SystemExit({exc.code!r})): the check imports "
                     f"your file and calls its functions; keep a script's part under "
                     f'`if __name__ == "__main__":`') from None
    except Exception as exc:
        raise NotYet(f"{path} does not run: {type(exc).__name__}: {one_line(exc, 300)}"
                     f"{where(exc, str(path))}") from None
    return module


def where(exc_or_frames, learner: str) -> str:
    """' (your_file.py, line 12)' for the deepest frame of the learner's file, if any: from an
    exception, or from the (file, line) frames a rank sent back (RankFailed.frames)."""
    import traceback
    frames = exc_or_frames
    if isinstance(exc_or_frames, BaseException):
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc_or_frames.__traceback__)]
    lines = [line for file, line in frames if file == learner]
    return f" ({Path(learner).name}, line {lines[-1]})" if lines else ""


def listed(values, limit: int = 6) -> str:
    values = list(values)
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def max_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over two state_dicts."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


# ---------------------------------------------------------------------------------------
# Running a learner's code on several ranks: common/distributed.py's run_ranks (each rank a
# fresh process in a gloo group on a free port, with a timeout on the group and on the whole
# run), its failures told as the learner needs them. Called inside a probe (in the answer's
# process), or by a check for its own measurements, which run no learner code.
# ---------------------------------------------------------------------------------------

GROUP_TIMEOUT_S = 20   # every collective and point-to-point message gives up after this
WORLD_TIMEOUT_S = 120  # a whole run of ranks, start-up included (torch imports take a while)


def run_world(world: int, target, args: tuple, learner: Path) -> list:
    """target(rank, world, *args) on `world` new processes in a gloo group: the results by rank.

    Raises NotYet with the first rank's error, when the ranks do not finish in time, or when
    a rank ends itself (exit code 0) without returning its results.
    """
    from common.distributed import RankFailed, run_ranks

    try:
        results = run_ranks(target, world, args, timeout_s=WORLD_TIMEOUT_S,
                            group_timeout_s=GROUP_TIMEOUT_S)
    except RankFailed as failed:
        if failed.kind == "timeout":
            raise NotYet(f"the {world} ranks did not finish within {WORLD_TIMEOUT_S}s: "
                         f"does a rank wait for a message that never comes?") from None
        if failed.kind == "stopped":
            raise NotYet(f"with {world} ranks, {failed}") from None
        if failed.kind == "died":
            raise NotYet(f"with {world} ranks, rank {failed.rank} died (exit code "
                         f"{failed.code}) without an error message") from None
        if failed.error == "NotYet":  # the check's own verdict, raised inside a rank
            raise NotYet(failed.text) from None
        text = one_line(failed.text, 300)
        at = where(failed.frames, str(learner))
        if "Timed out" in text:  # gloo: "Timed out waiting 20000ms for recv operation ..."
            raise NotYet(f"with {world} ranks, rank {failed.rank} waited {GROUP_TIMEOUT_S}s for "
                         f"a message that never came{at}: do all ranks make the same calls, "
                         f"and does every receive have a matching send?") from None
        if failed.error == "SystemExit":
            raise NotYet(f"with {world} ranks, rank {failed.rank} exited (SystemExit({failed.code}))"
                         f"{at} before it returned its results") from None
        raise NotYet(f"with {world} ranks, rank {failed.rank} raised {failed.error}: "
                     f"{text}{at}") from None
    quiet = [rank for rank, value in enumerate(results) if value is None]
    if quiet:
        raise NotYet(f"with {world} ranks, rank {quiet[0]} ended (exit code 0) before it returned its "
                     f"results: does your file call sys.exit or os._exit?")
    return results


def run_worlds(worlds, target, args: tuple, learner: Path) -> dict:
    """run_world on each number of ranks in `worlds`, one after the other, in this process:
    {world: the results by rank}. One answer's process serves every run (a new answer per
    world paid for its start again: torch's imports, about 2 s of CPU each). The first world
    that fails ends it with that world's NotYet."""
    return {world: run_world(world, target, args, learner) for world in worlds}


# ---------------------------------------------------------------------------------------
# The answer's process and its keeper
# ---------------------------------------------------------------------------------------

def answer(path: Path, probe, *args, limit_s: float = ANSWER_LIMIT_S):
    """probe(module, *args) in a new process, `module` the learner's file at `path`: what the
    probe returned (plain data). NotYet, in one line, if the file does not import, the probe
    raised NotYet or an error, the process ended before it answered, or took too long
    (IMPORT_LIMIT_S to import the file, then limit_s). Everything it started is ended."""
    import io

    import torch

    folder = Path(tempfile.mkdtemp(prefix="check-answer-"))
    try:
        torch.save({"check": probe.__module__, "probe": probe.__name__, "path": str(path),
                    "args": tuple(args)}, folder / "spec.pt")
        cmd = [sys.executable, str(CHECKER), "--answer", str(folder)]
        status = owned(cmd, limit_s, phases=[(folder / "ready", STARTUP_LIMIT_S, "startup"),
                                             (folder / "imported", IMPORT_LIMIT_S, "import")])
        data = _read_result(folder / "result.pt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if status["reason"] == "import":
        raise NotYet(f"{path} did not finish importing within {IMPORT_LIMIT_S}s: does it sleep, wait "
                     f"for input or train as it is imported? The check imports your file and calls "
                     f'its functions; keep a script\'s part under `if __name__ == "__main__":`')
    if status["reason"] == "time":
        raise NotYet(f"the check stopped your code after {limit_s:g}s: does a function wait forever "
                     f"(a loop that never ends, a message that never comes)?")
    if status["reason"] == "startup":
        raise NotYet(f"the check's process for your file did not start within {STARTUP_LIMIT_S}s "
                     f"(is the machine very busy?); try again")
    if status["reason"] == "stopped":
        raise KeyboardInterrupt
    result = None
    if data is not None:
        with contextlib.suppress(Exception):
            result = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(result, dict) or result.get("kind") not in ("ok", "not_yet"):
        said = one_line(status["stderr"].strip().splitlines()[-1], 200) if status["stderr"].strip() else ""
        raise NotYet(f"your file ended the check's process (exit code {status['code']}) before the "
                     f"check had its results: does it call sys.exit, os._exit or os.kill?"
                     + (f" Its last words: {said}" if said else ""))
    if result["kind"] == "not_yet":
        raise NotYet(one_line(result.get("text", ""), 600))
    return result.get("value")


def _read_result(path: Path) -> bytes | None:
    """The result file's bytes, if it is a regular file of a sane size (the answer wrote it,
    and may have made it anything: a FIFO would wait forever, /dev/zero never ends)."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > RESULT_LIMIT:
            return None
        chunks, size = [], 0
        while size <= RESULT_LIMIT and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= RESULT_LIMIT else None
    finally:
        os.close(fd)


def owned(cmd: list[str], limit_s: float, phases: list = ()) -> dict:
    """Run `cmd` (from the repository root) under a keeper: {"code": its exit code, "reason":
    "exited", "time" (past limit_s), "stopped" (Ctrl-C, SIGTERM) or a phase's reason, "stdout",
    "stderr": the last 64 KiB of each}. phases: [(marker file, seconds, reason)], each phase
    ending when the command creates its marker, within its seconds; limit_s counts from the
    last marker. Every process the command started has ended when this returns."""
    token = secrets.token_hex(12)
    keeper = [sys.executable, str(CHECKER), "--keep", json.dumps(
        {"cmd": [str(c) for c in cmd], "limit_s": limit_s,
         "phases": [(str(marker), seconds, reason) for marker, seconds, reason in phases]})]
    backstop = limit_s + sum(seconds for _, seconds, _ in phases) + 60
    proc = subprocess.Popen(keeper, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, env={**os.environ, TOKEN_ENV: token})
    try:
        out, _ = proc.communicate(timeout=backstop)
        lines = out.strip().splitlines()
        status = json.loads(lines[-1]) if lines else None
    except (subprocess.TimeoutExpired, ValueError):
        status = None
    except KeyboardInterrupt:  # Ctrl-C reached the keeper too; SIGTERM: it ends its answer first
        with contextlib.suppress(OSError):
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _end_token_holders(token)  # a last resort, if the keeper itself was killed
    if not isinstance(status, dict) or "reason" not in status:
        return {"code": None, "reason": "time", "stdout": "", "stderr": ""}
    return status


def _end_token_holders(token: str) -> None:
    """Kill every process whose environment carries `token` (Linux: /proc/PID/environ, the
    environment it started with). Only needed when a keeper was killed before it could end
    its answer's processes itself; a process forked from the tests' zygote shows the zygote's
    environment, so there it finds none."""
    if not os.path.isdir("/proc"):
        return
    needle = f"{TOKEN_ENV}={token}".encode()
    for _ in range(20):
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError):
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            found.append(int(entry))
        if not found:
            return
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process (Linux: /proc/PID/stat)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
                fields = text[text.rindex(")") + 2:].split()  # after the name, which may hold ")"
                found[int(entry)] = (int(fields[1]), fields[0])
    return found


def _end_descendants(pgid: int | None) -> None:
    """In a keeper: kill every process below this one, until none is left. As a child
    subreaper, every orphan below us became our child: a daemon cannot slip away. Without
    /proc (not Linux): the answer's process group (it made its own session)."""
    if not os.path.isdir("/proc"):
        if pgid and hasattr(os, "killpg"):
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        _reap()
        return
    me = os.getpid()
    for _ in range(500):
        table = _processes()
        below, todo = [], [me]
        while todo:
            parent = todo.pop()
            kids = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid != me]
            below += kids
            todo += kids
        alive = [pid for pid in below if table[pid][1] not in ("Z", "X")]
        if not alive:
            _reap()
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _reap()
        time.sleep(0.01)


def _reap() -> None:
    """Collect the exit status of every child that has ended (they were adopted by us)."""
    if not hasattr(os, "WNOHANG"):
        return
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _keep(spec: dict) -> None:
    """The keeper: run spec["cmd"] with its output in pipes, within its limits; then end every
    process below us, and print one JSON line. It never runs the learner's code."""
    subreaper = False
    if sys.platform.startswith("linux"):  # (not common.processes: that imports torch)
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            subreaper = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: the checker died
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, lambda signum, frame: stop.append(signum))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    proc = subprocess.Popen(spec["cmd"], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w)
    os.close(out_w)
    os.close(err_w)
    tails = {out_r: bytearray(), err_r: bytearray()}
    open_fds = [out_r, err_r]
    phases = [(Path(marker), seconds, why) for marker, seconds, why in spec["phases"]]
    start = phase_start = time.monotonic()
    reason, ended_at = "exited", None
    while True:
        now = time.monotonic()
        if stop:
            reason = "stopped"
            break
        while phases and phases[0][0].exists():  # this phase is over: the next one's clock starts
            phases.pop(0)
            phase_start = now
        limit, why = (phases[0][1], phases[0][2]) if phases else (spec["limit_s"], "time")
        if now - phase_start > limit:
            reason = why
            break
        if open_fds:
            with contextlib.suppress(InterruptedError):
                for fd in select.select(open_fds, [], [], 0.05)[0]:
                    data = os.read(fd, 1 << 16)
                    if data:
                        tails[fd] += data
                        del tails[fd][:-(1 << 16)]
                    else:
                        open_fds.remove(fd)
        else:
            time.sleep(0.05)
        if proc.poll() is not None:
            ended_at = ended_at or now
            if not open_fds or now - ended_at > 0.5:  # what it started may hold the pipes
                break
    code = proc.poll()
    _end_descendants(proc.pid if not subreaper else None)
    print(json.dumps({"code": code, "reason": reason, "subreaper": subreaper,
                      "seconds": round(time.monotonic() - start, 2),
                      "stdout": tails[out_r].decode(errors="replace"),
                      "stderr": tails[err_r].decode(errors="replace")}), flush=True)


def _answer(folder: Path) -> None:
    """The answer's process: load the learner's file, run the probe, write what it returned
    (or the NotYet it raised) to result.pt, and end at once (no atexit handler runs)."""
    import gc
    import io
    import traceback

    gc.disable()  # while torch and the check import (a third of the time: common/fork_server_start.py)
    import torch

    from common.processes import forkable_from_here, set_parent_death_signal

    if hasattr(os, "setsid"):  # a session of our own: the keeper ends its process group where /proc is missing
        with contextlib.suppress(OSError):
            os.setsid()
    set_parent_death_signal()  # the keeper dies: so do we
    spec = torch.load(folder / "spec.pt", weights_only=True)
    sys.path.insert(0, str(CHECKS_DIR))
    path = Path(spec["path"])
    probe = getattr(__import__(spec["check"]), spec["probe"])  # before the learner's code runs
    gc.freeze()  # what was imported: never walked again; the learner's code runs with the default
    gc.enable()
    forkable_from_here()  # its ranks are forked from it while it starts no thread (start_ranks)
    (folder / "ready").touch()  # the keeper's clock for the import starts now
    try:
        try:
            module = load(path)
        finally:
            (folder / "imported").touch()  # the keeper's clock for the probe starts now
        value = probe(module, *spec["args"])
        result = {"kind": "ok", "value": value}
    except NotYet as exc:
        result = {"kind": "not_yet", "text": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the learner's error, in one line
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
        what = f"SystemExit({exc.code!r})" if isinstance(exc, SystemExit) else \
            f"{type(exc).__name__}: {one_line(exc, 300)}"
        result = {"kind": "not_yet", "text": f"your code raised {what}{where(frames, str(path))}"}
    buffer = io.BytesIO()
    try:
        torch.save(result, buffer)
    except Exception as exc:  # noqa: BLE001 - a value torch.save cannot write
        buffer = io.BytesIO()
        torch.save({"kind": "not_yet", "text": f"the check could not send back what your code "
                    f"returned ({type(exc).__name__}: {one_line(exc, 200)})"}, buffer)
    with open(folder / "result.pt.tmp", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(folder / "result.pt.tmp", folder / "result.pt")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------

CHECKS_DIR = Path(__file__).resolve().parent / "checks"
sys.path.insert(0, str(CHECKS_DIR))
CHECKS: dict = {}


def all_checks() -> dict:
    """{NN: (STARTER, check)}, one entry per tools/checks/check_NN.py. Found on first use, not
    at import, so that a check file may itself import this harness at its top."""
    import importlib
    for file in sorted(CHECKS_DIR.glob("check_[0-9][0-9].py")):
        if file.stem[-2:] not in CHECKS:
            module = importlib.import_module(file.stem)
            CHECKS[file.stem[-2:]] = (module.STARTER, module.check)
    return CHECKS


def main(argv: list[str]) -> None:
    if argv[:1] == ["--keep"] and len(argv) == 2:
        return _keep(json.loads(argv[1]))
    if argv[:1] == ["--answer"] and len(argv) == 2:
        return _answer(Path(argv[1]))
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("Checked exercises (make check-NN [FILE=path]):")
        for n, (starter, fn) in sorted(all_checks().items()):
            print(f"  make check-{n}   {starter}: {(fn.__doc__ or '(no description)').strip().splitlines()[0]}")
        return
    number = argv[0].zfill(2)
    if number not in all_checks():
        fail(f"lesson {number} has no checked exercise; these do: {' '.join(sorted(CHECKS))}")
    starter, check = CHECKS[number]
    path = Path(argv[1]) if len(argv) > 1 and argv[1] else ROOT / starter
    if not path.is_file():
        fail(f"{path} not found; give the learner's file as FILE=path" if not path.exists() else
             f"{path} is not a file; give the learner's file as FILE=path")
    try:
        message = check(path.resolve())
    except NotYet as exc:
        print(f"not yet: {one_line(exc, 1000)}")
        raise SystemExit(1)
    except subprocess.TimeoutExpired:
        print("not yet: the exercise did not finish in time (does something wait forever?)")
        raise SystemExit(1)
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM or SIGHUP while ranks run
        from common.processes import signal_name
        name, code = signal_name(exc)
        fail(f"interrupted ({name}): the check was stopped, and every process it had started",
             code=code)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, RuntimeError) as exc:
        # what the answer returned is data from the learner's process: not what was asked
        print(f"not yet: what your code returned is not what the check asks for "
              f"({type(exc).__name__}: {one_line(exc, 200)})")
        raise SystemExit(1)
    print(f"ok: {message}")


if __name__ == "__main__":
    main(sys.argv[1:])
