"""Zoo bug gloo-avg: FSDP2 asked gloo to average its gradients, and gloo summed them.

pytorch/pytorch#162338, "Incorrect AVG reduction for GLOO" (labels: high priority, module:
correctness (silent)). Its author, ppwwyyxx, reported it with a three-layer model under
fully_shard on gloo, its weights set by hand "for predictable gradients". The pull request that
answered it (#162344) found the cause: gradients "summed instead of averaged when using the
gloo backend for CPU-based training ... scaled by the world size", because FSDP assumed gloo
supported ReduceOp.AVG for reduce_scatter; it proposed SUM followed by a manual division.

Torch 2.14.1's gloo averages (the lesson measures it), so we re-create the old gloo: inside
old_gloo_reduce_scatter(), a reduce-scatter asked for AVG runs with SUM, and nothing complains.
The fix runs under the same old gloo: FSDP2's public set_force_sum_reduction_for_comms(True)
reduces with SUM and divides by the world size itself, the pull request's approach.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import parity_layouts
from zoo_kit import Outcome, lesson_13_model, train_layout, whole_state

NAME = "gloo-avg"
UPSTREAM = "pytorch/pytorch#162338"
TITLE = "Incorrect AVG reduction for GLOO"
LAYOUT = "FSDP2 (fully_shard on every block and the root), each rank 1/N of the rows"
MISTAKE = "the gradients' reduce-scatter sums where FSDP asks for an average (AVG read as SUM)"
FIX = "model.set_force_sum_reduction_for_comms(True): FSDP sums, then divides by N itself"
CAUGHT_BY = "oracle"
SIGNS = ("lesson 26's oracle finds every forward output within rounding and names step 1's first "
         "gradient, head.bias, with |B| / |A| = N (2.000 on 2 ranks): a sum where a mean was meant")
RECORDS = ("forward", "backward")
TWIN_PITFALL = {"reduce_dtype": None}  # a float64 twin left to FSDP2's default: it never asks gloo for AVG


@contextmanager
def old_gloo_reduce_scatter():
    """While inside: every reduce-scatter asked for ReduceOp.AVG runs with ReduceOp.SUM, as gloo
    did before the fix. FSDP2 reduce-scatters through dist.reduce_scatter_single (torch 2.14.1's
    _fsdp_collectives.py, DefaultReduceScatter), which it looks up at each call."""
    real = dist.reduce_scatter_single

    def summing(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.AVG:
            op = dist.ReduceOp.SUM  # the bug: no error, no warning, N times the mean
        return real(output=output, input=input, op=op, group=group, async_op=async_op)
    dist.reduce_scatter_single = summing
    try:
        yield
    finally:
        dist.reduce_scatter_single = real


def gloo_averages() -> float:
    """Torch 2.14.1's own gloo, no re-creation: reduce-scatter with AVG of rank r's [r+1, r+1]
    over N ranks; returns what rank 0 received (the mean (N+1)/2; N(N+1)/2 if it summed)."""
    world = dist.get_world_size()
    out = torch.zeros(1)
    dist.reduce_scatter_single(out, torch.full((world,), float(dist.get_rank() + 1)), op=dist.ReduceOp.AVG)
    return out.item()


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=(), reduce_dtype=torch.float32):
    """Lesson 13's recipe under FSDP2 on the old gloo; mode "bug" leaves it there, "fix" makes
    FSDP sum and divide by itself. reduce_dtype=None: FSDP2's default, the parameters' dtype
    (for a float64 twin: the path without the bug, see TWIN_PITFALL)."""
    model = lesson_13_model(seed, dtype, device)
    mesh = dist.init_device_mesh(device.type, (world,))
    # FSDP2 asks for AVG only when it reduces float32 or bfloat16 (_get_gradient_divide_factors);
    # any other dtype it sums and divides itself. A float64 twin must reduce in float32 too, or it
    # would not have the bug, and the oracle would take the bug for its rounding (see the doc).
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if mode == "fix":
        for module in (*model.blocks, model):
            module.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM, then / N: no AVG asked
    run = parity_layouts.Layout("fsdp", model, model, parity_layouts.data_rows(rank, world, parity_layouts.Bug()))
    with old_gloo_reduce_scatter():
        losses, recording = train_layout(run, model, steps=steps, seed=seed, device=device, record=record)
    evidence = {"gloo_avg_of_ranks": gloo_averages(), "world": world}  # torch 2.14.1's own gloo, outside the re-creation
    state = whole_state(model, {})
    return Outcome(state, losses, recording, evidence) if rank == 0 else None


def evidence_lines(evidence: dict) -> list[str]:
    world = evidence["world"]
    return [f"torch 2.14.1's own gloo averages: reduce-scatter with AVG of 1..{world} gave "
            f"{evidence['gloo_avg_of_ranks']:g} (the mean {(world + 1) / 2:g}; a sum gives {world * (world + 1) // 2}); "
            f"the runs here put the old gloo back"]
