"""Rank-aware console output, built on rich.

* Rank 0 speaks for the job; `say_all` is for the rare line every rank must print, and
  prefixes it with `[rank N]` so interleaved lines stay readable.
* Only rank 0 draws a progress bar. When stdout is not a terminal (CI logs, pipes, `| tee`)
  rich prints no colours or cursor movements: the bar appears once, finished, at the end.
* `step(n, title)` prints the step heading that matches `## Step n: title` in the doc and,
  with --step, first waits for Enter after the previous step.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class UI:
    def __init__(self, rank: int = 0, world_size: int = 1, step_mode: bool = False):
        self.rank, self.world_size = rank, world_size
        # soft_wrap: long log lines are not cut into pieces when the output is a file
        self.console = Console(highlight=False, soft_wrap=True)
        self.step_mode = step_mode
        self._current_step: int | None = None
        if step_mode and rank == 0 and not sys.stdin.isatty():
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
        """Heading of `# Step N: title`; with --step, pause after the previous step first."""
        if self._current_step is not None:
            self.pause()
        self._current_step = number
        self.print(f"\n[bold magenta]Step {number}: {title}[/bold magenta]")

    def pause(self) -> None:
        if not (self.step_mode and self.is_main and sys.stdin.isatty()):
            return  # never block without a terminal: CI, pipes and spawned ranks run through
        answer = input(f"  (step {self._current_step} done: Enter for the next step, q to quit) ")
        if answer.strip().lower() == "q":
            self.print("Stopped at your request.")
            raise SystemExit(0)

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
            table.add_row(*[str(x) for x in row])
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
