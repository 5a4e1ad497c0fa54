"""--step in a real pseudo-terminal: pauses, resumes on Enter, quits on q with every process gone.

Every lesson, 01 to the last, as a learner starts it (`make lesson-NN STEP=1`): it pauses after
its first step (or its second, where the pause needs the process group), Enter shows the next
step, one `q` ends it within seconds, and nothing of its session is left running.
"""
import json
import os
import pty
import signal
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LAUNCHERS, ROOT, _zygote, lesson_path, make_command

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

LESSONS = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


class Terminal:
    """A lesson running in a pseudo-terminal, as if typed into a shell: a session of its own,
    the terminal its stdin, stdout, stderr and controlling terminal. forked=True: the command
    (`python script.py ...`) is a child of the test zygote (tests/zygote.py: torch already
    imported), as conftest.run's commands are; otherwise a real new process."""

    def __init__(self, *args, argv: list[str] | None = None, env: dict | None = None,
                 forked: bool = False):
        self.master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **(env or {})}
        argv = [str(a) for a in argv or [sys.executable, *args]]
        if forked and _zygote().usable(argv, env, {}, cwd=ROOT):
            self.proc = _zygote().start_in_terminal(argv, ROOT, env, os.ttyname(slave))
        else:
            assert not forked, f"not a command the zygote can run: {argv}"
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=slave, stdout=slave,
                                         stderr=slave, start_new_session=True)
        os.close(slave)
        self.text = ""

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.text)
            if m:
                self.text = self.text[m.end():]
                return m
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the lesson closed the terminal (exited)
                    chunk = ""
                self.text += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", chunk)  # drop colour codes
                if not chunk and self.proc.poll() is not None:
                    break  # it has ended and said all it will: no use waiting any longer
        if self.proc.poll() is None:
            self.proc.kill()
        raise AssertionError(f"did not see {pattern!r} within {timeout}s (exit code "
                             f"{self.proc.poll()}); got:\n{self.text[-3000:]}")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def exit_code(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            os.close(self.master)


def session_processes(sid: int) -> list[str]:
    """Processes still alive (not zombies) in session `sid`: what a lesson left running."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id
            left.append(f"{entry} {stat[stat.index('(') + 1:stat.rindex(')')]}")
    return left


THROUGH_MAKE = ("01",)  # typed as the learner types it; the others run make's command


def test_make_command_is_what_make_runs():
    """make_command follows the Makefile's lesson-% rule (`make -n` would run the lesson: the
    rule's line calls $(MAKE)). If the rule changes, change make_command with it."""
    makefile = (ROOT / "Makefile").read_text()
    assert "STEP_FLAG := $(if $(filter-out 0,$(STEP)),--step)" in makefile
    assert "$(PY) $(RUN_$(call PAD,$*)) $$f $(STEP_FLAG) $(ARGS)" in makefile
    assert "PY := $(VENV)/bin/python" in makefile and "VENV := .venv" in makefile
    assert (ROOT / ".venv/bin/python").absolute() == Path(sys.executable).absolute() or \
        os.path.samefile(ROOT / ".venv/bin/python", sys.executable)
    assert set(LAUNCHERS) == {"06", "07"} and all(v.endswith("--") for v in LAUNCHERS.values())


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_pauses_goes_on_and_quits_at_once(lesson, tmp_path):
    """make lesson-NN STEP=1, as a learner types it: the first pause, Enter, the next step's
    heading, the next pause, one `q`: the lesson ends within seconds, exit code 0, no process
    of its session is left (ranks, fork server, simulated nodes), and its $TMPDIR is empty.
    Lesson 01 through make itself; the others run make's command forked from the test zygote,
    and so is every Python that command starts (tests/zygote.py: torch already imported; the
    pty runs of every lesson cost a worker 6 minutes)."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    if lesson in THROUGH_MAKE:
        t = Terminal(argv=["make", "-s", f"lesson-{lesson}", "STEP=1", f"ARGS=--out {out}"],
                     env={"TMPDIR": str(tmp)})
    else:
        t = Terminal(argv=make_command(lesson, "--out", out, step=True), env={"TMPDIR": str(tmp)}, forked=True)
    try:
        first = t.expect(r"next: Step (\d+): .*?\n", timeout=150)
        t.expect(r"\[Enter\] next step, \[q\] quit")
        upcoming = int(first.group(1))
        time.sleep(1)
        assert f"Step {upcoming}:" not in t.text, f"lesson {lesson} did not wait for Enter"
        t.type("\n")
        t.expect(rf"Step {upcoming}: ", timeout=60)
        t.expect(r"\[Enter\] next step, \[q\] quit", timeout=150)
        t.type("q")  # one key, no Enter
        t.expect(r"Stopped at your request", timeout=10)
        assert t.exit_code(timeout=10) == 0
    finally:
        if t.proc.poll() is None:
            os.killpg(t.proc.pid, signal.SIGKILL)
    deadline = time.time() + 5
    while session_processes(t.proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_processes(t.proc.pid), f"left running: {session_processes(t.proc.pid)}"
    assert not (out / "final.pt").exists(), "it saved after the learner quit"
    assert not list(tmp.iterdir()), f"left in $TMPDIR: {[p.name for p in tmp.iterdir()]}"


def test_single_process_pauses_resumes_and_quits(tmp_path):
    t = Terminal(lesson_path("01"), "--step", "--out", tmp_path, forked=True)
    t.expect(r"Step 1: Choose the device")
    t.expect(r"done: Step 1: Choose the device - auto means")   # what just happened
    t.expect(r"next: Step 2: Make the data")                    # what comes next
    t.expect(r"\[Enter\] next step, \[q\] quit")
    time.sleep(1)
    assert "Step 2:" not in t.text, "it did not wait for Enter"
    t.type("\n")
    t.expect(r"Step 2: Make the data")
    t.expect(r"\[Enter\] next step")
    t.type("q")  # one key press, no Enter
    t.expect(r"Stopped at your request", timeout=10)
    assert t.exit_code() == 0
    assert not (tmp_path / "final.pt").exists()


def test_multi_process_rank0_asks_others_wait_and_q_ends_every_process(tmp_path):
    t = Terminal(lesson_path("05"), "--step", "--timeout", "5", "--out", tmp_path, forked=True)
    t.expect(r"next: Step 2: Join the process group")
    t.type("\n")                                          # the parent's pause after Step 1
    rows = t.expect(r"(?s)The world(.*?)\[Enter\] next step", timeout=90)
    pids = [int(p) for p in re.findall(r"│ \d+\s+│ \d+\s+│ \S+\s+│ (\d+)", rows.group(1))]
    # Wait longer than the process group's 5 s timeout: the other rank must not time out.
    time.sleep(8)
    t.type("\n")
    t.expect(r"Step 3: Split the data with DistributedSampler")
    t.expect(r"\[Enter\] next step")
    t.type("x")  # other keys do nothing
    time.sleep(1)
    assert "Stopped" not in t.text and "Step 4:" not in t.text
    t.type("q")
    t.expect(r"Stopped at your request")
    assert t.exit_code() == 0
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"rank process {pid} still runs"


def test_torchrun_workers_pause_only_once_they_can_wait_together(tmp_path):
    """Under torchrun, Step 1 runs before the process group exists: pausing there would leave
    the other ranks waiting at the rendezvous until they time out. The first pause comes after
    Step 2 and sums up both steps; waiting longer than the timeout is then harmless."""
    t = Terminal("tools/nodes.py", "--nnodes", "1", "--nproc-per-node", "2", "--",
                 lesson_path("06"), "--step", "--epochs", "1", "--timeout", "5", "--out", tmp_path, forked=True)
    first = t.expect(r"(?s)Step 1:.*?\[Enter\] next step", timeout=90).group(0)
    assert "Step 2: Join the process group" in first
    assert "done: Step 1: Read who we are" in first and "done: Step 2: Join" in first
    time.sleep(7)  # longer than the process group's 5 s timeout
    t.type("\n")
    t.expect(r"Step 3: See which rank lives on which node")
    t.expect(r"\[Enter\] next step")
    t.type("q\n")
    t.expect(r"Stopped at your request")
    assert t.exit_code(timeout=90) == 0


def test_waiting_adds_no_collective_to_the_training_group(tmp_path):
    """Rank 0's answer must not travel as a collective on the lesson's process group: the
    flight recorder of a 2-rank run whose pauses were answered (one after longer than the
    group's timeout, so rank 0 sent heartbeats) lists exactly the run's own three
    all-reduces, numbered 1, 2, 3, as a run without --step does. The run is this file as
    a script (see the bottom). Before the store carried the answer, each pause added
    broadcasts here."""
    t = Terminal(__file__, tmp_path, forked=True)
    t.expect(r"next: Step 2: second all-reduce")
    t.expect(r"\[Enter\] next step")
    time.sleep(TIMEOUT_S + 0.5)  # longer than the group's timeout: rank 1 must still wait
    t.type("\n")
    t.expect(r"next: Step 3: third all-reduce")
    t.expect(r"\[Enter\] next step")
    t.type("\n")
    t.expect(r"recorded")
    assert t.exit_code() == 0
    for rank in range(2):
        seen = json.loads((tmp_path / f"fr_{rank}.json").read_text())
        assert seen == [[1, "gloo:all_reduce"], [2, "gloo:all_reduce"], [3, "gloo:all_reduce"]], \
            (rank, seen)


TIMEOUT_S = 2  # the process group's timeout in the script below


def _fr_worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from common.distributed import die_with_parent, init_from_env, teardown
    from apparatus.ui import UI
    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    init_from_env("gloo", TIMEOUT_S)
    ui = UI(rank, 2, step_mode=True)
    for n, title in enumerate(["first all-reduce", "second all-reduce", "third all-reduce"], 1):
        ui.step(n, title)
        dist.all_reduce(torch.ones(4))
    # the flight recorder's entries of the default group (pg_id 0), as lesson 20 reads them
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    seen = [[int(e["collective_seq_id"]), e["profiling_name"]] for e in dump.get("entries", [])
            if int(e.get("pg_id", 0)) == 0]
    (Path(out) / f"fr_{rank}.json").write_text(json.dumps(seen))
    ui.print("recorded")
    teardown()


if __name__ == "__main__":  # python tests/test_step_mode.py OUT: 2 ranks, 3 steps, --step on
    from common.distributed import LOOPBACK, free_port, spawn
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()),
                      TORCH_FR_BUFFER_SIZE="100")  # the flight recorder is on from the start
    spawn(_fr_worker, (sys.argv[1],), 2)
