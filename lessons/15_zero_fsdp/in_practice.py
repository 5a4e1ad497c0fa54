"""Lesson 15 in practice: FSDP2 as it is used, each knob measured on lesson 13's transformer.

Companion of lesson 15 (lessons/15_zero_fsdp.py): the same model, data, loop, devices and
instruments (apparatus/comm.py's CommLog, torch's FSDPMemTracker, sharded.FSDPStory), on 4
ranks by default, a few steps per section. Each step builds a fresh model, changes one thing
and prints what it measured beside what the formula or lesson 13 expects:

    Step 2  fully_shard in fp32, as lesson 15 runs it: the baseline
    Step 3  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    Step 4  gradient accumulation with set_requires_gradient_sync
    Step 5  explicit forward and backward prefetch
    Step 6  HSDP: a 2-D mesh (replicate 2, shard N/2)
    Step 7  CPUOffloadPolicy (on a CPU-only machine: what torch does with it)
    Step 8  pitfall: clipping sharded gradients (the global norm, not your shard's)
    Step 9  pitfall: an LR scheduler with ZeRO (attach it to the wrapper, not the inner optimizer)

Run:
    .venv/bin/python lessons/15_zero_fsdp/in_practice.py
    .venv/bin/python lessons/15_zero_fsdp/in_practice.py --steps 6 --accum-steps 3

Doc: docs/15_zero_fsdp.md, "FSDP2 in practice" under Going further
"""
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `import common`
sys.path.insert(0, str(Path(__file__).resolve().parent))      # this folder: practice_tools, sharded

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus.comm import CommLog
from apparatus import sharding
from common import transformer as T
from common.cli import run
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer
from practice_report import (report_accumulation, report_clip, report_dims, report_offload,
                             report_precision, report_prefetch, report_scheduler)
from practice_tools import (Recorder, compare, everyone, full_state, gathered_formula, parse_args,
                            reduced_formula, rows, shard_model, train)

MAX_NORM = 1.0  # Step 8: clip_grad_norm_'s max_norm (the first batch's gradient norm is about 1.03)


def main() -> None:
    args = parse_args(__doc__)
    claim_out(out_dir("15-in-practice", args.out))
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 15 in practice: FSDP2's knobs on {args.world_size} ranks, {args.steps} steps each")

    # Step 1: Start the ranks, one device each
    ui.step(1, "Start the ranks, one device each")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 15
    ui.print(note or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)),
                      PYTHONWARNINGS="ignore:FSDP2-wrapped module")  # our logits are a view
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


# --- what every section shares: the model, the loop, the instruments ------------------------


# --- the ranks ---------------------------------------------------------------------------------

def worker(rank: int, world: int, args, kind: str) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = pick_device(kind, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env(backend_for(device), args.timeout, device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()}); lesson 13's "
             f"transformer, {T.GLOBAL_BATCH} sequences per step, {T.GLOBAL_BATCH // world} per rank")
    timer, metrics = Timer(), {}
    reference = T.train_reference(args.seed, args.steps)["state"] if rank == 0 else None  # cached
    mesh = dist.init_device_mesh(device.type, (world,))  # all but Step 6: every rank one shard
    n_params = sum(p.numel() for p in T.make_model(args.seed).parameters())

    # Step 2: The baseline: fully_shard in fp32, as lesson 15 runs it
    # Every later step changes one thing and is measured against these numbers.
    ui.step(2, "The baseline: fully_shard in fp32, as lesson 15 runs it")
    model = shard_model(args, device, mesh)
    _, base = train(model, T.make_optimizer(model), args, device)
    ag, rs = base.bytes_of("all_gather"), base.bytes_of("reduce_scatter")
    ui.print(f"per step: {ag[0]} all-gathers, {ag[1]:,} bytes gathered (formula "
             f"{gathered_formula(world, 4):,}); {rs[0]} reduce-scatters, {rs[1]:,} bytes (formula "
             f"{reduced_formula(world):,})")
    ui.print(f"peak of the last step on rank 0: {base.peak():,} bytes (FSDPMemTracker)")
    baseline_state = full_state(model)
    metrics["baseline"] = {"all_gather_calls": ag[0], "all_gather_bytes": ag[1],
                           "all_gather_formula": gathered_formula(world, 4), "reduce_scatter_calls": rs[0],
                           "reduce_scatter_bytes": rs[1], "peak_bytes": base.peak()}
    if rank == 0:
        metrics["baseline"]["max_abs_diff_vs_13"] = compare(ui, "fp32 FSDP2 vs lesson 13", baseline_state,
                                                            reference)

    # Step 3: Mixed precision: gather bf16, reduce fp32
    # param_dtype: what the all-gather sends and forward and backward compute in; the sharded
    # parameters and AdamW's state stay fp32. reduce_dtype: what the gradients are reduced in.
    ui.step(3, "Mixed precision: gather bf16, reduce fp32")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(args, device, mesh, mp_policy=policy)
    _, mp = train(model, T.make_optimizer(model), args, device)
    mp_ag, mp_rs = mp.bytes_of("all_gather"), mp.bytes_of("reduce_scatter")
    held = next(model.parameters())
    ui.print(f"sharded parameter: {type(held).__name__} {held.dtype}; each group gathered as "
             f"{policy.param_dtype}, its gradients reduce-scattered as {policy.reduce_dtype}")
    report_precision(ui, base, mp)  # bytes and peak, fp32 against bf16, beside what to expect
    mp_state = full_state(model)
    metrics["bf16"] = {"all_gather_bytes": mp_ag[1], "reduce_scatter_bytes": mp_rs[1],
                       "peak_bytes": mp.peak()}
    if rank == 0:  # bf16 keeps 8 bits of mantissa: where a gradient is tiny, rounding can flip
        # its sign, and AdamW's first step moves every weight by about lr * sign(gradient)
        metrics["bf16"]["max_abs_diff_vs_13"] = compare(ui, "bf16 compute vs lesson 13", mp_state,
                                                        reference, None)
        ui.print(f"  (fp32 FSDP2: {metrics['baseline']['max_abs_diff_vs_13']:.1e}. AdamW's first step moves "
                 f"each weight by about lr = {T.LR:g} times the sign of its gradient, and bf16's rounding "
                 f"flips the sign of the tiniest ones: a different run, not lesson 13's within 1e-3)")

    # Step 4: Accumulate gradients with set_requires_gradient_sync
    # k micro-batches per step, each loss divided by k (the mean of k means is the batch's
    # mean). Only the last backward reduce-scatters; the others keep unsharded gradients.
    ui.step(4, "Accumulate gradients with set_requires_gradient_sync")
    k, counted = args.accum_steps, {}
    for sync_every in (True, False):  # the naive way (one step, counted), then the right way
        model = shard_model(args, device, mesh)
        optimizer = T.make_optimizer(model)
        steps = 1 if sync_every else args.steps
        for step in range(steps):
            with Recorder(model, optimizer) if step == steps - 1 else contextlib.nullcontext() as rec:
                x, y = rows(step, args, device)
                optimizer.zero_grad(set_to_none=True)
                for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
                    if rec is not None:  # FSDPMemTracker follows one forward per step; keeps the peak
                        rec.tracker.reset_mod_stats()
                    model.set_requires_gradient_sync(sync_every or i == k - 1)  # reduce the last only
                    (T.loss_fn(model(xm), ym) / k).backward()
                optimizer.step()
        counted[sync_every] = (rec.bytes_of("reduce_scatter"), rec.bytes_of("all_gather"), rec.peak())
    metrics["accumulation"] = report_accumulation(ui, k, world, counted, ag[0])  # beside the formula
    acc_state = full_state(model)
    if rank == 0:
        metrics["accumulation"]["max_abs_diff_vs_13"] = compare(ui, f"{k} micro-batches vs lesson 13",
                                                                acc_state, reference)

    # Step 5: Prefetch explicitly, forward and backward
    # FSDP2 gathers a block in its own pre-forward hook (on a GPU, on a second stream, so it
    # overlaps compute); explicit lists tell a module which others to gather right after its own.
    ui.step(5, "Prefetch explicitly, forward and backward")
    model = shard_model(args, device, mesh)
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch([blocks[0]])  # the root's hook gathers block 0 too
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])  # each block gathers the next
    model.set_modules_to_backward_prefetch(blocks[::-1][:2])  # backward: the last two blocks at once
    _, pre = train(model, T.make_optimizer(model), args, device)
    pre_state = full_state(model)
    metrics["prefetch"] = report_prefetch(ui, base, pre, pre_state, baseline_state, rank)  # the order

    # Step 6: HSDP: shard within a group, replicate across groups
    # A 2-D mesh (replicate, shard), made as lesson 19 makes its own: placements (Replicate(),
    # Shard(0)). Gradients: reduce-scatter in the shard group, all-reduce the shard across replicas.
    ui.step(6, "HSDP: shard within a group, replicate across groups")
    shard = world // 2
    mesh2 = dist.init_device_mesh(device.type, (2, shard), mesh_dim_names=("replicate", "shard"))
    model = shard_model(args, device, mesh2)
    optimizer = T.make_optimizer(model)
    hsdp_losses, hsdp = train(model, optimizer, args, device)
    hsdp_losses = T.mean_over_ranks(hsdp_losses)  # each rank's mean over its rows -> the batch's
    ui.print(f"mesh {mesh2.mesh.tolist()} (row = a shard group, column = a replicate group); "
             f"placements {next(model.parameters()).placements}")
    fractions = everyone(sharding.held_bytes(model, optimizer)["parameters"] / (4 * n_params))
    per_dim = report_dims(ui, hsdp, mesh2, shard)  # shard: gather, reduce-scatter; replicate: all-reduce
    ui.print(f"parameters each rank holds: {', '.join(f'{f:.3f}' for f in fractions)} of the model "
             f"(1/{shard} = {1 / shard:.3f}, plus padding; plain FSDP2 on {world}: 1/{world}); "
             f"peak {hsdp.peak():,} bytes (Step 2: {base.peak():,})")
    hsdp_state = full_state(model)
    metrics["hsdp"] = {"mesh": [2, shard], "param_fraction_per_rank": fractions, "per_dimension": per_dim,
                       "peak_bytes": hsdp.peak()}
    if rank == 0:
        metrics["hsdp"]["max_abs_diff_vs_13"] = compare(ui, "HSDP vs lesson 13", hsdp_state, reference)

    # Step 7: Offload the shards to the CPU
    # CPUOffloadPolicy keeps the sharded parameters, their gradients and AdamW's state in CPU
    # memory, pinned by default; FSDP2 copies a group to the GPU just before its all-gather.
    ui.step(7, "Offload the shards to the CPU")
    try:
        policy = CPUOffloadPolicy()
        model = shard_model(args, device, mesh, offload_policy=policy)
        tried = f"{policy} ran"
    except RuntimeError as exc:  # pinning asks CUDA for page-locked memory: no driver, no pinning
        tried = f"{policy} failed in fully_shard: {str(exc).splitlines()[0]}"
        policy = CPUOffloadPolicy(pin_memory=False)
        model = shard_model(args, device, mesh, offload_policy=policy)
    ui.print(tried)
    optimizer = T.make_optimizer(model)
    _, off = train(model, optimizer, args, device)
    metrics["offload"] = report_offload(ui, model, optimizer, policy, tried, device, off, base)  # where it all is
    off_state = full_state(model)
    if rank == 0:
        metrics["offload"]["max_abs_diff_vs_13"] = compare(ui, "offloaded vs lesson 13", off_state, reference)

    # Step 8: Pitfall: clip the global norm, not your shard's
    # clip_grad_norm_ on DTensor gradients: DTensor sums the shards' squares across the
    # ranks. The norm of this rank's local shard (.to_local()) is another number on each rank.
    ui.step(8, "Pitfall: clip the global norm, not your shard's")
    model = shard_model(args, device, mesh)
    x, y = rows(0, args, device)
    T.loss_fn(model(x), y).backward()
    local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.to_local())
                                                  for p in model.parameters()])).item()  # the wrong way
    log = CommLog()
    with log.recording():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the right way; clips, too
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # Replicate: already summed
    by_hand = torch.tensor(local ** 2, device=device)
    dist.all_reduce(by_hand)  # the right way by hand: sum the squares, then the root
    metrics["clip"] = report_clip(ui, args, MAX_NORM, everyone((norm.item(), local)), by_hand, log)

    # Step 9: Pitfall: an LR scheduler with ZeRO
    # ZeroRedundancyOptimizer steps an inner AdamW (.optim) over this rank's parameters and
    # copies its own param_groups (lr...) into it before each step: the scheduler belongs on
    # the wrapper. On .optim, its lr is overwritten before every step.
    ui.step(9, "Pitfall: an LR scheduler with ZeRO")
    ramp = max(2, args.steps)  # at least two steps, so that even --steps 1 shows a warm-up
    warmup = lambda s: min(1.0, (s + 1) / ramp)  # noqa: E731  linear warm-up to T.LR
    used, finals = {}, {}
    for attach in ("wrapper", "inner"):
        model = T.make_model(args.seed).to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=T.LR, eps=T.EPS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(zero if attach == "wrapper" else zero.optim, warmup)
        used[attach] = seen = []  # the lr the inner AdamW really steps with, read in its pre-hook
        zero.optim.register_step_pre_hook(lambda opt, *_, seen=seen: seen.append(opt.param_groups[0]["lr"]))
        for step in range(args.steps):
            x, y = rows(step, args, device)
            loss = T.loss_fn(ddp(x), y)
            zero.zero_grad(set_to_none=True)
            loss.backward()
            zero.step()
            scheduler.step()
        finals[attach] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        del ddp
    metrics["scheduler"] = report_scheduler(ui, args, warmup, used, finals, rank)  # and one process's

    wall = timer.seconds
    if rank != 0:
        return teardown()
    folder = out_dir("15-in-practice", args.out)
    save_results(folder, hsdp_state, make_metrics(
        lesson="15-in-practice", world_size=world, backend=backend_for(device), device=str(device),
        losses=hsdp_losses, final_accuracy=None, wall_seconds=wall, samples=args.steps * T.GLOBAL_BATCH,
        steps=args.steps, seed=args.seed, global_batch=T.GLOBAL_BATCH, parameters=n_params, **metrics))
    ui.print(f"\nwrote {shown(folder / 'final.pt')} (Step 6's HSDP weights) and "
             f"{shown(folder / 'metrics.json')} ({wall:.1f}s in the ranks)")
    teardown()


if __name__ == "__main__":
    run(main)
