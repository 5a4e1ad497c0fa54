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

    def _read(self, wait: float) -> bool:
        """Add what the terminal printed within `wait` seconds to self.text; False once the
        command has ended and said all it will."""
        ready, _, _ = select.select([self.master], [], [], wait)
        if ready:
            try:
                chunk = os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the lesson closed the terminal (exited)
                chunk = ""
            self.text += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", chunk)  # drop colour codes
            if not chunk and self.proc.poll() is not None:
                return False
        return True

    def drain(self, seconds: float) -> str:
        """Whatever the terminal shows during the next `seconds` (for "nothing more came")."""
        deadline = time.time() + seconds
        while time.time() < deadline and self._read(min(0.1, max(deadline - time.time(), 0))):
            pass
        return self.text

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.text)
            if m:
                self.text = self.text[m.end():]
                return m
            if not self._read(0.2):
                break  # it has ended and said all it will: no use waiting any longer
        if self.proc.poll() is None:
            self.proc.kill()
        raise AssertionError(f"did not see {pattern!r} within {timeout}s (exit code "
                             f"{self.proc.poll()}); got:\n{self.text[-3000:]}")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def exit_code(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
            self.drain(0.2)  # what it printed last, for a failure's message
            return code
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
# Where a lesson pauses does not depend on how long it trains, so each runs as few epochs or
# steps as its checks accept (Part 1: 1 epoch of 3; Part 2: 4 optimizer steps of 120; 24: two
# outer steps of H = 8; 27: one bug of its six; 29: 6 steps, which its timing needs): the file's time goes to the pauses, not
# to training its lesson's own test already checks. Lesson 07 keeps its default: its failure
# and restart happen mid-run.
SHORT = {**{n: ["--epochs", "1"] for n in ("01", "03", "04", "05", "06", "08", "09", "12", "20")},
         **{n: ["--steps", "4"] for n in ("13", "14", "15", "16", "17", "18", "19", "21", "22", "26")},
         "24": ["--steps", "16"], "27": ["--bug", "late-sync-flag", "--steps", "4"], "29": ["--steps", "6"]}


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


# Where a lesson cannot pause between two steps, and why (its doc says so too).
NO_PAUSE_BEFORE: dict[str, dict[int, str]] = {
    "07": {2: "torchrun's c10d rendezvous lends the ranks no store: until Step 2 makes one, "
              "the other ranks could only wait for rank 0 at the rendezvous, and time out"},
}
# Lessons whose default run starts its ranks again mid-way (lesson 07: a rank dies, torchrun
# restarts them all, and they show Step 1 again and resume from the snapshot).
RESTARTS = {"07"}


def doc_step_numbers(lesson: str) -> list[int]:
    """The `## Step N:` sections of the lesson's doc, in order: the steps a learner reads."""
    from apparatus.ui import doc_steps
    return list(doc_steps(str(lesson_path(lesson))))


def walk(t: Terminal, last: int, timeout: float = 300) -> list:
    """Answer Enter at every pause until the one before Step `last`, then `q`. Returns what
    the terminal showed, in order: each step heading's number, and "pause" for each prompt."""
    shown: list = []
    while True:
        m = t.expect(r"(?m)^Step (\d+): |\[Enter\] next step, \[q\] quit", timeout=timeout)
        if m.group(1):
            shown.append(int(m.group(1)))
            continue
        shown.append("pause")
        upcoming = re.findall(r"next: Step (\d+):", m.string[:m.start()])
        if upcoming and int(upcoming[-1]) == last:
            t.type("q")  # one key, no Enter
            return shown
        # A lesson that did not wait prints its next heading at once, within milliseconds;
        # 0.1 s at each of about 200 pauses (0.3 s took a minute of the suite waiting). The
        # single-process and multi-process tests below wait a whole second at one pause.
        assert not re.search(r"(?m)^Step \d+: ", t.drain(0.1)), f"it did not wait for Enter: {t.text!r}"
        t.type("\n")


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_pauses_at_every_step_and_quits_at_once(lesson, tmp_path):
    """make lesson-NN STEP=1 (with SHORT flags), as a learner types it, answered with Enter at every pause: a
    pause between every two step headings, wherever each step runs (the parent before the
    ranks start, the ranks before their process group exists or after it is gone), and a
    heading for every `## Step N` of the doc. One `q` at the last pause: the lesson ends
    within seconds, exit code 0, no process of its session is left (ranks, fork server,
    simulated nodes), and its $TMPDIR is empty. Lesson 01 through make itself; the others run
    make's command forked from the test zygote, and so is every Python that command starts
    (tests/zygote.py: torch already imported)."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    steps = doc_step_numbers(lesson)
    if lesson in THROUGH_MAKE:
        t = Terminal(argv=["make", "-s", f"lesson-{lesson}", "STEP=1",
                           f"ARGS=--out {out} {' '.join(SHORT.get(lesson, []))}"],
                     env={"TMPDIR": str(tmp)})
    else:
        t = Terminal(argv=make_command(lesson, "--out", out, *SHORT.get(lesson, []), step=True),
                     env={"TMPDIR": str(tmp)}, forked=True)
    assert steps, f"docs/{lesson_path(lesson).stem}.md has no '## Step N:' sections"
    try:
        shown = walk(t, last=steps[-1])
        t.expect(r"Stopped at your request", timeout=30)
        code = t.exit_code(timeout=30)
        assert code == 0, f"exit code {code} after q; it printed:\n{t.text[-3000:]}"
    finally:
        if t.proc.poll() is None:
            os.killpg(t.proc.pid, signal.SIGKILL)
    expected = []
    for n in steps[:-1]:
        expected += [n] + ([] if n + 1 in NO_PAUSE_BEFORE.get(lesson, {}) else ["pause"])
    attempts = [[]]  # a restart (lesson 07) shows Step 1 again: check each attempt's pauses
    for item in shown:
        if item == steps[0] and attempts[-1] and lesson in RESTARTS:
            attempts.append([])
        attempts[-1].append(item)
    for attempt in attempts[:-1]:  # cut short by the failure that restarted the ranks
        assert attempt == expected[:len(attempt)], f"lesson {lesson}: shown {attempt}, expected {expected}"
    assert attempts[-1] == expected, f"lesson {lesson}: shown {attempts[-1]}, expected {expected}"
    deadline = time.time() + 5
    while session_processes(t.proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_processes(t.proc.pid), f"left running: {session_processes(t.proc.pid)}"
    assert not list(tmp.iterdir()), f"left in $TMPDIR: {[p.name for p in tmp.iterdir()]}"


def test_single_process_pauses_resumes_and_quits(tmp_path):
    t = Terminal(lesson_path("01"), "--step", "--out", tmp_path, forked=True)
    t.expect(r"Step 1: Choose the device")
    t.expect(r"done: Step 1: Choose the device - auto means")   # what just happened
    t.expect(r"next: Step 2: Make the data")                    # what comes next
    t.expect(r"\[Enter\] next step, \[q\] quit")
    assert "Step 2:" not in t.drain(1), "it did not wait for Enter"
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
    t.drain(1)
    assert "Stopped" not in t.text and "Step 4:" not in t.text
    t.type("q")
    t.expect(r"Stopped at your request")
    assert t.exit_code() == 0
    assert not (tmp_path / "final.pt").exists(), "it saved after the learner quit"
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"rank process {pid} still runs"


def test_torchrun_workers_pause_before_their_process_group_exists(tmp_path):
    """Under torchrun, Step 1 runs in every rank before the process group exists. Rank 0
    pauses there all the same: the other ranks wait for its answer on the store torchrun's
    agent lends them (here the launcher's, tools/nodes.py), not at the rendezvous, so
    waiting longer than the lesson's 5 s timeout is harmless. Then Step 2 joins the group,
    and the next pause goes through the group's own store. (Before, the first pause came
    only after Step 2 and summed up both.)"""
    t = Terminal("tools/nodes.py", "--nnodes", "1", "--nproc-per-node", "2", "--",
                 lesson_path("06"), "--step", "--epochs", "1", "--timeout", "5", "--out", tmp_path, forked=True)
    first = t.expect(r"(?s)Step 1:.*?\[Enter\] next step", timeout=90).group(0)
    assert "done: Step 1: Read who we are" in first and "next: Step 2: Join" in first
    assert "Step 2:" not in first.split("next: Step 2")[0]
    time.sleep(7)  # longer than the lesson's 5 s timeout
    assert "Step 2:" not in t.drain(0.5), "it did not wait for Enter"
    t.type("\n")
    second = t.expect(r"(?s)Step 2: Join the process group.*?\[Enter\] next step", timeout=90).group(0)
    assert "done: Step 2: Join" in second and "done: Step 1" not in second
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
