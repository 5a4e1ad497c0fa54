"""--step in a real pseudo-terminal: pauses, resumes on Enter, quits on q with every process gone."""
import os
import pty
import re
import select
import subprocess
import sys
import time

from conftest import ROOT, lesson_path


class Terminal:
    """A lesson running in a pseudo-terminal, as if typed into a shell."""

    def __init__(self, *args):
        self.master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                                     stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True)
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
        self.proc.kill()
        raise AssertionError(f"did not see {pattern!r} within {timeout}s; got:\n{self.text[-3000:]}")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def exit_code(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            os.close(self.master)


def test_single_process_pauses_resumes_and_quits(tmp_path):
    t = Terminal(lesson_path("01"), "--step", "--out", tmp_path)
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
    t = Terminal(lesson_path("05"), "--step", "--timeout", "5", "--out", tmp_path)
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
    t = Terminal("-m", "common.nodes", "--nnodes", "1", "--nproc-per-node", "2", "--",
                 lesson_path("06"), "--step", "--epochs", "1", "--timeout", "5", "--out", tmp_path)
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
