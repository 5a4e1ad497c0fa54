"""Rank-aware console output, built on rich.

* Rank 0 speaks for the job; `say_all` is for the rare line every rank must print, and
  prefixes it with `[rank N]` so interleaved lines stay readable.
* Only rank 0 draws a progress bar. When stdout is not a terminal (CI logs, pipes, `| tee`)
  rich prints no colours or cursor movements: the bar appears once, finished, at the end.
* `step(n, title)` prints the step heading that matches `## Step n: title` in the doc and,
  with --step, first pauses after the previous step (see `pause`): at every step heading,
  whichever process printed the step before (see `UNPAUSED_ENV`), before the process group
  exists (torchrun's agent store) and after it is gone (rank 0 alone).
"""
from __future__ import annotations

import os
import re
import select
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


# --step: the steps a process showed since its last pause, handed to the ranks it starts (they
# inherit its environment). Lesson 10's Step 1 runs in the parent and Step 2 in the ranks: rank 0
# pauses before Step 2 and sums up Step 1, as if one process had printed both.
UNPAUSED_ENV = "LESSON_STEP_UNPAUSED"


class UI:
    def __init__(self, rank: int = 0, world_size: int = 1, step_mode: bool = False):
        self.rank, self.world_size = rank, world_size
        # soft_wrap: long log lines are not cut into pieces when the output is a file
        self.console = Console(highlight=False, soft_wrap=True)
        self.step_mode = step_mode
        self._current_step: int | None = None
        # steps done since the last pause: at first, those the parent process showed
        inherited = os.environ.get(UNPAUSED_ENV, "") if step_mode else ""
        self._unpaused: list[int] = [int(n) for n in inherited.split(",") if n.isdigit()]
        self._was_in_group = False  # a process group existed at an earlier step
        self._last_signal: _Signal | None = None  # after teardown: its store, to see who left
        self._steps = doc_steps(sys.argv[0]) if step_mode else {}
        if step_mode and rank == 0 and step_terminal() is None:
            self.print("[dim]--step: stdin is not a terminal, so the steps will not pause[/dim]")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *objects, **kwargs) -> None:
        """Rank 0 only: the job's voice."""
        if self.is_main:
            self.console.print(*objects, **kwargs)

    def say_all(self, message: str) -> None:
        """Every rank prints, prefixed with its rank, e.g. `[rank 1] my batch is ...`."""
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        self.console.print(f"[cyan]{escape(prefix)}[/cyan]{message}")

    def title(self, text: str) -> None:
        self.print(f"\n[bold]{text}[/bold]")

    def step(self, number: int, title: str) -> None:
        """Heading of `# Step N: title`; with --step, pause after the previous step first
        (also when the previous step ran in the parent process: UNPAUSED_ENV)."""
        if self._current_step is not None:
            self._unpaused.append(self._current_step)
        if self._unpaused:
            self.pause(next_step=(number, title))
        self._current_step = number
        if self.step_mode:  # for the ranks this process may start next
            os.environ[UNPAUSED_ENV] = ",".join(map(str, [*self._unpaused, number]))
        self.print(f"\n[bold magenta]Step {number}: {title}[/bold magenta]")

    def pause(self, next_step: tuple[int, str] | None = None) -> None:
        """With --step: say what just happened and what comes next, then wait for a key.

        Only rank 0 asks. In a multi-process lesson the other ranks learn its answer through
        the process group's store (see `_Signal`), not through a collective: a learner who
        counts collectives, or reads a profiler trace or a flight-recorder dump, sees only the
        lesson's own. Rank 0 renews a heartbeat every second while it waits, so a learner who
        reads for ten minutes never trips a timeout. Without a terminal nothing blocks.

        Before the process group exists, the store torchrun's agent lends the ranks carries the
        answer instead (lesson 06: Step 1 runs in every rank before Step 2 joins the group).
        After the group is gone (teardown), nobody waits for anybody: rank 0 asks alone and the
        other ranks go on (they have nothing left to say, and usually leave).
        """
        if not self.step_mode:
            return
        import torch.distributed as dist

        together = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        self._was_in_group = self._was_in_group or together
        signal = None
        if together:
            signal = _Signal(dist.distributed_c10d._get_default_store(),  # private: the only handle
                             dist.get_rank(), dist.get_world_size())
            self._last_signal = signal
        elif self.world_size > 1 and not self._was_in_group:
            store = _launcher_store()
            if store is None:
                # No store every rank can reach yet: the other ranks could not wait for rank
                # 0's answer (they would time out at the rendezvous). Pause at the next step.
                return
            signal = _Signal(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        elif self.world_size > 1 and not self.is_main:
            self._unpaused = []  # the group is gone: rank 0 asks alone, we go on
            return
        if self.is_main:
            answer = "go"
            tty = step_terminal()
            if tty is not None:
                self._summary(next_step)
                tty.write("  [Enter] next step, [q] quit: ")
                tty.flush()
                answer = _read_answer(tty, signal.beat if signal else None)
            if answer == "quit":  # at once: the other ranks may take a moment to hear it
                self.print("Stopped at your request.")
                sys.stdout.flush()
            if signal:
                signal.send(answer)
            elif answer == "quit" and self._last_signal is not None:
                # After teardown: this process may host the store the others still use
                # while they leave their group; quit once they have ended.
                self._last_signal.wait_for_others(lambda r: False)
        else:
            answer = signal.receive()
        self._unpaused = []
        os.environ.pop(UNPAUSED_ENV, None)
        if answer == "quit":
            sys.stdout.flush()
            sys.stderr.flush()
            # Every rank stops here, together. os._exit skips the interpreter's teardown,
            # where gloo would complain about a process group that was never destroyed.
            # It skips multiprocessing's clean-up too: the launcher (no multiprocessing parent)
            # removes the folder it made for the fork server's socket (pymp-* in $TMPDIR)
            # itself. A rank must not: it shares its launcher's folder.
            import multiprocessing
            import multiprocessing.util
            import shutil

            if multiprocessing.parent_process() is None:
                shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
            os._exit(0)

    def _summary(self, next_step: tuple[int, str] | None) -> None:
        for done in self._unpaused or [self._current_step]:
            title, first = self._steps.get(done, ("", ""))
            self.console.print(f"[dim]  done: Step {done}{': ' + title if title else ''}"
                               f"{' - ' + escape(first) if first else ''}[/dim]")
        if next_step:
            self.console.print(f"[dim]  next: Step {next_step[0]}: {next_step[1]}[/dim]")

    def log(self, epoch: int, step: int, steps: int, loss: float, samples_per_s: float) -> None:
        """One compact line per logging step: epoch | step | loss | samples/s."""
        self.print(f"epoch {epoch:>2} | step {step:>4}/{steps} | loss {loss:.4f} | "
                   f"{samples_per_s:>9,.0f} samples/s")

    @contextmanager
    def progress(self, total: int, description: str = "training"):
        """A progress bar on rank 0; other ranks get an object whose advance() does nothing."""
        if not self.is_main:
            yield _NoBar()
            return
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=self.console, transient=False)
        task = bar.add_task(description, total=total)
        with bar:
            yield _Bar(bar, task)

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        if not self.is_main:
            return
        table = Table(title=title, title_justify="left")
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*[escape(str(x)) for x in row])
        self.console.print(table)


class _Bar:
    def __init__(self, progress: Progress, task):
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)


class _NoBar:
    def advance(self, n: int = 1) -> None:
        pass


class Timer:
    """Wall-clock seconds since creation; `rate(n)` is n per second."""

    def __init__(self):
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def rate(self, n: int) -> float:
        return n / max(self.seconds, 1e-9)


# --- step mode: where to ask, and how the other ranks wait --------------------------------

class _TTY:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def fileno(self) -> int:
        return self.reader.fileno()

    def readline(self) -> str:
        return self.reader.readline()

    def write(self, text: str) -> None:
        self.writer.write(text)

    def flush(self) -> None:
        self.writer.flush()


def step_terminal() -> _TTY | None:
    """The terminal to ask on, or None. mp.spawn gives its children /dev/null as stdin, so a
    parent that has a terminal passes its name down in LESSON_STEP_TTY."""
    if sys.stdin is not None and sys.stdin.isatty():
        return _TTY(sys.stdin, sys.stdout)
    path = os.environ.get("LESSON_STEP_TTY")
    if path:
        try:
            reader = open(path, "r")   # two plain streams: a tty cannot seek, so no "r+"
            writer = open(path, "w")
        except OSError:
            return None
        return _TTY(reader, writer)
    return None


def _read_answer(tty: _TTY, beat=None) -> str:
    """Wait for one key on the terminal (q quits; Enter or space goes on; other keys are
    ignored); in a group, call beat() every second (rank 0's heartbeat).

    The terminal is put in cbreak mode while we wait, so a key arrives without Enter (Ctrl-C
    still interrupts), and restored afterwards. Where that is impossible (not a real
    terminal), a whole line is read instead, as before.
    """
    fd = tty.fileno()
    saved = None
    try:
        import termios
        import tty as tty_modes
    except ImportError:  # not a POSIX system: read whole lines
        termios = None
    if termios is not None:
        try:
            saved = termios.tcgetattr(fd)
            tty_modes.setcbreak(fd, termios.TCSANOW)  # TCSANOW: keep keys typed ahead
        except termios.error:  # not a real terminal
            saved = None
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                if saved is None:
                    line = tty.readline()
                    return "quit" if line == "" or line.strip().lower() in ("q", "quit") else "go"
                keys = os.read(fd, 64).decode(errors="replace")
                if keys == "":
                    return "quit"  # the terminal went away
                for key in keys:
                    if key in "qQ":
                        tty.write("q\n")
                        tty.flush()
                        return "quit"
                    if key in "\r\n ":
                        tty.write("\n")
                        tty.flush()
                        return "go"
            elif beat is not None:
                beat()
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def _launcher_store():
    """Before the process group exists: the store torchrun's agent serves at MASTER_ADDR:
    MASTER_PORT for every rank (TORCHELASTIC_USE_AGENT_STORE, as torch/distributed/
    rendezvous.py reads it), as a client, its keys apart for each restart; None elsewhere
    (mp.spawn's ranks: the store is hosted only when they join)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in os.environ:
        return None
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=60))
    except (KeyError, ValueError, RuntimeError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lesson_step_before_group/attempt_{attempt}", store)


class _Signal:
    """Rank 0's answer to one pause, carried by a store, not by a collective: the process
    group's, or before it exists torchrun's agent's (`_launcher_store`).

    Rank 0 writes the key `lesson_step/<n>` (n counts this process's pauses, the same on every
    rank): "wait <i>" once a second while the learner reads, then "go" or "quit". The others
    poll the key. They give up only if rank 0 does not reach the pause, or its heartbeat
    stops, for the store's timeout (the process group's in these lessons; at least 3 s): the
    bound a collective would have, without a single collective on the training group.
    """
    count = 0  # pauses in this process; a class attribute, so a second UI cannot reuse a key

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        _Signal.count += 1
        self.key = f"lesson_step/{_Signal.count}"
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1
        self.store.set(self.key, f"wait {self.beats}")

    def send(self, answer: str) -> None:
        """Rank 0: the answer, then wait until every other rank has read it. Rank 0 may host
        the store, and leave the group right after this pause (lesson 11's Step 3) or exit
        (q): a rank still polling would find the store gone instead of the answer."""
        self.store.set(self.key, answer)
        self.wait_for_others(lambda r: self.store.check([f"{self.key}/seen/{r}"]))

    def wait_for_others(self, done) -> None:
        """Until done(rank) or its process has ended, for every other rank (lesson 16's end
        after Step 8 while rank 0 goes on in the group). A rank that never gets there has
        died: the launcher reports that; we go on all the same after the store's timeout."""
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + max(self.store.timeout.total_seconds(), 3.0)
        try:
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not done(r) and not self._has_left(r)}
                time.sleep(0.02)
        except Exception:  # the store went away: nobody is left to wait for
            pass

    def _has_left(self, rank: int) -> bool:
        """The rank's process has ended (it says where it runs as it waits at a pause; a rank
        on another machine cannot be looked at, and counts as still there)."""
        where = f"lesson_step/where/{rank}"
        if not self.store.check([where]):
            return False
        host, pid = self.store.get(where).decode().rsplit(" ", 1)
        if host != socket.gethostname():
            return False
        try:
            return open(f"/proc/{int(pid)}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # no such process any more (or no /proc: then we cannot tell)
            return sys.platform.startswith("linux")

    def receive(self) -> str:
        limit = max(self.store.timeout.total_seconds(), 3.0)  # at least three missed beats
        last, since = None, time.monotonic()
        self.store.set(f"lesson_step/where/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        while True:
            value = self.store.get(self.key).decode() if self.store.check([self.key]) else None
            if value in ("go", "quit"):
                self.store.set(f"{self.key}/seen/{self.rank}", "1")
                return value
            if value != last:
                last, since = value, time.monotonic()
            elif time.monotonic() - since > limit:
                what = "reach the pause" if value is None else "answer (its heartbeat stopped)"
                raise RuntimeError(f"--step: rank 0 did not {what} within {limit:g}s")
            time.sleep(0.05)


def doc_steps(script: str) -> dict[int, tuple[str, str]]:
    """{N: (title, first sentence)} from the `## Step N: title` sections of the lesson's doc."""
    doc = Path(script).resolve().parent.parent / "docs" / (Path(script).stem + ".md")
    if not doc.exists():
        return {}
    steps: dict[int, tuple[str, str]] = {}
    current, prose, in_code = None, [], False
    for line in doc.read_text().splitlines() + ["## end"]:
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("## "):
            if current is not None:
                steps[current[0]] = (current[1], _first_sentence(" ".join(prose)))
            m = re.match(r"## Step (\d+): (.+)", line)
            current, prose = ((int(m[1]), m[2].strip()) if m else None), []
        elif current is not None and line.strip() and not line.startswith(("<!--", "|", "#", ">")):
            prose.append(line.strip())
    return steps


def _first_sentence(text: str) -> str:
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)  # [link](url) -> link
    text = re.sub(r"\s+", " ", text.replace("**", "").replace("`", "")).strip()
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0] if text else ""
    return first if len(first) <= 220 else first[:217] + "..."
