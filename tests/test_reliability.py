"""Attacks from outside (issue: reliability), each one that once failed, kept failing-proof.

Whatever stops a launcher stops every process under it and nothing is saved afterwards;
single-machine runs listen on 127.0.0.1 only; a second job on the same port or --out stops
at once and leaves the first alone; data files never run code; downloads give up; bad
flags and bad snapshots are one line at start-up. Every run here is bounded in time and
killed early: the whole file is meant to stay well under a minute and a half.
"""
import errno
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _zygote, described, one_error_line, run

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

PY = sys.executable
NODES = [PY, "tools/nodes.py"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}


# --- watching a job from outside ---------------------------------------------------------

def _sigint_as_in_a_terminal() -> None:
    """In the child, before Python starts: Ctrl-C's signal does what it does in a learner's
    terminal. A shell that starts the tests in the background (`make test &`, nohup, some CI
    runners) ignores SIGINT, children inherit that, and Python then never raises
    KeyboardInterrupt (seen: a job that trained on after SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """A lesson started as a learner would, in its own session, output in files. Forked from
    the test zygote (tests/zygote.py), as are the ranks, agents and workers it starts, unless
    forked=False: a new Python, for what happens while one imports torch."""

    def __init__(self, cmd, folder: Path, name: str, env: dict | None = None, forked=True):
        self.out, self.err = folder / f"{name}.stdout", folder / f"{name}.stderr"
        cmd, env = [str(c) for c in cmd], {**ENV, **(env or {})}
        if forked and _zygote().usable(cmd, env, {}, cwd=ROOT):
            self.out.write_text("")
            self.err.write_text("")
            self.proc = _zygote().start_command(cmd, ROOT, env, self.out, self.err)
            return
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.out, "w"),
                                     stderr=open(self.err, "w"), stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True,
                                     preexec_fn=_sigint_as_in_a_terminal)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stdout():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.stderr()[-2000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s"
            time.sleep(0.05)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)


class TerminalJob(Job):
    """A job whose stdout and stderr are a pseudo-terminal, as in a learner's shell: rich
    draws its live progress bar there and hides the cursor while it does."""

    def __init__(self, cmd, folder: Path, name: str):
        import pty
        master, slave = pty.openpty()
        self.raw = b""
        cmd, env = [str(c) for c in cmd], {**ENV, "TERM": "xterm-256color"}
        if _zygote().usable(cmd, env, {}, cwd=ROOT):  # forked, as Job
            # It opens the terminal by its name: we keep our end of it open until the job has
            # ended (with no end open, reading the master fails at once).
            self.proc = _zygote().start_command(cmd, ROOT, env, os.ttyname(slave), os.ttyname(slave))
        else:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave,
                                         stderr=slave, env=env, start_new_session=True)
            os.close(slave)
            slave = None

        def drain():  # read everything, or the job would block on a full terminal
            import select
            while True:
                if slave is not None and not select.select([master], [], [], 0.2)[0]:
                    if self.proc.poll() is not None:
                        break  # it has ended, and said all it had to say
                    continue
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                self.raw += chunk
            os.close(master)
            if slave is not None:
                os.close(slave)
        self.reader = threading.Thread(target=drain, daemon=True)
        self.reader.start()

    def stdout(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.raw.decode(errors="replace"))

    stderr = stdout


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> str:
    """Its command line, as a new Python's would be also when it was forked from the zygote."""
    seen = described(pid)
    return " ".join(seen[0]) if seen else ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pids_mentioning(text: str) -> set[int]:
    """Processes whose command line holds `text` (a test's unique --out path)."""
    return {p for p in all_pids() if p != os.getpid() and text in cmdline(p) and alive(p)}


def table_pids(stdout: str) -> set[int]:
    """The pids in the lesson's rank tables (the `pid` column of rich's tables)."""
    found, column = set(), None
    for line in stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[┃│]", line)[1:-1]]
        if "pid" in cells:
            column = cells.index("pid")
        elif column is not None and line.startswith("│") and len(cells) > column:
            if cells[column].isdigit():
                found.add(int(cells[column]))
    return found


def gone_within(pids: set[int], seconds: float) -> set[int]:
    """Wait until none of `pids` is alive; return those still alive after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return set()
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


def listening(pids: set[int]) -> list[str]:
    """host:port of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_inode = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
                if with_inode:
                    inodes.add(with_inode[1])
        except OSError:
            continue
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not os.path.exists(table):
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            if v6:  # four 32-bit words, each little-endian
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                host = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                host = socket.inet_ntop(socket.AF_INET, raw[::-1])
            found.append(f"{host}:{int(port, 16)}")
    return found


def loopback_only(addresses: list[str]) -> bool:
    return all(a.rsplit(":", 1)[0] in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for a in addresses)


@pytest.fixture
def cleanup():
    """Whatever a failing test leaves behind is killed here, not left running."""
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        if job.proc.poll() is None:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.proc.wait()


# --- lesson 05: mp.spawn ----------------------------------------------------------------------

def test_lesson_05_second_job_and_sigint_to_the_parent_alone(tmp_path, cleanup):
    """Same port, same --out, store on loopback, then SIGINT to the parent's pid only (what
    an IDE's stop button sends): every rank ends within seconds, nothing is saved."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    first = tmp_path / "first"
    # MASTER_ADDR/MASTER_PORT from the environment are honoured, as PyTorch's docs teach
    job = Job([PY, "lessons/05_ddp_spawn.py", "--epochs", "400", "--out", first], tmp_path, "a",
              env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(number)})
    cleanup.append(job)
    job.wait_for("Step 6: Train")
    assert f"the store listens on 127.0.0.1:{number}" in job.stdout()
    ranks = table_pids(job.stdout())
    assert len(ranks) == 2
    every = ranks | {job.proc.pid}
    held = listening(every)
    assert held and loopback_only(held), held  # the store: on 127.0.0.1 only
    # a second job on the same port stops at once with one line, and leaves us alone; so
    # does one on the same --out (another port). Both started together, to save time.
    same_port = subprocess.Popen([PY, "lessons/05_ddp_spawn.py", "--master-port", str(number),
                                  "--out", str(tmp_path / "second")], cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    same_out = subprocess.Popen([PY, "lessons/05_ddp_spawn.py", "--out", str(first)], cwd=ROOT,
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for proc, expect in ((same_port, [f"port {number}", "already in use"]),
                         (same_out, ["in use by another job", f"pid {job.proc.pid}"])):
        stdout, stderr = proc.communicate(timeout=60)
        line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
        assert all(e in line for e in expect), line
    assert job.proc.poll() is None and all(alive(p) for p in ranks)  # the first job still trains
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.wait(20) == 130
    assert not gone_within(every, 5)
    assert job.stderr().strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C)")
    assert "nothing was saved" in job.stderr()
    assert not (first / "final.pt").exists() and not (first / "metrics.json").exists()


def session_pids(sid: int) -> set[int]:
    """Live processes (not zombies) of session `sid`: the job and everything under it."""
    found = set()
    for pid in all_pids():
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.add(pid)
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_signal_while_the_ranks_start_is_one_line_and_leaves_nothing(tmp_path, cleanup, how):
    """Ctrl-C (SIGINT to the whole terminal group) or SIGTERM (to the launcher alone) while
    the fork server is still importing torch and the lesson: one line, the usual exit code,
    no traceback from the server or a rank forked afterwards, and no process left (the fork
    server used to outlive the job by 4-11 s, and Ctrl-C printed its KeyboardInterrupt).
    Lesson 08's ranks come from a fork server: its process hosts the store, a thread."""
    job = Job([PY, "lessons/08_no_sync_accumulation.py", "--out", tmp_path / "o"], tmp_path, "a",
              forked=False)  # a new Python: its fork server imports torch for a while
    cleanup.append(job)
    deadline = time.monotonic() + 60
    while not any("forkserver" in cmdline(pid) for pid in session_pids(job.proc.pid)):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr()
        time.sleep(0.02)
    time.sleep(0.3 if how == "ctrl-c" else 1.0)
    if how == "ctrl-c":
        os.killpg(job.proc.pid, signal.SIGINT)
    else:
        os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(30) == (130 if how == "ctrl-c" else 143)
    time.sleep(0.5)  # a traceback printed by a straggler would land by now
    assert "Traceback" not in job.stderr() + job.stdout(), job.stderr()
    assert one_error_line(subprocess.CompletedProcess([], 1, "", job.stderr())).startswith(
        "error: interrupted")
    deadline = time.monotonic() + 3
    while session_pids(job.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_pids(job.proc.pid), [cmdline(p) for p in session_pids(job.proc.pid)]
    assert not (tmp_path / "o" / "final.pt").exists()


@pytest.mark.parametrize("lesson", ["05_ddp_spawn", "13_transformer_memory", "15_zero_fsdp",
                                    "21_context_parallel", "22_expert_parallel", "24_local_sgd_diloco"])
def test_ctrl_c_while_torch_imports_is_one_line(tmp_path, cleanup, lesson):
    """Ctrl-C in a lesson's first seconds, while it imports torch (issue 34: a KeyboardInterrupt
    traceback in these six): the line a Ctrl-C gets later, exit code 130, nothing else. Each
    lesson imports common first, which handles Ctrl-C until common.cli.run starts main()."""
    job = Job([PY, f"lessons/{lesson}.py", "--out", tmp_path / "o"], tmp_path, "a",
              forked=False)  # a new Python: it imports torch for a second or more
    cleanup.append(job)
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{job.proc.pid}/maps").read_text():  # torch is loading
        assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr()
        time.sleep(0.01)
    os.killpg(job.proc.pid, signal.SIGINT)
    assert job.wait(30) == 130
    assert job.stderr().strip() == "interrupted (Ctrl-C): nothing was saved for this run", job.stderr()
    assert "Step 1" not in job.stdout()


def test_lesson_18_leaves_nothing_in_tmpdir(tmp_path):
    """Lesson 18 left $TMPDIR/torchinductor_$USER on every run, --help included: importing
    torch.distributed.pipelining imports torch._dynamo, which makes inductor's cache folder
    (torch 2.14.1, torch/_inductor/runtime/cache_dir_utils.py), and the lesson imported it
    before common, which points TORCHINDUCTOR_CACHE_DIR into runs/. A new Python, without the
    variable this test process has (conftest imports common)."""
    env = {k: v for k, v in ENV.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    for flags in (["--help"], ["--steps", "2", "--out", str(tmp_path / "o")]):
        proc = subprocess.run([PY, "lessons/18_pipeline_schedules.py", *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**env, "TMPDIR": str(tmp)}, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("torchinductor")], flags


def _ranks_of(job: "Job") -> list[int]:
    """The job's ranks, in its session: the children of its fork server, or of the job's own
    process with its command line (forked from it: common/processes.py's start_ranks)."""
    def parent(pid):
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[1])
    mine = session_pids(job.proc.pid)
    servers = {p for p in mine if "forkserver" in cmdline(p)}
    forked = {p for p in mine if parent(p) == job.proc.pid and cmdline(p) == cmdline(job.proc.pid)}
    return sorted(p for p in mine if parent(p) in servers) or sorted(forked)


@pytest.mark.parametrize("lesson, training", [("21_context_parallel", "Step 6: Train"),
                                              ("15_zero_fsdp", "Step 4: Train")])
def test_a_stopped_rank_is_named_not_the_one_that_waited(tmp_path, cleanup, lesson, training):
    """SIGSTOP of one rank mid-training: the other timed out waiting for it and took the blame
    ("rank 0 failed with ... Timed out"). start_ranks looks for a stopped rank when another
    gives up, and names it, with its pid; nothing is left running."""
    job = Job([PY, f"lessons/{lesson}.py", "--steps", "100000", "--timeout", "5", "--out", tmp_path / "o"],
              tmp_path, "a", forked=False)  # a new Python: its ranks are its own children
    cleanup.append(job)
    job.wait_for(training, timeout=180)
    ranks = _ranks_of(job)
    assert len(ranks) == 2, ranks
    victim = ranks[1]
    os.kill(victim, signal.SIGSTOP)
    assert job.wait(60) == 1
    line = one_error_line(subprocess.CompletedProcess([], 1, "", job.stderr()))
    assert f"(pid {victim}) was stopped (SIGSTOP, or Ctrl-Z) and did not answer" in line, line
    assert "rank 0 failed" not in line
    assert not gone_within(set(ranks), 5)


def test_make_killed_with_sigkill_takes_the_whole_job(tmp_path, cleanup):
    """kill -9 of `make lesson-05` itself, the launcher the learner typed (issue 35): the job
    trained on (6 processes after 5 s, results written 10-15 s later). The recipe execs the
    Python, so make is its parent, and the lesson dies with make (die_with_make), its ranks
    (mp.spawn's) with it: within seconds nothing of the job is left, nothing is written.
    The lesson's own death is a SIGKILL (the kernel's, when make goes), so this is also the
    test of a lesson killed with kill -9: its ranks go with it (die_with_parent)."""
    out = tmp_path / "o"
    job = Job(["make", "--no-print-directory", "lesson-05", f"ARGS=--epochs 400 --out {out}"],
              tmp_path, "make", forked=False)  # make is no Python: a new process, its own session
    cleanup.append(job)
    job.wait_for("Step 6: Train", timeout=120)
    every = session_pids(job.proc.pid)
    assert len(table_pids(job.stdout()) & every) == 2 and len(every) >= 4, every  # make, lesson, 2 ranks
    before = sorted(p.name for p in out.iterdir())
    os.kill(job.proc.pid, signal.SIGKILL)
    job.wait(10)
    left = gone_within(every - {job.proc.pid}, 5)
    described_left = [cmdline(p) for p in left]
    for pid in left:  # (a failure leaves nothing running either)
        os.kill(pid, signal.SIGKILL)
    assert not left, described_left
    time.sleep(2)  # anything still writing would have written by now
    assert sorted(p.name for p in out.iterdir()) == before and not (out / "final.pt").exists()


@pytest.mark.parametrize("lesson, flags, training, server", [
    ("16_distributed_checkpoint", ["--steps", "400"], "Step 4: Train", False),  # forked from the job
    ("08_no_sync_accumulation", ["--epochs", "400"], "Step 5: Accumulate", True)])  # its store: a thread
def test_a_killed_job_takes_its_ranks_at_once_and_leaves_no_temporary_file(cleanup, lesson, flags,
                                                                            training, server):
    """SIGKILL of a lesson whose ranks were forked from it, or came from the fork server
    (common/processes.py): the ranks go at once, and $TMPDIR is left as it was. The server,
    left alone, used to tear torch down for 5-30 s while the ranks trained on; the job's pymp-*
    folder stayed behind, and the resource tracker printed "leaked semaphore objects" after the
    shell's prompt."""
    # a short $TMPDIR: under a deep one (pytest's own folders on CI) the job puts its socket's
    # folder in /tmp instead (a Unix socket's path has at most 107 bytes: common/processes.py)
    tmp = Path(tempfile.mkdtemp(prefix="kill-", dir="/tmp"))
    try:
        out = tmp.with_name(tmp.name + "-out")  # the job's output and logs, beside
        out.mkdir()
        job = Job([PY, f"lessons/{lesson}.py", *flags, "--out", out / "o"], out, "a", env={"TMPDIR": str(tmp)})
        cleanup.append(job)
        job.wait_for(training, timeout=120)
        assert any(p.name.startswith("pymp-") for p in tmp.iterdir()) == server  # the server's socket
        os.kill(job.proc.pid, signal.SIGKILL)
        job.wait(10)
        deadline = time.monotonic() + 5
        while session_pids(job.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session_pids(job.proc.pid), [cmdline(p) for p in session_pids(job.proc.pid)]
        time.sleep(1)  # a warning from a straggler would land by now
        assert not list(tmp.iterdir()), list(tmp.iterdir())
        assert "leaked" not in job.stderr() and "Traceback" not in job.stderr(), job.stderr()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-out"), ignore_errors=True)


# --- lessons 06 and 07: tools/nodes.py and torchrun -----------------------------------------------

def test_lesson_06_sighup_to_the_launcher_stops_every_agent_and_worker(tmp_path, cleanup):
    """In a terminal: afterwards no process of the job is left, and the cursor that rank 0's
    progress bar hid is shown again."""
    out = tmp_path / "run06"
    job = TerminalJob([*NODES, "--nnodes", "2", "--nproc-per-node", "1", "--",
               "lessons/06_torchrun_multinode.py", "--epochs", "400", "--out", out], tmp_path, "a")
    cleanup.append(job)
    job.wait_for("epoch  1 |", timeout=90)  # training, with rank 0's progress bar drawn
    everyone = pids_mentioning(str(out)) | table_pids(job.stdout())
    assert len(everyone) >= 5  # launcher, 2 agents, 2 workers
    held = listening(everyone)
    assert held and loopback_only(held), held
    os.kill(job.proc.pid, signal.SIGHUP)
    assert job.wait(30) == 129
    assert not gone_within(everyone, 5)
    assert not pids_mentioning(str(out))
    job.reader.join(5)
    assert job.stderr().strip().splitlines()[-1].startswith("error: interrupted (SIGHUP)")
    assert not (out / "final.pt").exists()
    hidden, shown = job.raw.rfind(b"\x1b[?25l"), job.raw.rfind(b"\x1b[?25h")
    assert hidden >= 0 and shown > hidden, "the terminal's cursor was left hidden"


def test_lesson_06_names_the_rank_that_was_killed(tmp_path, cleanup):
    """SIGKILL of the last rank (node 1): node 0's rank fails with 'Connection closed by
    peer'; the summary must name the killed rank, whose death torchrun logged."""
    out = tmp_path / "run06"
    job = Job([*NODES, "--nnodes", "2", "--nproc-per-node", "1", "--",
               "lessons/06_torchrun_multinode.py", "--epochs", "400", "--out", out], tmp_path, "a")
    cleanup.append(job)
    job.wait_for("Step 4: Train with DDP", timeout=90)
    rows = re.findall(r"^│ (\d)\s+│ \d\s+│ \d\s+│ \S+\s+│ (\d+)", job.stdout(), re.M)
    victim = dict((int(r), int(p)) for r, p in rows)[1]
    os.kill(victim, signal.SIGKILL)
    assert job.wait(60) == 1
    last = job.stderr().strip().splitlines()[-1]
    assert "rank 1 on node 1 failed first: killed by SIGKILL" in last, last
    assert not gone_within(pids_mentioning(str(out)), 5)


def test_lesson_07_sigterm_to_the_launcher_and_a_second_job_on_the_same_out(tmp_path, cleanup):
    out = tmp_path / "run07"
    cmd = [*NODES, "--elastic", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3",
           "--", "lessons/07_elastic.py", "--fail-at-step", "0", "--step-delay", "0.2",
           "--out", out]
    job = Job(cmd, tmp_path, "a")
    cleanup.append(job)
    job.wait_for("Step 5: Train", timeout=90)
    everyone = pids_mentioning(str(out)) | table_pids(job.stdout())
    held = listening(everyone)
    assert held and loopback_only(held), held  # the rendezvous store and the workers' store
    log = out / "nodes" / "node-0.log"
    before = log.read_text()
    line = one_error_line(run(cmd, check=False, timeout=60))  # the same job again
    assert "in use by another job" in line
    assert log.read_text().startswith(before)  # not overwritten
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(30) == 143
    assert not gone_within(everyone, 5)
    assert not pids_mentioning(str(out))
    assert not (out / "final.pt").exists()


def test_lesson_07_agent_killed_with_sigkill_takes_its_workers(tmp_path, cleanup):
    out = tmp_path / "run07"
    job = Job([*NODES, "--elastic", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts",
               "3", "--", "lessons/07_elastic.py", "--fail-at-step", "0", "--step-delay", "0.2",
               "--out", out], tmp_path, "a")
    cleanup.append(job)
    job.wait_for("Step 5: Train", timeout=90)
    workers = table_pids(job.stdout())
    agents = {p for p in pids_mentioning(str(out)) if "torch.distributed.run" in cmdline(p)}
    assert len(workers) == 2 and len(agents) == 1
    os.kill(agents.pop(), signal.SIGKILL)
    assert not gone_within(workers, 5), "workers trained on without their agent"
    assert job.wait(30) == 1
    assert not (out / "final.pt").exists()


def test_lesson_07_usage_error_is_not_restarted(tmp_path):
    proc = run([*NODES, "--elastic", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts",
                "3", "--", "lessons/07_elastic.py", "--fail-rank", "5", "--out", tmp_path],
               check=False, timeout=90)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "--fail-rank 5" in line
    assert "will restart" not in proc.stderr


def test_out_that_is_a_file_or_too_long_fails_at_start_up(tmp_path, capsys):
    """In-process: the launcher stops before starting any agent (so lesson 07 cannot burn
    its restarts on it), and a lesson checks --out before it trains."""
    sys.path.insert(0, str(ROOT / "tools"))
    import nodes  # tools/nodes.py, the launcher
    from apparatus.results import claim_out
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for call in (lambda: nodes.main(["--elastic", "--nnodes", "1", "--", "lessons/07_elastic.py",
                                     "--out", str(blocker)]),
                 lambda: claim_out(tmp_path / ("x" * 300))):
        with pytest.raises(SystemExit) as info:
            call()
        assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert "is a file, not a folder" in lines[0] and "longer than 255 bytes" in lines[1]
    assert not pids_mentioning(str(blocker))


# --- in-process: flags, files, data ----------------------------------------------------------

def test_flags_that_cannot_work_are_refused():
    import argparse

    from common.cli import positive_float, seed_number
    for bad in ("inf", "nan", "-1", "1e300"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        seed_number(str(10**30))
    assert seed_number("7") == 7


def test_outputs_belong_together_and_are_readable(tmp_path):
    from apparatus.results import matching_pair, save_results
    stray = tmp_path / ".final.pt.abc.tmp"
    tmp_path.mkdir(exist_ok=True)
    stray.write_bytes(b"half")
    save_results(tmp_path, {"w": torch.ones(2)}, {"seed": 0})
    assert not stray.exists()
    assert matching_pair(tmp_path)
    for name in ("final.pt", "metrics.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~current_umask()
    # a final.pt from another run next to this metrics.json is detected
    torch.save({"w": torch.zeros(2)}, tmp_path / "final.pt")
    assert not matching_pair(tmp_path)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_full_disk_is_one_line(tmp_path, capsys):
    from apparatus.results import atomic_write

    def no_space(f):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(SystemExit) as info:
        atomic_write(tmp_path / "final.pt", no_space)
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0]
    assert not list(tmp_path.iterdir())  # no temporary file left


def test_a_pair_from_two_runs_is_found_by_whoever_reads_it(tmp_path):
    """Lesson 13 killed between save_results' two renames: its new final.pt beside the earlier
    run's metrics.json. metrics.json names its final.pt's sha256; the tests read every run
    through load_run, which checks the pair (matching_pair), as tools/gpu_check.py does."""
    from apparatus.results import matching_pair, save_results
    from conftest import load_run
    first, second = tmp_path / "first", tmp_path / "second"
    save_results(first, {"w": torch.ones(3)}, {"lesson": "13"})
    save_results(second, {"w": torch.zeros(3)}, {"lesson": "13"})
    assert matching_pair(first) and load_run(first)[1]["lesson"] == "13"
    shutil.copy(second / "final.pt", first / "final.pt")  # the first rename done, the second not
    assert not matching_pair(first)
    with pytest.raises(AssertionError, match="final.pt is not the one its metrics.json names"):
        load_run(first)


def test_an_empty_out_is_refused_before_anything_is_written(tmp_path):
    """`--out ""` wrote final.pt, metrics.json and .lock into the current folder (lesson 24):
    every lesson's out_dir refuses it (and "."), in one line, before anything is written."""
    proc = subprocess.run([PY, ROOT / "lessons" / "24_local_sgd_diloco.py", "--out", ""], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=ENV, stdin=subprocess.DEVNULL)
    line = one_error_line(proc)
    assert proc.returncode == 2 and '--out is empty (or ".")' in line and "Step 1" not in proc.stdout, line
    assert list(tmp_path.iterdir()) == []


def test_an_out_path_with_rich_markup_is_printed_as_text(tmp_path):
    """--out "a[/]b" crashed lesson 13 with rich's MarkupError after it had trained (a path went
    into ui.print's markup); [bold] was swallowed. apparatus.results.shown escapes a path for
    rich: the run ends, and prints the path as typed."""
    out = tmp_path / "runs[/]x[bold]y"
    proc = run([PY, "lessons/13_transformer_memory.py", "--steps", "3", "--out", out], check=False, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"wrote {out}/final.pt and {out}/metrics.json" in proc.stdout
    assert (out / "final.pt").exists()


def _with_file_size_limit(tmp_path: Path, limit: int, code: str) -> Path:
    """A script that runs `code` under RLIMIT_FSIZE: a write past `limit` bytes fails as on a
    full disk (EFBIG, "File too large"), for root or not, with no file system to fill."""
    script = tmp_path / "limited.py"
    script.write_text(f"import resource, runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n{code}\n")
    return script


def test_a_full_disk_in_torch_save_is_one_line_and_keeps_the_earlier_results(tmp_path):
    """torch.save on a full disk raised a C++ RuntimeError ("[enforce fail at
    inline_container.cc:672] . unexpected pos"), a traceback in lesson 13: now one line, and
    the earlier final.pt and metrics.json as they were (both files are written before either
    is renamed)."""
    from apparatus.results import matching_pair, save_results
    folder = tmp_path / "o"
    save_results(folder, {"w": torch.ones(3)}, {"lesson": "13"})  # an earlier run's pair
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    script = _with_file_size_limit(tmp_path, 1 << 16, "import torch\nfrom apparatus.results import save_results\n"
                                   f"save_results({str(folder)!r}, {{'w': torch.zeros(1 << 18)}}, {{'lesson': '13'}})")
    proc = run([PY, script], check=False, timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 1 and "could not write" in line and "(File too large)" in line, line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and matching_pair(folder)


def test_an_out_on_a_full_disk_is_refused_before_training(tmp_path):
    """A full --out failed only at the save, after training (lessons 21, 22): claim_out now
    writes 64 KiB there first (a full disk still takes an empty file)."""
    out = tmp_path / "o"
    script = _with_file_size_limit(tmp_path, 1 << 12, f"sys.argv = ['22', '--out', {str(out)!r}]\n"
                                   f"runpy.run_path({str(ROOT / 'lessons' / '22_expert_parallel.py')!r}, run_name='__main__')")
    proc = run([PY, script], check=False, timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 2 and f"--out {out} cannot be written (File too large)" in line, line
    assert "Step 2" not in proc.stdout and not (out / "final.pt").exists()


def test_bad_snapshot_fields_are_refused(tmp_path):
    from common import recipe
    from apparatus.state_dicts import snapshot_problem
    model = recipe.make_model(0)
    good = {"format": 1, "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": recipe.make_optimizer(model).state_dict(), "epoch": 1,
            "step_in_epoch": 8, "global_step": 40, "seed": 0, "dataset": "synthetic",
            "global_batch": 96, "world_size": 2, "restart_count": 0, "losses": [0.5] * 40,
            "samples": torch.zeros(40, 96, dtype=torch.long)}
    expected = {"format": 1, "seed": 0, "dataset": "synthetic", "global_batch": 96,
                "steps_per_epoch": 32}
    assert snapshot_problem(good, good, expected, 96, "--epochs 3") is None
    negative = {**good, "global_step": -5}
    assert "global_step -5" in snapshot_problem(negative, good, expected, 96, "--epochs 3")
    nan = {**good, "model": {**good["model"], "fc1.weight": good["model"]["fc1.weight"] * math.nan}}
    assert "NaN" in snapshot_problem(nan, good, expected, 96, "--epochs 3")
    short = {**good, "losses": [0.5] * 3}
    assert "loss curve" in snapshot_problem(short, good, expected, 96, "--epochs 3")


def test_a_crafted_cifar_batch_does_not_run_code(tmp_path, capsys):
    from common.datasets import load_cifar10
    from test_datasets import write_cifar10
    write_cifar10(tmp_path)
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_2", "wb") as f:
        pickle.dump({"data": Evil(), "labels": [1]}, f)
    with pytest.raises(SystemExit):
        load_cifar10(tmp_path, download=False)
    assert not marker.exists(), "the pickle ran code"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data_batch_2" in err[0] and "refused" in err[0]


@pytest.fixture
def silent_proxy():
    """A server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("name", ["cifar10", "mnist"])
def test_a_download_that_never_answers_gives_up(tmp_path, capsys, monkeypatch, silent_proxy, name):
    from common import datasets
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, silent_proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setenv("LESSON_DOWNLOAD_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(SystemExit):
        (datasets.load_cifar10 if name == "cifar10" else datasets.load_mnist)(tmp_path, True)
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: could not download") and "add --download" not in err, err


@pytest.mark.parametrize("which", ["lesson 13's reference (21 and every Part 2 lesson)", "lesson 22's one-process MoE"])
def test_a_checkout_that_cannot_be_written_still_gets_its_reference(tmp_path, monkeypatch, which):
    """A read-only checkout: lessons 21 and 22 failed at the end, writing their reference's
    cache into the repository's runs/. The cache is kept where it can be, and nowhere else:
    the answer still comes back. (A file where runs/ should be stands for a read-only
    checkout: root ignores permissions, not a file in the way.)"""
    from common import transformer as T
    import moe  # lessons/22_expert_parallel/moe.py
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "runs").write_text("not a folder")
    if which.startswith("lesson 13"):
        monkeypatch.setattr(T, "ROOT", checkout)
        result = T.train_reference(seed=5, steps=2)
        assert len(result["losses"]) == 2 and set(result["state"]) == set(T.make_model(0).state_dict())
    else:
        monkeypatch.setattr(moe, "ROOT", checkout)
        setup = moe.Setup(seed=5, experts=2, top_k=1, factor=1.0, dtype="float32")
        assert len(moe.train_single(setup, 2)["losses"]) == 2
    assert (checkout / "runs").read_text() == "not a folder" and sorted(p.name for p in checkout.iterdir()) == ["runs"]
