"""Lesson 18: pipeline schedules, and where the bubble goes.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13 (grown out of lesson 04's hand-made pipeline): the transformer cut into
stages on P processes, run by torch.distributed.pipelining on M micro-batches per batch with
GPipe, 1F1B, Interleaved1F1B or a zero-bubble schedule. Each schedule's timeline, drawn from
the actions it ran; its idle time (the bubble) beside (p-1)/(v·m+p-1); the micro-batches a
stage holds at once, which is the memory a schedule costs. It ends with lesson 13's weights.

Kept from lesson 13: its recipe, data, loop and evaluation; its memory steps stay there.

Run:
    make lesson-18
    make lesson-18 ARGS="--schedule gpipe --microbatches 8"
    .venv/bin/python lessons/18_pipeline_schedules.py --world-size 4 --schedule zero-bubble --device cpu

Doc: docs/18_pipeline_schedules.md
"""
import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 18_pipeline_schedules/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from torch.distributed import pipelining as pp

from pipeline import Recorder, check_flags, describe, metrics_of, show_schedule, show_summary
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, say_each, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer

# The interleaved ones hold 2 stages per rank: rank r runs stages r and r + P
SCHEDULES = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
             "interleaved": pp.ScheduleInterleaved1F1B, "zero-bubble": pp.ScheduleInterleavedZeroBubble}


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                        help="the pipeline schedule that trains the model")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="micro-batches per batch (M): each stage works on one at a time")
    return parser.parse_args()


def stage_model(model, stage, n_stages):
    """A copy of `model` cut down to one stage. The model is 4 pieces in a row: embeddings,
    block 0, block 1, final norm + head. They are spread evenly, the first piece on stage 0
    and the last on the last stage; a stage without a piece passes its input on unchanged."""
    pieces = T.N_BLOCKS + 2
    mine = [i for i in range(pieces) if round(i * (n_stages - 1) / (pieces - 1)) == stage]
    part = copy.deepcopy(model)
    for i in range(T.N_BLOCKS):  # Identity in place of other stages' blocks keeps the
        if i + 1 not in mine:    # numbers of ours: the weights keep lesson 13's names
            part.blocks[i] = torch.nn.Identity()
    if 0 not in mine:
        part.tok_emb = part.pos_emb = None  # forward skips them: it receives activations
    if pieces - 1 not in mine:
        part.norm = part.head = None  # forward returns the blocks' output, to be sent on
    return part


def build_pipeline(name, model, rank, world, microbatches, device):
    """This rank's stages of `model` and the schedule that runs them."""
    per_rank = 1 if name in ("gpipe", "1f1b") else 2
    ids = [rank + k * world for k in range(per_rank)]
    parts = [stage_model(model, s, per_rank * world).to(device) for s in ids]
    stages = [pp.PipelineStage(p, s, per_rank * world, device) for p, s in zip(parts, ids)]
    # loss_fn gives each micro-batch's mean loss; the schedule sums their gradients and divides
    # by M (scale_grads=True): with equal micro-batches, that is the whole batch's mean
    schedule = SCHEDULES[name](stages if per_rank > 1 else stages[0], microbatches, loss_fn=T.loss_fn)
    return schedule, stages, parts


def main() -> None:
    args = parse_args()
    claim_out(out_dir("18", args.out))  # checked now, not after training; ours alone
    check_flags(args.world_size, args.microbatches, T.GLOBAL_BATCH)  # one clear line if they do not fit
    kind, note = plan_device(args.device, args.world_size)  # one GPU per rank, or the CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, kind, note), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 18: pipeline schedules on {world} processes" + (f" ({note})" if note else ""))

    # Step 1: Choose this rank's device and join the process group
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(1, "Choose this rank's device and join the process group")
    device = rank_device(kind, rank)  # one GPU per rank (cuda:<rank>), or the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun would set them
    init_from_env(backend_for(device), args.timeout, device)  # lesson 05's init_process_group
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

    # Step 3: Cut the model into pipeline stages
    # Every rank builds the whole model from the same seed, then keeps only its stages' pieces.
    ui.step(3, "Cut the model into pipeline stages")
    model = T.make_model(args.seed).to(device)
    schedule, stages, parts = build_pipeline(args.schedule, model, rank, world, args.microbatches, device)
    mine = torch.nn.ModuleList(parts)  # this rank's stages: all it trains
    optimizer = T.make_optimizer(mine)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")
    say_each(ui, describe(stages, parts))  # which pieces each rank holds

    # Step 4: Train with a pipeline schedule
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # The schedule runs forward and backward of all M micro-batches; the loss is on the last rank.
    ui.step(4, "Train with a pipeline schedule")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            # Every rank passes the batch: only the first stage reads x (the others receive
            # activations), only the last reads y and fills mb_losses, one loss per micro-batch
            schedule.step(x, target=y, losses=(mb_losses := []))
            optimizer.step()
            loss = torch.tensor(sum(l.item() for l in mb_losses) / args.microbatches, device=device)
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                dist.broadcast(loss, src=world - 1)  # the last rank has it; rank 0 prints it
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    dist.broadcast(every := torch.tensor(losses, device=device), src=world - 1)
    losses = every.tolist()
    every = [None] * world  # every rank's stages' weights, already under lesson 13's names
    dist.all_gather_object(every, {k: v for p in parts for k, v in plain_state_dict(p).items()})
    model.load_state_dict({k: v for part in every for k, v in part.items()})  # whole again
    final_state = plain_state_dict(model)  # what we save; the measurements below change no weight

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Draw each schedule's timeline and what its stages hold
    # Each schedule runs one batch on fresh stages: its timeline (1 unit per forward, 2 per
    # backward), and the micro-batches whose activations each stage holds until their backward.
    x, y = (t.to(device) for t in T.batch(0, args.seed))
    ui.step(6, "Draw each schedule's timeline and what its stages hold")
    folder, runs = out_dir("18", args.out), {}
    for name in SCHEDULES:
        sched, st, _ = build_pipeline(name, model, rank, world, args.microbatches, device)
        with Recorder(st) as rec:  # which action ran when, what each stage held (pipeline.py)
            sched.step(x, target=y)
        runs[name] = show_schedule(ui, name, rec, world, args.microbatches, folder)
    show_summary(ui, runs, world, args.microbatches)
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return

    # Step 7: Compare the weights with lesson 13's
    # The floor: lesson 13's run with each batch summed in M chunks, as the micro-batches sum it.
    ui.step(7, "Compare the weights with lesson 13's")
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=args.microbatches)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")

    # Step 8: Save the results
    # final.pt holds the gathered model under lesson 13's names: a plain model loads it.
    ui.step(8, "Save the results")
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="18", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, **metrics_of(runs, args.schedule, world, args.microbatches),
        **compared))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
