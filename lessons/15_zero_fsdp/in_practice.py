"""Lesson 15 in practice: FSDP2 as it is used, each knob measured on lesson 13's transformer.

Companion of lesson 15 (lessons/15_zero_fsdp.py): the same model, data, loop, devices and
instruments (sharded.StepRecorder: CommLog, FSDP2's hooks and torch's FSDPMemTracker), on
4 ranks by default, a few steps per section. Each step builds a fresh model, changes one thing
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
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `import common`
sys.path.insert(0, str(Path(__file__).resolve().parent))      # this folder: `import sharded`

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus.comm import CommLog
from apparatus import sharding
import sharded
from common import transformer as T
from common.cli import fail, lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer

MAX_NORM = 1.0  # Step 8: clip_grad_norm_'s max_norm (the first batch's gradient norm is about 1.03)


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=4,
                           out="runs/lesson-15-in-practice")
    parser.add_argument("--steps", type=positive_int, default=2,
                        help="optimizer steps in each section (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--accum-steps", type=positive_int, default=2,
                        help="Step 4: micro-batches per optimizer step")
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")
    if args.world_size < 4 or args.world_size % 2:  # Step 6's mesh: 2 replicas of N/2 shards
        ok = [n for n in range(4, 9, 2) if T.GLOBAL_BATCH % n == 0]
        fail(f"--world-size {args.world_size}: HSDP (Step 6) needs 2 replicas of at least 2 ranks; "
             f"use one of {', '.join(map(str, ok))}")
    rows = T.GLOBAL_BATCH // args.world_size
    if rows % args.accum_steps:
        fail(f"--accum-steps {args.accum_steps} does not cut each rank's {rows} rows into equal "
             f"micro-batches; use one of {', '.join(str(d) for d in range(1, rows + 1) if rows % d == 0)}")
    return args


def main() -> None:
    args = parse_args()
    claim_out(out_dir("15-in-practice", args.out))
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 15 in practice: FSDP2's knobs on {args.world_size} ranks, {args.steps} steps each")

    # Step 1: Start the ranks, one device each
    ui.step(1, "Start the ranks, one device each")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 15
    ui.print(note or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


# --- what every section shares: the model, the loop, the formulas ----------------------------

def shard_model(args, device, mesh, **policy):
    """Lesson 15's Step 3: one FSDP group per block, then the root; `policy`: fully_shard's knobs."""
    model = T.make_model(args.seed).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def rows(step: int, args, device):
    """This rank's rows of the global batch of `step` (every rank is a data-parallel rank,
    also under HSDP, where replicas and shards both split the batch)."""
    x, y = T.batch(step, args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    return T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)


def train(model, optimizer, args, device):
    """Lesson 15's loop for args.steps steps: (losses, sharded.StepRecorder of the last step:
    its collectives, FSDP2's hooks and the peak)."""
    losses = []
    with sharded.StepRecorder(model, optimizer, args.steps, every=args.steps) as record:
        for step in range(args.steps):
            record.at(step)
            x, y = rows(step, args, device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, record


def counted(record, kind: str, group: str | None = None) -> tuple[int, int, float]:
    """(calls, data bytes S, bytes this rank sent) of one kind of collective in the recorded
    step, on one process group (HSDP's dimensions) or any."""
    calls = [c for c in record.log.calls if c.kind == kind and group in (None, c.group)]
    return len(calls), sum(c.data_bytes for c in calls), sum(c.sent_bytes for c in calls)


def full_state(model) -> dict:
    """The full state dict, gathered to rank 0's CPU (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def group_elements(shard: int) -> dict[str, int]:
    """Elements of each FSDP group (root, blocks.0, ...) once gathered, each parameter padded
    to a multiple of `shard` rows as FSDP2 pads it (apparatus/sharding.py, fsdp_local_rows)."""
    groups: dict[str, int] = {}
    for name, shape in sharding.recipe_shapes().items():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        padded_rows = shard * sharding.fsdp_local_rows(shape[0], shard, 0)[1]
        groups[group] = groups.get(group, 0) + padded_rows * math.prod(shape[1:])
    return groups


def gathered_formula(shard: int, element: int) -> int:
    """Bytes all-gathered per step: every block twice (forward, and again in backward: it was
    resharded after forward), the root once (FSDP2 keeps the root gathered for backward)."""
    return sum(n * element * (1 if g == "root" else 2) for g, n in group_elements(shard).items())


def reduced_formula(shard: int) -> int:
    """Bytes reduce-scattered per step: every group once, fp32 (also under Step 3's policy)."""
    return 4 * sum(group_elements(shard).values())


def compare(ui, what: str, state: dict, reference: dict, allowed: float | None = 1e-3,
            against: str = "w_13") -> float:
    """Print and return max |w - reference|, against `allowed` (None: no verdict, a fact)."""
    diff = max_abs_diff(state, reference)
    verdict = "" if allowed is None else f" {'within' if diff <= allowed else 'BEYOND'} {allowed:g}"
    ui.print(f"{what}: max |w - {against}| = [bold]{diff:.1e}[/bold]{verdict}")
    return diff


def everyone(value) -> list:
    """Every rank's `value`, on every rank, by rank."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def peaks_text(peaks: dict[str, int]) -> str:
    """'cpu 1,234 bytes', or one entry per device where there are two (Step 7 on a GPU)."""
    return ", ".join(f"{device} {n:,} bytes" for device, n in peaks.items())


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
    ag, rs = counted(base, "all_gather"), counted(base, "reduce_scatter")
    ui.print(f"per step: {ag[0]} all-gathers, {ag[1]:,} bytes gathered (formula "
             f"{gathered_formula(world, 4):,}); {rs[0]} reduce-scatters, {rs[1]:,} bytes (formula "
             f"{reduced_formula(world):,})")
    ui.print(f"peak of the last step on rank 0: {base.peak.bytes:,} bytes (FSDPMemTracker)")
    baseline_state = full_state(model)
    metrics["baseline"] = {"all_gather_calls": ag[0], "all_gather_bytes": ag[1],
                           "all_gather_formula": gathered_formula(world, 4), "reduce_scatter_calls": rs[0],
                           "reduce_scatter_bytes": rs[1], "peak_bytes": base.peak.bytes}
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
    mp_ag, mp_rs = counted(mp, "all_gather"), counted(mp, "reduce_scatter")
    held = next(model.parameters())
    ui.print(f"sharded parameter: {type(held).__name__} {held.dtype}; each group gathered as "
             f"{policy.param_dtype}, its gradients reduce-scattered as {policy.reduce_dtype}")
    ui.table("Per step on rank 0, fp32 (Step 2) and bf16 compute", ["", "fp32", "bf16 policy", "ratio",
                                                                     "expected"],
             [["bytes all-gathered", f"{ag[1]:,}", f"{mp_ag[1]:,}", f"{mp_ag[1] / ag[1]:.2f}",
               "0.50 (2 of 4 bytes)"],
              ["bytes reduce-scattered", f"{rs[1]:,}", f"{mp_rs[1]:,}", f"{mp_rs[1] / rs[1]:.2f}",
               "1.00 (reduce_dtype fp32)"],
              ["peak of one step", f"{base.peak.bytes:,}", f"{mp.peak.bytes:,}",
               f"{mp.peak.bytes / base.peak.bytes:.2f}", "below 1"]])
    mp_state = full_state(model)
    metrics["bf16"] = {"all_gather_bytes": mp_ag[1], "reduce_scatter_bytes": mp_rs[1],
                       "peak_bytes": mp.peak.bytes}
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
    k, counts = args.accum_steps, {}
    for sync_every in (True, False):  # the naive way (one step, counted), then the right way
        model = shard_model(args, device, mesh)
        optimizer = T.make_optimizer(model)
        steps = 1 if sync_every else args.steps
        with sharded.StepRecorder(model, optimizer, steps, every=steps) as record:  # the last step
            for step in range(steps):
                record.at(step)
                x, y = rows(step, args, device)
                optimizer.zero_grad(set_to_none=True)
                for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
                    if i:  # FSDPMemTracker follows one forward per step, unless told of the next
                        record.peak.another_forward()
                    model.set_requires_gradient_sync(sync_every or i == k - 1)  # reduce the last only
                    (T.loss_fn(model(xm), ym) / k).backward()
                optimizer.step()
        counts[sync_every] = (counted(record, "reduce_scatter"), counted(record, "all_gather"),
                              record.peak.bytes)
    groups = len(group_elements(world))
    (naive_rs, naive_ag, naive_peak), (acc_rs, acc_ag, acc_peak) = counts[True], counts[False]
    ui.table(f"One step of {k} micro-batches, rank 0", ["", "reduce-scatters", "bytes reduce-scattered",
                                                         "all-gathers", "peak"],
             [["sync every one", naive_rs[0], f"{naive_rs[1]:,}", naive_ag[0], f"{naive_peak:,}"],
              ["sync the last", acc_rs[0], f"{acc_rs[1]:,}", acc_ag[0], f"{acc_peak:,}"],
              ["formula (last)", f"{groups} (1 per group)", f"{reduced_formula(world):,}", f"{k} x {ag[0]}",
               ""]])
    ui.print("all-gathers stay k x: each micro-batch's forward and backward gather the weights again "
             "(set_reshard_after_backward(False) keeps them, at the price of memory)")
    acc_state = full_state(model)
    metrics["accumulation"] = {"k": k, "groups": groups, "reduce_scatter_calls": acc_rs[0],
                               "reduce_scatter_calls_naive": naive_rs[0], "all_gather_calls": acc_ag[0],
                               "peak_bytes": acc_peak, "peak_bytes_naive": naive_peak}
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
    last = args.steps - 1
    before, after = base.story.rows(base.log.calls, last), pre.story.rows(pre.log.calls, last)
    for title, story in (("FSDP2's default order", before), ("explicit prefetch", after)):
        ui.table(f"What FSDP2 did in the last step, rank 0: {title}", ["#", "hook", "module", "issued"],
                 [[i + 1, *row] for i, row in enumerate(story)])
    pre_state = full_state(model)
    pre_ag = counted(pre, "all_gather")[1]
    metrics["prefetch"] = {"default": before, "explicit": after, "peak_bytes": pre.peak.bytes,
                           "all_gather_bytes": pre_ag}
    if rank == 0:
        diff = max_abs_diff(pre_state, baseline_state)
        ui.print(f"same weights as Step 2? max |w - w_step2| = [bold]{diff:.1e}[/bold]; bytes gathered "
                 f"{pre_ag:,} (Step 2: {ag[1]:,}); peak {pre.peak.bytes:,} (Step 2: {base.peak.bytes:,})")
        metrics["prefetch"]["max_abs_diff_vs_baseline"] = diff

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
    names = {dim: mesh2.get_group(dim).group_name for dim in ("shard", "replicate")}
    expected = {("shard", "all_gather"): gathered_formula(shard, 4),
                ("shard", "reduce_scatter"): reduced_formula(shard),
                ("replicate", "all_reduce"): reduced_formula(shard) // shard}  # my reduced shard
    per_dim, table = {}, []
    for (dim, what), formula in expected.items():
        calls, data, sent = counted(hsdp, what, names[dim])
        per_dim[f"{dim}:{what}"] = {"calls": calls, "bytes": data, "formula": formula, "sent": sent}
        table.append([f"{dim} ({mesh2[dim].size()} ranks)", what.replace("_", "-"), calls, f"{data:,}",
                      f"{formula:,}", f"{sent:,.0f}"])
    ui.table("Per step on rank 0, by mesh dimension", ["dimension", "collective", "calls", "bytes (S)",
                                                        "formula", "bytes sent"], table)
    ui.print(f"parameters each rank holds: {', '.join(f'{f:.3f}' for f in fractions)} of the model "
             f"(1/{shard} = {1 / shard:.3f}, plus padding; plain FSDP2 on {world}: 1/{world}); "
             f"peak {hsdp.peak.bytes:,} bytes (Step 2: {base.peak.bytes:,})")
    hsdp_state = full_state(model)
    metrics["hsdp"] = {"mesh": [2, shard], "param_fraction_per_rank": fractions, "per_dimension": per_dim,
                       "peak_bytes": hsdp.peak.bytes}
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
    p = next(model.parameters())
    state = next(iter(optimizer.state.values()))["exp_avg"]
    where = {"compute": str(device), "sharded parameters": str(p.to_local().device),
             "gradients": str(p.grad.to_local().device), "optimizer state": str(state.to_local().device)}
    ui.print(f"with {policy}: {', '.join(f'{k} on {v}' for k, v in where.items())}; "
             f"shards pinned: {p.to_local().is_pinned()}")
    ui.print(f"peak of one step: {peaks_text(off.peak.per_device)} (Step 2: {peaks_text(base.peak.per_device)})")
    if device.type == "cpu":
        ui.print("on a CPU device the policy moves nothing: the shards were in CPU memory already")
    off_state = full_state(model)
    metrics["offload"] = {"tried": tried, "policy": str(policy), "where": where,
                          "pinned": p.to_local().is_pinned(), "peak_bytes": off.peak.per_device}
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
    norms = everyone((norm.item(), local))
    one = T.make_model(args.seed)  # one process, the whole first batch
    T.loss_fn(one(T.batch(0, args.seed)[0]), T.batch(0, args.seed)[1]).backward()
    one_norm = torch.nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM).item()
    ui.table(f"Gradient norm of the first batch (max_norm {MAX_NORM:g})",
             ["rank", "clip_grad_norm_ (DTensor)", "norm of .to_local()", "clip factor: right",
              "clip factor: wrong"],
             [[r, f"{g:.6f}", f"{n:.6f}", f"{min(1, MAX_NORM / g):.4f}", f"{min(1, MAX_NORM / n):.4f}"]
              for r, (g, n) in enumerate(norms)])
    issued = ", ".join(f"{c.kind} of {c.data_bytes} bytes" for c in log.calls) or "none"
    ui.print(f"one process (lesson 13's model, the whole batch): {one_norm:.6f}; by hand, "
             f"sqrt(all_reduce(local^2)): {by_hand.sqrt().item():.6f}; clip_grad_norm_ issued: {issued}")
    metrics["clip"] = {"max_norm": MAX_NORM, "global_norm_per_rank": [g for g, _ in norms],
                       "local_norm_per_rank": [n for _, n in norms], "one_process_norm": one_norm,
                       "by_hand_norm": by_hand.sqrt().item(), "collectives": [c.kind for c in log.calls]}

    # Step 9: Pitfall: an LR scheduler with ZeRO
    # ZeroRedundancyOptimizer steps an inner AdamW (.optim) over this rank's parameters and
    # copies its own param_groups (lr...) into it before each step: the scheduler belongs on
    # the wrapper. On .optim, its lr is overwritten before every step.
    ui.step(9, "Pitfall: an LR scheduler with ZeRO")
    ramp = max(2, args.steps)  # at least two steps, so that even --steps 1 shows a warm-up

    def warmup(step: int) -> float:  # linear warm-up to T.LR
        return min(1.0, (step + 1) / ramp)

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
    ui.table("lr the inner AdamW used at each step",
             ["scheduler on", *[f"step {s + 1}" for s in range(args.steps)]],
             [["(the schedule)", *[f"{T.LR * warmup(s):.5f}" for s in range(args.steps)]],
              ["the ZeRO wrapper", *[f"{lr:.5f}" for lr in used["wrapper"]]],
              ["zero.optim (wrong)", *[f"{lr:.5f}" for lr in used["inner"]]]])
    metrics["scheduler"] = {"schedule": [T.LR * warmup(s) for s in range(args.steps)], "used": used}
    if rank == 0:  # one process, the same warm-up: what both runs should end with
        one = T.make_model(args.seed)
        opt = T.make_optimizer(one)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            opt.zero_grad(set_to_none=True)
            T.loss_fn(one(x), y).backward()
            opt.step()
            sched.step()
        metrics["scheduler"]["max_abs_diff_vs_one_process"] = {
            attach: compare(ui, f"scheduler on {name} vs one process with the same warm-up", finals[attach],
                            one.state_dict(), 1e-3 if attach == "wrapper" else None, "w_one")
            for attach, name in (("wrapper", "the wrapper"), ("inner", "zero.optim"))}

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
