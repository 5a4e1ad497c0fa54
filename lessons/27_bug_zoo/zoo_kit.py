"""Lesson 27's helpers, shared by the bug files beside it: the baseline, whole weights, the oracle.

Not a bug: lessons/27_bug_zoo.py and every bug file beside this one import it. Each bug file
trains lesson 13's recipe its own way (its loop is where the bug lives) and returns an Outcome;
this file holds what they all need around that loop:

    state, losses, recording = baseline(seed, steps, dtype, record, clip=..., schedule=...)
    whole_state(model, shapes)           # every parameter whole, on every rank (collectives)
    recorder_for(model)                  # lesson 26's Recorder, with lesson 13's whole shapes
    oracle(reference, twin_ref, bug, twin_bug)   # lesson 26's comparison: rows and the first divergence
    replica_gap(model)                   # how far this rank's copy of each weight is from rank 0's
"""
from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field

if __name__ == "__main__":  # a helper, not a lesson: one line instead of an ImportError
    sys.exit("error: zoo_kit.py holds lesson 27's helpers and runs nothing; run "
             ".venv/bin/python lessons/27_bug_zoo.py")

import torch
import torch.distributed as dist

import parity_layouts  # lesson 26's layouts: its loss_fn keeps the float64 twin in float64
import parity_oracle  # lesson 26's oracle: Recorder, whole, measure_rounding, compare
from common import transformer as T

MAX_NORM = 1.0  # gradient clipping where a recipe clips (torchtitan's default max_norm)


@dataclass
class Outcome:
    """What one run of a bug file leaves on rank 0 (None elsewhere): its final weights, whole;
    each step's loss (the whole batch's); the recording of the steps it was asked to record;
    and what its own checks measured (evidence, printed by the lesson)."""
    state: dict
    losses: list
    recording: dict | None = None
    evidence: dict = field(default_factory=dict)


def lesson_13_model(seed: int, dtype, device):
    """Lesson 13's model from `seed`, in `dtype` (a float64 twin's weights are the float32 ones,
    cast exactly), on `device`."""
    return T.make_model(seed).to(device, dtype)


def shapes_of_lesson_13() -> dict:
    """Every module output's and every gradient's whole shape (lesson 26's whole_shapes, on the
    meta device: shapes, no arithmetic): where a rank's piece belongs."""
    with torch.device("meta"):
        return parity_oracle.whole_shapes(T.Transformer(), torch.zeros(T.GLOBAL_BATCH, T.SEQ, dtype=torch.long))


def recorder_for(model: torch.nn.Module, about: str = "") -> parity_oracle.Recorder:
    """Lesson 26's Recorder on `model` (hooks on every module), with lesson 13's whole shapes so
    that collect() can put the ranks' pieces together."""
    return parity_oracle.Recorder(model, shapes_of_lesson_13(), about)


def schedule_lambda(steps: int):
    """The learning-rate multiplier where a recipe schedules it: a linear warm-up over the
    first 5 steps, then a cosine from 1 down to 0.1 at the last step."""
    def factor(done: int) -> float:
        if done < 5:
            return (done + 1) / 5
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (done - 5) / max(1, steps - 5))))
    return factor


def baseline(seed: int, steps: int, dtype=torch.float32, record: tuple = (), kinds=("forward", "backward"),
             clip: float | None = None, schedule: bool = False, device="cpu"):
    """Lesson 13's loop in one process, with what the bug's recipe adds (clipping the gradient
    norm at `clip`, the learning-rate schedule): the run every bug is measured against. Returns
    (weights, losses, recording of the steps in `record`, only the passes in `kinds`)."""
    model = lesson_13_model(seed, dtype, device)
    optimizer = T.make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_lambda(steps)) if schedule else None
    recorder = parity_oracle.Recorder(model, {}, f"lesson 13, one process; {dtype}") if record else None
    losses = []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in T.batch(step - 1, seed))
        watching = step in record and "forward" in kinds
        with recorder.forward(step) if watching else nullcontext():
            loss = parity_layouts.loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step in record and "backward" in kinds:
            recorder.gradients(step)  # what the optimizer reads: after clipping
        if step in record:
            recorder.collect()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    state = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    return state, losses, recorder.recording if recorder else None


def train_layout(run, model: torch.nn.Module, *, steps: int, seed: int, device,
                 record: tuple = ()) -> tuple[list[float], dict | None]:
    """Lesson 13's loop through one of lesson 26's layouts (`run`, built on `model`): every rank
    takes lesson 13's whole batch of each step and lesson 26's train_step feeds it its share.
    Returns (the whole batch's loss of each step, the recording of the steps in `record`)."""
    optimizer = T.make_optimizer(model)
    recorder = recorder_for(model) if record else None
    losses = []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in T.batch(step - 1, seed))
        loss = parity_layouts.train_step(run, optimizer, x, y, recorder if step in record else None, step)
        if step in record:
            recorder.collect()
        losses.append(mean_loss(loss))
    return losses, recorder.recording if recorder else None


def whole_state(model: torch.nn.Module, shapes: dict) -> dict:
    """Every parameter of `model`, whole, on the CPU, on every rank: a DTensor gathers itself, a
    tensor-parallel piece is all-gathered along the dimension its layout cut (lesson 26's
    whole). Every rank must call it."""
    return {name: parity_oracle.whole(p.detach(), shapes.get(f"backward/{name}")).cpu().clone()
            for name, p in model.named_parameters()}


def mean_loss(loss: float) -> float:
    """The whole batch's loss from this rank's mean over its equal share (every rank calls it)."""
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def replica_gap(model: torch.nn.Module, group=None) -> float:
    """max |w - the same w on the group's first rank| over every parameter's local tensor, on
    every rank: 0 where the ranks of `group` (all of them by default) hold copies that agree.
    For data-parallel replicas (DDP's; the replicate dimension of HSDP, whose ranks hold the
    same piece of each weight), and for tensor-parallel pieces, which must not agree."""
    first_rank = dist.get_process_group_ranks(group)[0] if group is not None else 0
    gap = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        mine = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        first = mine.clone()
        dist.broadcast(first, src=first_rank, group=group)
        if mine.numel():
            gap = torch.maximum(gap, (mine.double() - first.double()).abs().max().reshape(1))
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def oracle(reference: dict, twin_reference: dict, run: dict, twin_run: dict) -> tuple[list[dict], dict | None]:
    """Lesson 26's verdict on rank 0: each run's rounding measured against its float64 twin,
    then every entry of the one-process run, in the order it happened, against the same entry of
    the bug's run. Returns the rows and the first divergence (None: within rounding)."""
    parity_oracle.measure_rounding(reference, twin_reference)
    parity_oracle.measure_rounding(run, twin_run)
    rows = parity_oracle.compare(reference, run)
    return rows, parity_oracle.first_divergence(rows)


def gathered_recording(recording: dict) -> dict | None:
    """Recordings made on different ranks (each rank recorded only its own modules, as a pipeline
    stage does), put together on rank 0: the entries of every rank, by name. None elsewhere."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, recording)
    if dist.get_rank() != 0:
        return None
    merged = parity_oracle.new_recording(parts[0]["about"])
    for part in parts:
        for key in part["names"]:
            merged["names"].append(key)
            merged["values"][key] = part["values"][key]
    return merged
