"""Lesson 19: 2-D parallelism: FSDP2 across one mesh dimension, tensor parallel across the other.

Parent: lesson 15 (lessons/15_zero_fsdp.py)

New since lesson 15: the ranks form a 2-D DeviceMesh ("dp", "tp"), D x T of them. Each block
is split across tp (lesson 17's plan), then fully_shard shards what each rank holds across
dp; the batch is split across dp only. Measured on every rank: who talks to whom, the bytes
it holds, and the bytes each mesh dimension sends per step, beside the planner's formulas
(lessons/19_two_d_mesh/planner.py), and lesson 13's weights within 1e-3. --plan runs the same
formulas for a real job (a 7B model on 8 or 64 GPUs): memory, bytes, FLOPs, step time and
MFU, written to --out's plan.json; it starts no process (planner.py runs them by itself too).

Run:
    make lesson-19
    make lesson-19 ARGS="--dp 4 --tp 1"
    .venv/bin/python lessons/19_two_d_mesh.py --dp 1 --tp 4
    .venv/bin/python lessons/19_two_d_mesh.py --plan 7e9 --gpus 64 --gpu-gb 80
    .venv/bin/python lessons/19_two_d_mesh.py --plan 7e9 --gpus 64 --sequence-parallel --out runs/plan
    .venv/bin/python lessons/19_two_d_mesh/planner.py 7e9 --gpus 8

Doc: docs/19_two_d_mesh.md
"""
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 19_two_d_mesh/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, parallel as tp

from apparatus.comm import CommLog
from apparatus import sharding
import mesh_checks
import planner  # lessons/19_two_d_mesh/planner.py: the formulas, and --plan's flags and tables
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True)  # the job's size: --dp x --tp
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--dp", type=positive_int, default=2, help="ranks across the data (FSDP2)")
    parser.add_argument("--tp", type=positive_int, default=2, help="ranks across each block (tensor parallel)")
    plan_flags = parser.add_argument_group("the planner (lessons/19_two_d_mesh/planner.py): formulas, no processes")
    plan_flags.add_argument("--plan", type=float, default=None, metavar="PARAMS",
                            help="print the planner's tables for a model of PARAMS parameters (e.g. 7e9), "
                                 "write them to --out's plan.json, and exit")
    planner.add_flags(plan_flags)  # --gpus 8 --gpu-gb 80 ...: planner.py's own flags
    args = parser.parse_args()
    if args.plan is not None:
        planner.check_flags(args, "--plan")
    else:  # before any rank starts: Part 2's one rule, for each dimension
        T.check_world_size(args.dp, "--dp")  # dp splits the batch's rows
        T.check_world_size(args.tp, f"--tp (with --dp {args.dp})", most=8 // args.dp,  # dp x tp ranks
                           divides={f"{T.N_HEADS} attention heads": T.N_HEADS}, splits_batch=False)
    return mesh_checks.check_flags(args)  # --plan's numbers; world_size = dp x tp


def main() -> None:
    args = parse_args()
    claim_out(out_dir("19", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    if args.plan is not None:  # the planner alone: formulas, no processes (lessons/19_two_d_mesh/planner.py)
        return planner.show_plan(ui, args, out_dir("19", args.out))  # and --out's plan.json
    ui.title(f"Lesson 19: a {args.dp} x {args.tp} mesh (dp x tp) on {args.world_size} ranks")

    # Step 1: Start dp x tp ranks, one device each
    ui.step(1, "Start dp x tp ranks, one device each")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(mesh_checks.device_note(note) or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


def worker(rank: int, world: int, args, kind: str) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = pick_device(kind, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env(backend_for(device), args.timeout, device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Make the data
    # Lesson 13's batches (its Step 2 shows them and their floor), split as lesson 15 splits
    # them, but by the dp coordinate: the tp ranks of one row of the mesh read the same rows.
    ui.step(2, "Make the data")
    floor = T.loss_floor()
    ui.print(f"lesson 13's batches: {T.GLOBAL_BATCH} sequences of {T.SEQ} tokens per step, "
             f"{T.GLOBAL_BATCH // args.dp} on each of the {args.dp} dp groups (all of them on each "
             f"of a group's {args.tp} tp ranks); the floor {floor:.4f} nats/token")

    # Step 3: Build the mesh, split each block across tp, shard across dp
    # Rows of the mesh are tp groups, columns dp groups. First tensor parallel on mesh["tp"]
    # (lesson 17's plan), then FSDP2 on mesh["dp"] (lesson 15), which shards the tp shards.
    ui.step(3, "Build the mesh, split each block across tp, shard across dp")
    model = T.make_model(args.seed).to(device)
    mesh = dist.init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    mesh_checks.show_mesh(ui, mesh)
    plan = {f"blocks.*.{name}": tp.ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    plan |= {f"blocks.*.{name}": tp.RowwiseParallel() for name in ("attn.proj", "mlp.proj")}
    # q, k, v share one input: one DTensor at the attention, so backward all-reduces it once
    plan["blocks.*.attn"] = tp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False)
    tp.parallelize_module(model, mesh["tp"], plan)
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"])  # ZeRO-3 across dp: each block, then the root
    sharding.show_shards(ui, model)
    # Lesson 13's AdamW (T.make_optimizer) with foreach=True: one op of each kind for all the
    # parameters, as torch already does on a GPU. On a CPU torch's default steps each parameter
    # alone, and each of those ops on a DTensor goes through DTensor's Python dispatch: about a
    # quarter of every step's CPU time here. The same arithmetic: the same weights, bit for bit.
    optimizer = torch.optim.AdamW(model.parameters(), lr=T.LR, eps=T.EPS, foreach=True)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train on this dp group's rows, recording every collective
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # A tp group's ranks hold parts of the same layers: they read the same rows, picked by the
    # dp coordinate. CommLog records each collective with its process group: its dimension.
    # As in lesson 15, on the printed steps only (every step sends the same): recording
    # slows every op it sees.
    ui.step(4, "Train on this dp group's rows, recording every collective")
    losses: list[float] = []
    timer = Timer()
    log = CommLog()  # every collective, DTensor's own included (apparatus/comm.py)
    dp_rank = mesh.get_local_rank("dp")
    log_every = max(1, args.steps // 5)
    recorded = [s for s in range(args.steps) if (s + 1) % log_every == 0]  # the printed steps
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            with log.recording() if step in recorded else contextlib.nullcontext():
                x, y = T.batch(step, args.seed)
                x, y = T.shard(x, dp_rank, args.dp).to(device), T.shard(y, dp_rank, args.dp).to(device)
                loss = T.loss_fn(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    final_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = T.mean_over_ranks(losses)

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Count the bytes each rank holds and each dimension sends
    # Held: from each rank's own local shards. Sent: Step 4's collectives sorted by the mesh
    # dimension whose group carried them. Both beside the planner's formulas (--plan).
    ui.step(6, "Count the bytes each rank holds and each dimension sends")
    held = sharding.held_bytes(model, optimizer)  # mine, from my local shards, padding included
    per_rank = mesh_checks.check_memory(ui, held, args.dp, args.tp)  # every rank's, beside the formula
    comm = mesh_checks.report_dims(ui, log, mesh, len(recorded))  # tp: activations, dp: weights

    # Step 7: Compare with lesson 13, save the results
    # final_state is the full state dict gathered to rank 0's CPU: a plain model loads it.
    # Lesson 13's weights within 1e-3, beside the floor: one process in dp chunks (tp does
    # not split the batch).
    ui.step(7, "Compare with lesson 13, save the results")
    folder = out_dir("19", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    del optimizer
    if rank != 0:  # rank 0 alone writes
        return teardown()
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=args.dp)  # tp ranks share rows
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")
    save_results(folder, final_state, make_metrics(
        lesson="19", world_size=world, mesh_shape=[args.dp, args.tp], backend=backend_for(device),
        device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, **compared,
        **mesh_checks.metrics(comm, per_rank)))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")
    teardown()


if __name__ == "__main__":
    run(main)
