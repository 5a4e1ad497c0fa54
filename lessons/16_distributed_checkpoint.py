"""Lesson 16: distributed checkpoints: every rank writes its own shard; any world size resumes.

Parent: lesson 15 (lessons/15_zero_fsdp.py)

New since lesson 15: FSDP2 only, checkpointed with torch.distributed.checkpoint (DCP): each rank
writes its own shards, nobody gathers the model. --stop-at-step K saves after step K and exits;
--resume DIR continues at any --world-size and ends with the uninterrupted run's weights. Then
async_save against save, and the checkpoint made into one torch.save file for a plain model.
Lesson 15's byte and collective counts stay there: a checkpoint changes neither (only its
peak of one step is printed here too); the root stays at FSDP2's default, as in lesson 15.
Each save is written beside its folder and renamed into place whole, with checkpoint.json
(what made it, each file's sha256) written last; a resume checks it all, and reads DCP's
.metadata pickle with an allow-list, so a crafted one runs no code
(lessons/16_distributed_checkpoint/checkpointing.py).

Run:
    make lesson-16
    make lesson-16 ARGS="--stop-at-step 60 --checkpoint runs/ckpt-16"
    .venv/bin/python lessons/16_distributed_checkpoint.py --world-size 3 --resume runs/ckpt-16

Doc: docs/16_distributed_checkpoint.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 16_distributed_checkpoint/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from apparatus import sharding
from apparatus.memory import StepPeak, report_peak
import checkpointing
from common import transformer as T
from apparatus.state_dicts import load_into
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--strategy", choices=("fsdp",), default="fsdp", help="FSDP2 (ZeRO-3); lesson 15 has the others")
    parser.add_argument("--stop-at-step", type=positive_int, help="save after this step, and exit")
    parser.add_argument("--checkpoint", type=Path, help="DCP checkpoint folder (default: checkpoint/ in --out, so runs/lesson-16/checkpoint)")
    parser.add_argument("--resume", type=Path, help="a DCP checkpoint folder to continue from")
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                        help="fsdp: the blocks keep their gathered weights until backward (the root always does)")
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")  # before any rank starts
    return checkpointing.check(args)  # --stop-at-step before --steps, also before; --checkpoint's default


def checkpoint_state(model, optimizer, step: int) -> dict:  # my shards (DTensors), and the step
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


def main() -> None:
    args = parse_args()
    folder = claim_out(out_dir("16", args.out))  # checked now, not after training; ours alone
    checkpointing.claim(args, folder)  # --checkpoint too, locked; then the --resume folder, checked
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 16: {args.strategy} on {args.world_size} ranks, with a distributed checkpoint")

    # Step 1: Start the ranks, one device each
    ui.step(1, "Start the ranks, one device each")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(note or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    try:
        spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)
    finally:  # a save killed half way: the earlier checkpoint in place, no temporary folder left
        checkpointing.tidy(args.checkpoint, folder / "checkpoint-async")


def worker(rank: int, world: int, args, kind: str) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = pick_device(kind, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", args.timeout, device)  # async_save: CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Make the data
    # Sequences from an order-2 Markov chain: the next token depends on the previous two,
    # so the model must use attention to see them. We know the chain's transition table,
    # so we can compute the best loss any model could reach: the floor.
    ui.step(2, "Make the data")
    x, y = T.batch(0, args.seed)
    ui.print(f"{T.VOCAB} tokens; one global batch = {tuple(x.shape)} inputs and "
             f"{tuple(y.shape)} targets (the inputs shifted by one)")
    for row in (0, 1):  # some pairs of tokens are almost always followed by the same token
        ui.print(f"row {row}: {x[row, :12].tolist()} ... -> targets {y[row, :12].tolist()} ...")
    floor = T.loss_floor()
    ui.print(f"loss of uniform guessing: ln {T.VOCAB} = {torch.tensor(T.VOCAB).log():.4f}; "
             f"the floor (best possible): {floor:.4f} nats/token")

    # Step 3: Build the model, shard it, load its shards (--resume)
    ui.step(3, "Build the model, shard it, load its shards (--resume)")
    model = T.make_model(args.seed).to(device)
    if args.strategy == "fsdp":  # ZeRO-3: each block one FSDP group, then the root (the rest)
        mesh = dist.init_device_mesh(device.type, (world,))
        for block in model.blocks:  # --no-reshard-after-forward: keep them gathered till backward
            fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
        fully_shard(model, mesh=mesh)  # the root at its default: gathered once, kept for backward
        sharding.show_shards(ui, model)
    optimizer = T.make_optimizer(model)
    start, end = 0, args.stop_at_step or args.steps
    if args.resume:  # each rank reads the pieces of its own shards, whatever world saved them
        state = checkpoint_state(model, optimizer, 0)  # my shards: the places to fill
        dcp.load(state, storage_reader=checkpointing.Reader(args.resume),  # in place; checked,
                 planner=checkpointing.Planner())  # and no pickle code (bytes: weights_only)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = checkpointing.show_resumed(ui, state, optimizer)  # the step saved, AdamW's step counter
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train from start to end (--resume, --stop-at-step)
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # A batch depends on its step alone: a resumed run sees the batches the whole run would.
    # torch's FSDPMemTracker follows the last step on every rank (apparatus/memory.py).
    ui.step(4, "Train from start to end (--resume, --stop-at-step)")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    peak = StepPeak(model, optimizer, end - 1)  # slows the ops it sees: one step only
    with ui.progress(end - start, "training") as bar:
        for step in range(start, end):
            peak.at(step)
            x, y = T.batch(step, args.seed)
            x, y = T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1 - start) * x.numel()):>9,.0f} tokens/s")
    peak.stop()  # the tracker leaves the ops alone again
    wall = timer.seconds
    # Between steps a rank holds its shards; inside one, gathered groups and activations too.
    peaks = report_peak(ui, peak, sum(sharding.held_bytes(model, optimizer).values()))  # every rank's
    resharded = checkpointing.show_resharding(ui, model)  # which groups freed their gathered weights
    final_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = T.mean_over_ranks(losses)
    ref = checkpointing.show_losses(ui, losses, start, end, args.seed, args.steps, log_every)

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Save a distributed checkpoint
    # Each rank writes the shards it holds, into a folder beside the checkpoint; rank 0 then
    # renames it into place, so a kill mid-save leaves the earlier checkpoint whole.
    ui.step(6, "Save a distributed checkpoint")
    folder = out_dir("16", args.out)
    timer = Timer()
    with checkpointing.save_beside(args.checkpoint, args, end) as beside:  # then renamed into place, whole
        dcp.save(checkpoint_state(model, optimizer, end), checkpoint_id=beside)  # every rank writes its own file
    checkpointing.show_files(ui, args.checkpoint, model, blocking := timer.seconds)
    if args.stop_at_step:  # interrupted on purpose: the checkpoint is all this run leaves
        return teardown()

    # Step 7: Save without stopping training
    ui.step(7, "Save without stopping training")
    timer = Timer()
    with checkpointing.save_beside(folder / "checkpoint-async", args, end) as beside:
        future = dcp.async_save(checkpoint_state(model, optimizer, end), checkpoint_id=beside)
        ui.print(f"dcp.save blocked training {blocking:.3f}s; dcp.async_save returned a {type(future).__name__} in {timer.seconds:.3f}s")
        future.result()  # wait before the next save (and before exiting): now the files are done

    # Step 8: Make the checkpoint one torch.save file
    # For whoever runs no FSDP2 (evaluation, a model hub): one process reads every shard.
    ui.step(8, "Make the checkpoint one torch.save file")
    samples = (end - start) * T.GLOBAL_BATCH
    del optimizer
    if rank != 0:  # rank 0 alone writes
        return teardown()
    # DCP's own reader here unpickles .metadata as it finds it: first, every file as saved
    checkpointing.verify(args.checkpoint, f"--checkpoint {args.checkpoint}")
    dcp_to_torch_save(args.checkpoint, folder / "from-dcp.pt")
    load_into(loaded := T.make_model(args.seed + 1), torch.load(folder / "from-dcp.pt", weights_only=True)["model"])
    ui.print(f"{shown(folder / 'from-dcp.pt')} in a plain model: max |w - final| = {max_abs_diff(loaded.state_dict(), final_state):.1e}")

    # Step 9: Compare with lesson 13, save the results
    # final_state is the full state dict gathered to rank 0's CPU: a plain model loads it.
    # Lesson 13's weights within 1e-3, beside the floor: one process in N chunks, as N ranks.
    ui.step(9, "Compare with lesson 13, save the results")
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=world)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")
    save_results(folder, final_state, make_metrics(
        lesson="16", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, **compared, start_step=start, reference_losses=ref,
        resharded_after_forward=resharded, **peaks))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")
    teardown()


if __name__ == "__main__":
    run(main)
