"""Zoo bug dcp-initial-lr: a resume from a distributed checkpoint loses the scheduler's initial_lr.

pytorch/pytorch#140900, "DCP fails to save "initial_lr" field, created by an LR scheduler".
ad8e, with FSDP and torch.distributed.checkpoint (get_state_dict / set_state_dict), found that
"initial_lr is present in the optimizer's state dict on saving, but it disappears on loading.
This prevents resuming an LR scheduler; we need to use hacks around last_epoch=-1 or manually
patching initial_lr". fegin explained: it is saved, but DCP loads into the state dict of the
new optimizer, whose param_groups have no initial_lr unless a scheduler created it, so DCP does
not load it; a scheduler built with last_epoch != -1 does not insert it and raises instead. His
answer: build the scheduler with last_epoch=-1, and save the scheduler's own state_dict too, so
that last_epoch comes back as well (torchtitan checkpoints its schedulers). The issue is closed.

Re-created as a job that trains FSDP2 with a learning-rate schedule (warm-up, then cosine),
saves with DCP half-way (model and optimizer, as the issue's test case), restarts (a new model
and optimizer) and loads. Resuming the schedule where it was (last_epoch = the step) raises the
KeyError; the way past it that the thread names, last_epoch=-1 without the scheduler's state,
runs on silently: the schedule starts over, from the learning rate it had reached. The fix
builds the scheduler before the load (so initial_lr is in the new optimizer and DCP fills it)
and checkpoints the scheduler's state_dict with the rest.
"""
from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import parity_layouts
from common import transformer as T
from zoo_kit import Outcome, lesson_13_model, mean_loss, schedule_lambda, whole_state

NAME = "dcp-initial-lr"
UPSTREAM = "pytorch/pytorch#140900"
TITLE = 'DCP fails to save "initial_lr" field, created by an LR scheduler'
LAYOUT = "FSDP2 with a learning-rate schedule, saved with DCP half-way, restarted and loaded"
MISTAKE = "the scheduler is rebuilt after dcp.load, and the checkpoint has no scheduler state"
FIX = "build the scheduler before dcp.load, and checkpoint scheduler.state_dict() with the rest"
CAUGHT_BY = "state-dict round trip: param_groups saved against loaded, and the learning rate after the resume"
SIGNS = ("the oracle is not what catches it: the optimizer's initial_lr is missing after dcp.load, and the "
         "learning rate after the resume is not the schedule's")
RECORDS = ()  # caught by the round trip, not by the oracle
SCHEDULE = True  # the baseline schedules its learning rate too


def build(seed, dtype, device, world):
    """Lesson 13's model under FSDP2 and its optimizer, as a job builds them when it starts."""
    model = lesson_13_model(seed, dtype, device)
    mesh = dist.init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, T.make_optimizer(model)


def checkpoint_state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)  # as the test case, and lesson 16
    return {"model": model_sd, "optim": optim_sd}


def group_settings(optimizer) -> dict:
    """The first param group without its parameters: lr, initial_lr (if any), betas, ..."""
    return {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=()):
    """Train to half-way, save, restart, load, train to `steps`; mode "bug" resumes the way the
    thread did, "fix" the way fegin and torchtitan do."""
    resume_at = steps // 2
    factor = schedule_lambda(steps)
    model, optimizer = build(seed, dtype, device, world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    rows = parity_layouts.data_rows(rank, world, parity_layouts.Bug())
    losses, evidence = [], {}
    for step in range(1, steps + 1):
        if step == resume_at + 1:  # the job stops here and starts again from the checkpoint
            model, optimizer, scheduler, evidence = save_and_resume(model, optimizer, scheduler, mode, seed,
                                                                     dtype, device, world, resume_at, factor)
        x, y = (t.to(device) for t in T.batch(step - 1, seed))
        run = parity_layouts.Layout("fsdp", model, model, rows)
        losses.append(mean_loss(parity_layouts.train_step(run, optimizer, x, y)))
        scheduler.step()
    state = whole_state(model, {})
    return Outcome(state, losses, None, evidence) if rank == 0 else None


def save_and_resume(model, optimizer, scheduler, mode, seed, dtype, device, world, resume_at, factor):
    folder = [tempfile.mkdtemp(prefix="lesson-27-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one folder for every rank's file
    saved = group_settings(optimizer)
    state = checkpoint_state(model, optimizer)
    if mode == "fix":
        state["scheduler"] = scheduler.state_dict()  # last_epoch comes back too (torchtitan does it)
    dcp.save(state, checkpoint_id=folder[0])
    del model, optimizer, scheduler, state

    model, optimizer = build(seed + 1, dtype, device, world)  # a new job: other weights, replaced below
    if mode == "fix":  # before the load: initial_lr is in the new param_groups, so DCP loads it
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    state = checkpoint_state(model, optimizer)
    if mode == "fix":
        state["scheduler"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=folder[0])  # into the new state dicts: only the keys they have
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = group_settings(optimizer)
    evidence = {"initial_lr_saved": saved.get("initial_lr"), "initial_lr_loaded": loaded.get("initial_lr"),
                "lr_saved": saved["lr"], "error": None}
    if mode == "bug":
        try:  # resume the schedule where it was: what the thread wanted
            torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=resume_at - 1)
        except KeyError as error:
            evidence["error"] = str(error.args[0]).splitlines()[0]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)  # last_epoch=-1: the way past it
    else:
        scheduler.load_state_dict(state["scheduler"])
    evidence["lr_after_resume"] = optimizer.param_groups[0]["lr"]
    evidence["lr_expected"] = T.LR * factor(resume_at)  # the uninterrupted schedule at this step
    dist.barrier()  # every rank has read its file
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    return model, optimizer, scheduler, evidence


def evidence_lines(evidence: dict) -> list[str]:
    loaded = "missing" if evidence["initial_lr_loaded"] is None else f"{evidence['initial_lr_loaded']:g}"
    return [f"initial_lr {evidence['initial_lr_saved']:g} in the optimizer when saved, {loaded} after dcp.load; "
            f"learning rate after the resume {evidence['lr_after_resume']:.2e}, the uninterrupted schedule's "
            f"{evidence['lr_expected']:.2e}"]


def caught_lines(evidence: dict) -> list[str]:
    lines = [f"param_groups[0] saved against loaded: initial_lr {evidence['initial_lr_saved']:g} -> "
             f"{'missing' if evidence['initial_lr_loaded'] is None else evidence['initial_lr_loaded']}"]
    if evidence["error"]:
        lines.append(f"resuming the schedule where it was (last_epoch = the step): KeyError: {evidence['error']}")
    lines.append(f"resumed with last_epoch=-1: learning rate {evidence['lr_after_resume']:.2e} where the "
                 f"uninterrupted schedule has {evidence['lr_expected']:.2e} (the schedule started over)")
    return lines
