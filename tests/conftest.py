"""Shared helpers: run a lesson as a learner would (a subprocess with a timeout)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the lessons' own folders (lessons/NN_topic/), for their helpers: `import pipeline`
sys.path[1:1] = [str(d) for d in sorted((ROOT / "lessons").glob("[0-9][0-9]_*/"))]
# OpenMP threads that wait for work sleep instead of spinning: `make test` runs several
# multi-rank jobs on few cores at once, and spinning threads took CPU from the ranks that had
# work (measured: 3 jobs at once on 2 cores ended in 26-29 s instead of 31). It changes no
# result. Every command the tests start inherits it (set before the zygote starts).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common import lesson_module, recipe  # noqa: E402


def lesson_path(number: str) -> Path:
    matches = sorted((ROOT / "lessons").glob(f"{number}_*.py"))
    assert matches, f"no lesson {number}"
    return matches[0]


# What `make lesson-NN [STEP=1] ARGS=...` runs (the Makefile's lesson-% rule): .venv/bin/python,
# the lesson's launcher where it has one (RUN_06, RUN_07), the lesson file, --step, ARGS.
# tests/test_step_mode.py ties it to the rule. Run through conftest.run, the command itself is
# forked from the test zygote (tests/zygote.py); every Python it starts is new, as through make.
LAUNCHERS = dict(re.findall(r"^RUN_(\d\d) := (.*)$", (ROOT / "Makefile").read_text(), re.M))


def make_command(lesson: str, *args, step: bool = False) -> list[str]:
    return [sys.executable, *LAUNCHERS.get(lesson, "").split(), str(lesson_path(lesson)),
            *(["--step"] if step else []), *map(str, args)]


def import_lesson(number: str):
    """A lesson file as a module: common.lesson_module, the package's one way (its main()
    does not run)."""
    return lesson_module(number)


def parse_error(module, flags: list[str], monkeypatch, capsys) -> str:
    """Run a lesson's parse_args() in-process on bad flags; return its single error line.

    In-process, so that each case does not pay for starting Python and importing torch."""
    monkeypatch.setattr(sys, "argv", [Path(module.__file__).name, *flags])
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args()
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    return lines[0]


_ZYGOTE = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote():
    """This test process's zygote (tests/zygote.py), started on first use (by one thread:
    lesson 12's tests run two commands at a time), and again when a test has changed a
    variable torch reads as it is imported (TORCH*, OMP_* ...) in this process's environment."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or _ZYGOTE[0].stale(os.environ):
            from zygote import Zygote
            zygote = Zygote()
            zygote.start()
            if _ZYGOTE:
                _ZYGOTE.pop().stop()
            _ZYGOTE.append(zygote)
    return _ZYGOTE[0]


def described(pid: int) -> tuple[list[str], dict] | None:
    """A process's command line and environment, from /proc; None when it is gone or not ours
    to read. (A command forked from the test zygote shows the zygote's: tests/zygote.py. The
    Pythons it starts, ranks, agents and workers, are new and show their own.)"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return ([os.fsdecode(a) for a in cmdline],
            dict(os.fsdecode(e).split("=", 1) for e in environ if b"=" in e))


def run(cmd: list[str], timeout: float = 120, env: dict | None = None,
        check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run a command from the repository root; fail the test (not hang) after `timeout` s.
    `python script.py ...` runs in a child of the zygote (tests/zygote.py): a process of its
    own, as with subprocess.run, that does not import torch again (what differs from a new
    Python is listed there)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **(env or {})}
    if _zygote().usable(cmd, full_env, kwargs, cwd=ROOT):  # forked, torch already imported
        proc = _zygote().run(cmd, cwd=ROOT, env=full_env, timeout=timeout)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=full_env, stdin=subprocess.DEVNULL, **kwargs)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def run_with_line_times(cmd, timeout, env: dict | None = None):
    """Run with a watchdog: returns (returncode, [(seconds, line)], stderr), for tests that
    bound how soon after an event a failing job ends (-9 when the watchdog killed it). A
    `python script.py` command is forked from the test zygote (as run()), its stdout a FIFO
    read line by line as it comes."""
    start = time.monotonic()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not _zygote().usable(cmd, full_env, {}, cwd=ROOT):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL, env=full_env)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            lines = [(time.monotonic() - start, line) for line in proc.stdout]
            stderr = proc.stderr.read()
            proc.wait()
            lines.append((time.monotonic() - start, "<exit>"))
        finally:
            watchdog.cancel()
        return proc.returncode, lines, stderr
    import tempfile
    with tempfile.TemporaryDirectory(prefix="lines-") as folder:
        fifo = os.path.join(folder, "stdout")
        os.mkfifo(fifo)
        result: dict = {}

        def job():
            try:
                result["proc"] = _zygote().run(cmd, cwd=ROOT, env=full_env, timeout=timeout,
                                               stdout=fifo)
            except subprocess.TimeoutExpired as exc:
                result["proc"] = subprocess.CompletedProcess(cmd, -9, "", exc.stderr or "")
            finally:  # if it never opened its stdout, our open() below would wait forever
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread = threading.Thread(target=job, daemon=True)
        thread.start()
        with open(fifo, errors="replace") as reader:
            lines = [(time.monotonic() - start, line) for line in reader]
        thread.join()
    lines.append((time.monotonic() - start, "<exit>"))
    return result["proc"].returncode, lines, result["proc"].stderr


def run_lesson(number: str, *args, timeout: float = 120, check: bool = True,
               env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, str(lesson_path(number)), *map(str, args)],
               timeout=timeout, check=check, env=env)


def make_lesson(number: str, *args, timeout: float = 180, check: bool = True,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """`make lesson-NN ARGS="..."` from the repository root, exactly as the README tells a
    learner: make, then a new Python (never forked from the zygote), its launcher and its
    ranks. Each lesson's main run in its test file goes through here, so every lesson runs at
    least once in the suite the way a learner starts it."""
    flags = shlex.join(str(a) for a in args)
    return run(["make", "-s", "--no-print-directory", f"lesson-{number}", f"ARGS={flags}"],
               timeout=timeout, check=check, env=env)


def load_run(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """final.pt (loaded the safe way) and metrics.json of one lesson run, which must be a pair
    of one run (a kill between save_results' two renames leaves a new final.pt beside the
    old metrics.json: apparatus.results.matching_pair finds it)."""
    from apparatus.results import matching_pair
    assert matching_pair(folder), f"{folder}: final.pt is not the one its metrics.json names"
    state = torch.load(Path(folder) / "final.pt", weights_only=True)
    metrics = json.loads((Path(folder) / "metrics.json").read_text())
    return state, metrics


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def weights_line(diff: float, floor: float, chunks: int) -> str:
    """What a Part 2 lesson prints of its weights against lesson 13's (T.weights_gap)."""
    return (f"max |w - w_13| = {diff:.1e} (floor {floor:.1e}: lesson 13 summing each batch in "
            f"{chunks} chunks; allowed 1e-3)")


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """Assert the process failed the way a learner deserves: non-zero, one line, no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines()
             if line.strip() and not line.startswith("make")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _ignored_signals() -> list[int]:
    """The signals this process ignores: what a process it starts inherits (across exec too)."""
    import signal
    out = []
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_IGN and sig not in (signal.SIGPIPE, signal.SIGXFSZ):
                out.append(int(sig))
    return out


@pytest.fixture(scope="session", autouse=True)
def worker_temp_folder_made_first(tmp_path_factory):
    """This worker's temporary folder (popen-gwN), made once, before any test: pytest makes
    it on first use, and two threads of one module fixture asking for their first folders at
    once (lessons 12, 18, 23 run their jobs in threads) both tried to make it; one failed with
    FileExistsError and every test of the module errored (seen under 3 xdist workers)."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture(autouse=True)
def no_signal_left_ignored():
    """A test that runs lesson code in this process must not leave a signal ignored or
    blocked: every Python this worker starts afterwards inherits that (a lesson's --help once
    left SIGTERM ignored, and a later test's child could not be stopped by it)."""
    import signal

    ignored, blocked = set(_ignored_signals()), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    now_ignored, now_blocked = set(_ignored_signals()), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    left = sorted(now_ignored - ignored) + sorted(now_blocked - blocked)
    for sig in now_ignored - ignored:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert not left, f"this test left {', '.join(signal.Signals(s).name for s in left)} ignored or blocked in the test process"


@pytest.fixture(scope="session")
def reference_3_epochs() -> dict[str, torch.Tensor]:
    """The single-device answer for the default recipe (seed 0, 3 epochs)."""
    return recipe.train_reference(seed=recipe.SEED, epochs=recipe.EPOCHS)


@pytest.fixture(scope="session")
def reference_13() -> dict:
    """Lesson 13's single-device answer (seed 0, default steps): {"state", "losses"}, cached
    on disk by common/transformer.py so every Part 2 test shares one computation."""
    from common import transformer
    return transformer.train_reference()


# pytest-xdist, `make test` (--dist loadgroup): a file's tests stay together on one worker,
# since most files share a module fixture (one lesson run read by many tests). A file whose
# tests share nothing says SPREAD_OVER_WORKERS = True: each of its tests goes to whichever
# worker is free, so one long file (step mode's pty run of every lesson) no longer keeps one
# worker busy while the other has finished. tryfirst: xdist reads the marks in its own hook
# of the same name (it appends "@group" to each test's id), which otherwise ran before this
# one, so no mark was seen and a file's module fixtures ran again on every worker it reached
# (seen in CI's junit: bench's 75 s fixture, twice).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and not getattr(module, "SPREAD_OVER_WORKERS", False):
            item.add_marker(pytest.mark.xdist_group(module.__name__))
