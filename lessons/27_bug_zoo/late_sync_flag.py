"""Zoo bug late-sync-flag: gradient accumulation under DDP, the sync flag set after the forward.

karpathy/build-nanogpt#30, "fix sync issue that results in incorrect gradient accumulation and
incorrect loss". build-nanogpt's train_gpt2.py accumulated gradients over micro-steps and set
`model.require_backward_grad_sync = (micro_step == grad_accum_steps - 1)` just before
`loss.backward()`, after the forward. Its author, WilsonCWu, changed only B from 64 to 16 (so 4
accumulation steps instead of 1, "a purely mechanical change that doesn't affect loss") and saw
clearly worse losses than karpathy's run (val 4.5877 at step 1250; 3.9518 with the fix); the fix
sets the flag so that "both the forward and backward pass" see it. karpathy merged it:
"TIL. I think nanoGPT is broken too, then."

Why (lesson 08's table): DDP reads the flag in forward, which arms the reducer for the coming
backward; backward never reads it. Set after the forward, each micro-step syncs as the one
before asked: the first micro-step of every step (the flag is still True from the last one)
is averaged over the ranks, the last is not. Each rank steps with its own gradient, and the
replicas drift apart.
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import parity_layouts
from common import transformer as T
from zoo_kit import Outcome, lesson_13_model, mean_loss, recorder_for, replica_gap, whole_state

NAME = "late-sync-flag"
UPSTREAM = "karpathy/build-nanogpt#30"
TITLE = "fix sync issue that results in incorrect gradient accumulation and incorrect loss"
LAYOUT = "torch DDP, each rank 1/N of the rows, accumulated over 2 micro-steps per optimizer step"
MISTAKE = "require_backward_grad_sync set between the forward and the backward: the last micro-step never syncs"
FIX = "set require_backward_grad_sync before the forward (or no_sync() around forward and backward)"
CAUGHT_BY = "oracle"
SIGNS = ("lesson 26's oracle names step 1's first gradient, head.bias, with a |B| / |A| that is neither 1 "
         "nor N, and after training the ranks' copies of the weights differ")
RECORDS = ("backward",)  # a micro-step's outputs are not the whole batch's: compare the gradients
ACCUM = 2  # micro-steps per optimizer step: build-nanogpt's grad_accum_steps


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=()):
    """Lesson 13's recipe under DDP, each rank's rows in ACCUM micro-steps; mode "bug" sets the
    flag where build-nanogpt did, "fix" where the pull request moved it."""
    model = lesson_13_model(seed, dtype, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = T.make_optimizer(model)
    recorder = recorder_for(model) if record else None
    losses = []
    for step in range(1, steps + 1):
        x, y = (T.shard(t, rank, world).to(device) for t in T.batch(step - 1, seed))
        optimizer.zero_grad(set_to_none=True)
        loss_accum = 0.0
        for micro in range(ACCUM):
            if mode == "fix":  # the pull request: the forward sees the flag, and arms the reducer
                ddp.require_backward_grad_sync = micro == ACCUM - 1
            loss = parity_layouts.loss_fn(ddp(T.shard(x, micro, ACCUM)), T.shard(y, micro, ACCUM)) / ACCUM
            loss_accum += loss.item()
            if mode == "bug":  # build-nanogpt's line: too late, this forward already decided
                ddp.require_backward_grad_sync = micro == ACCUM - 1
            loss.backward()
        if step in record:
            recorder.gradients(step)  # rank 0's .grad: what its optimizer reads
            recorder.collect()
        optimizer.step()
        losses.append(mean_loss(loss_accum))
    evidence = {"replica_gap": replica_gap(model)}  # the ranks' copies of the weights, against rank 0's
    state = whole_state(model, {})  # rank 0's copy: what it would save
    del ddp
    return Outcome(state, losses, recorder.recording if recorder else None, evidence) if rank == 0 else None


def evidence_lines(evidence: dict) -> list[str]:
    gap = evidence["replica_gap"]
    if gap == 0:
        return ["every rank's copy of the weights equals rank 0's, as DDP's replicas must"]
    return [f"the ranks' copies of the weights differ from rank 0's by up to {gap:.1e}: "
            f"each rank stepped with a gradient of its own"]
