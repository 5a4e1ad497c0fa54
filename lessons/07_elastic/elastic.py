"""Lesson 07's companion: what guards its snapshots and proves its resume exact.

The lesson (lessons/07_elastic.py) keeps the idea: what a snapshot holds, rank 0 deciding
whether to resume and telling the others, the sampler restarted mid-epoch. Here:

* `nonnegative_float`: the type of --step-delay.
* `fail_plan`, `kill_myself`: the injected failure (--fail-at-step, --fail-rank): which
  step, on which attempt, and the SIGKILL itself.
* `read_snapshot`: rank 0's look at the folder: stray temporary files of a save that was
  cut short, --fresh, then `torch.load(weights_only=True)` and every field checked
  (apparatus.state_dicts.snapshot_problem) before anything is loaded.
* `resumed`: every rank's side of rank 0's decision: stop on a refused snapshot, say where
  this attempt starts (and why a restarting torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
* `Ledger`: the sample ids of every optimizer step, gathered from every rank, and the check
  that they are every sample once per epoch in lesson 01's order: the proof, not the idea.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from common import fail, recipe
from apparatus.results import remove_strays, shown
from apparatus.state_dicts import snapshot_problem

SNAPSHOT_FORMAT = 1  # bump when the snapshot's contents change: old snapshots are then refused


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of 0 or more, got {text!r}")
    return value


def fail_plan(ui, args, total_steps: int, start: int, launched: bool,
              restart_count: int) -> tuple[int, int]:
    """(step, rank): the global step at which a rank kills itself in this attempt (0: never)
    and which rank (--fail-rank, by default the last).

    --fail-at-step defaults to a little before half-way (step 45 of 96), between two
    snapshots; 0 means never. Only the first attempt fails (a restart that failed again at
    the same step would use up every restart), and only under torchrun: under plain python
    nobody would restart us.
    """
    requested, rank = args.fail_at_step, ui.world_size - 1 if args.fail_rank is None else args.fail_rank
    if requested is not None and requested > total_steps:
        fail(f"--fail-at-step {requested} is beyond the last step ({total_steps}); "
             f"use 1..{total_steps}, or 0 for no failure")
    step = max(1, total_steps // 2 - 3) if requested is None else requested
    args.fail_at_step = step  # for metrics.json: the failure this job was set up with
    if step and restart_count == 0 and not launched:
        ui.print(f"[yellow]note:[/yellow] --fail-at-step {step} ignored: without torchrun nobody "
                 f"would restart us (try make lesson-07)")
    if not step or restart_count or not launched:
        return 0, rank
    if step > start:
        ui.print(f"rank {rank} will kill itself (SIGKILL) at step {step} of this attempt")
    return step, rank


def kill_myself(ui, step: int) -> None:
    """What the kernel's OOM killer does: SIGKILL. No exception, no `finally`, no atexit, no
    error file for @record: the process is just gone, and its agent sees exit code -9."""
    ui.say_all(f"step {step}: killing myself with SIGKILL (pid {os.getpid()}), as the OOM "
               f"killer would")
    sys.stdout.flush()  # what we printed must not die with us
    os.kill(os.getpid(), signal.SIGKILL)


def read_snapshot(ui, path, fresh: bool, template: dict, steps_per_epoch: int, epochs: int,
                  optimizer):
    """Rank 0 only: None (start at step 0), a checked snapshot, or why it is refused (str).

    It deletes stray temporary files first (a save killed halfway leaves one, and an intact
    snapshot.pt beside it), and with `fresh` an old snapshot. A snapshot is read with
    weights_only=True: unpickling arbitrary objects from a file on disk would run arbitrary
    code. Every field is checked (snapshot_problem) and the optimizer's state is loaded
    once as a trial, so that a bad file is one clear line instead of a traceback per rank.
    """
    for stray in remove_strays(path.parent, path.name):
        ui.print(f"deleted {shown(stray)}: a save that was cut short (snapshot.pt is intact)")
    if fresh and path.exists():
        path.unlink()
        ui.print(f"--fresh: deleted {shown(path)} left by an earlier job")
    if not path.exists():
        return None
    expected = {k: template[k] for k in ("format", "seed", "dataset", "global_batch")}
    try:
        snap = torch.load(path, map_location="cpu", weights_only=True)
        problem = snapshot_problem(snap, template, {**expected, "steps_per_epoch": steps_per_epoch},
                                   epochs * steps_per_epoch, f"--epochs {epochs}")
        if not problem:
            optimizer.load_state_dict(snap["optimizer"])
    except Exception as exc:  # truncated, not a torch file, objects weights_only refuses
        problem = f"cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    if problem:
        return f"snapshot {shown(path, markup=False)} {problem}; delete it or pass --fresh to start over"
    return snap


def resumed(ui, decision, restart_count: int, max_restarts: int, steps_per_epoch: int):
    """Every rank, with rank 0's broadcast decision: the snapshot to load, or None. A refused
    snapshot ends the run: rank 0 says why in one line (exit 1), the others leave quietly.
    Under torchrun that is a failure a restart cannot fix; tools/nodes.py does not restart it.
    """
    if isinstance(decision, str):
        if ui.rank == 0:
            fail(decision, code=1)
        raise SystemExit(1)  # rank 0 has said why
    if max_restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # measured here: without it, about half of the restarts failed to connect (see the doc)
        ui.print("[yellow]note:[/yellow] torchrun lends its store to every attempt, so a restarted "
                 "group can read the last attempt's addresses (pytorch/pytorch#135712); start "
                 "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tools/nodes.py does)")
    attempt = f"attempt {restart_count + 1} (restart count {restart_count})"
    if decision is None:
        ui.print(f"{attempt}: no snapshot, starting from step 0")
        return None
    if restart_count == 0:  # a new job, not a restart: say why it does not start at 0
        ui.print("found a snapshot left by an earlier job that did not finish; "
                 "--fresh would delete it and start over")
    ui.print(f"[bold]{attempt}: resuming from snapshot at epoch {decision['epoch'] + 1} step "
             f"{decision['step_in_epoch']}/{steps_per_epoch}[/bold] (global step "
             f"{decision['global_step']}, saved with {decision['world_size']} worker(s))")
    return decision


class Ledger:
    """Which samples went into every optimizer step, from every rank: one row of
    GLOBAL_BATCH ids per step. Each rank adds its own ids per step (kept on the device);
    `sync` gathers them (one all_gather, at the same moment as the losses' all-reduce)."""

    def __init__(self, rows: torch.Tensor | None, world_size: int, device):
        self.rows = list(rows) if rows is not None else []
        self.world_size, self.device = world_size, device
        self.pending: list[torch.Tensor] = []

    def add(self, ids: list[int]) -> None:
        self.pending.append(torch.tensor(ids))

    def sync(self) -> None:
        n, per_rank = len(self.pending), len(self.pending[0])
        out = torch.empty(self.world_size * n * per_rank, dtype=torch.long, device=self.device)
        dist.all_gather_single(out, torch.cat(self.pending).to(self.device))
        # out is rank 0's n steps, then rank 1's ...: one row per step, ranks side by side
        out = out.view(self.world_size, n, per_rank).transpose(0, 1).reshape(n, -1)
        self.rows += list(out.cpu())
        self.pending = []

    def tensor(self) -> torch.Tensor:
        if not self.rows:
            return torch.empty(0, recipe.GLOBAL_BATCH, dtype=torch.long)
        return torch.stack(self.rows)

    def every_sample_once(self, n: int, seed: int, epochs: int, steps_per_epoch: int) -> bool:
        """Each step's ids are the same global batch as lesson 01's step (in any order)."""
        samples, b = self.tensor(), recipe.GLOBAL_BATCH
        return len(samples) == epochs * steps_per_epoch and all(
            sorted(samples[e * steps_per_epoch + s].tolist()) == sorted(order[s * b:(s + 1) * b])
            for e in range(epochs) for order in [recipe.epoch_order(n, seed, e)]
            for s in range(steps_per_epoch))
