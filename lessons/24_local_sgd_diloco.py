"""Lesson 24: training that talks less: LocalSGD and DiLoCo by hand.

Parent: lesson 14 (lessons/14_ddp_by_hand.py)

New since lesson 14: no gradient all-reduce every step. Each replica takes H inner steps (AdamW)
on its own rows, alone; then all average their pseudo-gradients (start weights minus end
weights) in one all-reduce and step an outer optimizer: SGD lr 1 (LocalSGD: the average) or
Nesterov (DiLoCo). H = 1 with SGD inside is DDP; bytes are 1/H of DDP's; a replica drops out and
comes back; the weights equal the N replicas simulated in one process. Each run is measured
beside DDP, LocalSGD and DiLoCo on the same batches (Step 5); --sweep does it at H = 1, 4, 16,
64, and for six outer lr/momentum settings (Step 7).

Run:
    make lesson-24
    make lesson-24 ARGS="--sync-every 16 --drop-rank 1 --drop-at 2"
    make lesson-24 ARGS="--sweep"
    .venv/bin/python lessons/24_local_sgd_diloco.py --world-size 4 --inner sgd --outer sgd

Doc: docs/24_local_sgd_diloco.md
"""
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 24_local_sgd_diloco/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist

import diloco
import talk_report
from apparatus.comm import CommLog
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=64,
                        help="inner steps (one global batch each, shared out over the replicas)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    diloco.add_flags(parser)  # --sync-every, --inner, --outer, --sweep, --drop-rank, --drop-at
    return diloco.check_flags(parser.parse_args())  # each one line and exit 2, before any rank starts


def outer_step(model, outer, outer_optimizer, group=None):
    """Average the pseudo-gradients (theta_start - theta_end) over the replicas in `group`, in
    one all-reduce, and step the outer optimizer; every replica starts the next round there."""
    flat = torch.cat([(o - p.detach()).flatten() for o, p in zip(outer, model.parameters())])
    dist.all_reduce(flat, group=group)  # a SUM over the replicas present
    flat /= dist.get_world_size(group)
    diloco.apply_outer(model, outer, outer_optimizer, flat)  # o.grad = average; step; weights = outer


def train(plan, rank, device, group=None, log=None, ui=None, bar=None):
    """Lesson 14's loop without HandDDP: plan.steps inner steps on this rank's rows, an outer
    step every plan.H; a replica that is away (plan.away) trains on nothing and misses one outer
    step, then a peer sends it the outer weights. Returns (model, losses, was I here)."""
    model = T.make_model(plan.seed).to(device)  # the same seed: every replica starts the same
    optimizer = diloco.make_inner(model, plan.inner)  # each replica's own: never averaged
    outer, outer_optimizer = diloco.make_outer(model, plan)
    losses, here = torch.zeros(plan.steps, dtype=torch.float64), torch.ones(plan.steps, dtype=torch.float64)
    timer, log_every = Timer(), max(plan.H, plan.steps // 4)
    for step in range(plan.steps):
        if plan.away(rank, step):
            here[step] = 0  # gone: no data, no step, and no outer step at the end of this round
        else:
            x, y = T.batch(step, plan.seed)
            x, y = x.to(device), y.to(device)
            x, y = T.shard(x, rank, plan.world), T.shard(y, rank, plan.world)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()  # no gradient all-reduce: this replica moves alone
            losses[step] = loss.item()
        if (step + 1) % plan.H == 0:
            with log.recording() if log else contextlib.nullcontext():
                if plan.drop_at != (step + 1) // plan.H:
                    outer_step(model, outer, outer_optimizer)
                else:  # one is away: the others average what they have, then a peer sends
                    if not plan.away(rank, step):
                        outer_step(model, outer, outer_optimizer, group)
                    if diloco.come_back(plan, rank, model, outer, outer_optimizer):  # its outer weights
                        optimizer = diloco.make_inner(model, plan.inner)  # a new process: a new AdamW
        if bar is not None:
            bar.advance()
        if ui is not None and (step + 1) % log_every == 0:
            ui.print(f"step {step + 1:>4}/{plan.steps} | outer step {(step + 1) // plan.H:>3} | "
                     + (f"loss {losses[step]:.4f}" if here[step] else "away        ") +
                     f" | {timer.rate((step + 1) * T.GLOBAL_BATCH // plan.world * T.SEQ):>9,.0f} tokens/s")
    return model, losses, here


def main() -> None:
    args = parse_args()
    claim_out(out_dir("24", args.out))  # checked now, not after training; ours alone
    kind, note = plan_device(args.device, args.world_size)  # one GPU per rank, or the CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, kind, note), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 24: LocalSGD and DiLoCo on {world} replicas" + (f" ({note})" if note else ""))

    # Step 1: Choose this rank's device and join the process group
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and the ranks share the cores anyway.
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
    # Each replica trains on its own rows of every batch, as in lesson 14: here they are the
    # data that one data centre holds.
    ui.step(2, "Make the data")
    x, y = T.batch(0, args.seed)
    ui.print(f"{T.VOCAB} tokens; one global batch = {tuple(x.shape)} inputs and "
             f"{tuple(y.shape)} targets (the inputs shifted by one); "
             f"each replica trains on {T.GLOBAL_BATCH // world} of its rows")
    floor = T.loss_floor()
    ui.print(f"the floor (best possible loss): {floor:.4f} nats/token")

    # Step 3: Build the model, an inner optimizer per replica, and the outer optimizer
    # The outer weights are a copy of the model's: where every round starts (theta_start).
    ui.step(3, "Build the model, an inner optimizer per replica, and the outer optimizer")
    plan = diloco.Plan.of(args)
    group = diloco.present_group(plan, world)  # every rank creates it, even the one it leaves out
    talk_report.describe(plan, ui)

    # Step 4: Train: H inner steps alone, then one outer step together
    # The loop is train() above; CommLog records the outer steps (and nothing else talks).
    ui.step(4, "Train: H inner steps alone, then one outer step together")
    log, timer = CommLog(), Timer()
    with ui.progress(args.steps, "training") as bar:
        model, losses, here = train(plan, rank, device, group, log, ui, bar)
    wall = timer.seconds
    dist.all_reduce(losses)  # sum the replicas' losses and count who was there:
    dist.all_reduce(here)
    losses = (losses / here).tolist()  # the mean over the replicas present
    final_state = plain_state_dict(model)  # the outer weights: the same on every replica

    # Step 5: Evaluate against the floor and against DDP
    # Talking less is worth its loss only beside what talking every step reaches: DDP, and the
    # other outer step, on the same batches from the same weights (fresh runs, kept in `done`).
    ui.step(5, "Evaluate against the floor and against DDP")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")
    again = lambda p, log=None: train(p, rank, device, log=log)  # noqa: E731  (a fresh run, no output)
    done = {}  # the runs made so far, so that Steps 7 and 8 reuse them
    same = talk_report.same_batches(plan, held_out, losses, log, rank, device, again, done, ui)

    # Step 6: Compare with DDP: H = 1 with SGD inside is DDP; with AdamW inside it is not
    # Fresh short runs, ours and torch's (DistributedDataParallel; PostLocalSGDOptimizer)
    ui.step(6, "Compare with DDP: H = 1 with SGD inside is DDP; with AdamW inside it is not")
    short = dataclasses.replace(plan, steps=min(4, args.steps), H=1, outer="sgd", drop_rank=None, drop_at=None)
    proofs = talk_report.against_torch(short, rank, device, again, ui)

    # Step 7: Count the bytes: 1/H of DDP's
    ui.step(7, "Count the bytes: 1/H of DDP's")
    sent = talk_report.bytes_per_sample(log, plan, ui, proofs)
    if args.sweep:  # DDP, LocalSGD and DiLoCo at each H, and the outer step's lr and momentum
        sweep, settings = talk_report.sweep(plan, rank, device, again, done, out_dir("24", args.out), ui)
    else:
        sweep, settings = talk_report.no_sweep(ui)

    # Step 8: One replica drops out and comes back: what it cost
    ui.step(8, "One replica drops out and comes back: what it cost")
    dropout = talk_report.dropout_cost(plan, held_out, log, rank, device, again, done, ui)
    del model
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return

    # Step 9: Compare the weights with the N replicas in one process, save the results
    ui.step(9, "Compare the weights with the N replicas in one process, save the results")
    one = diloco.simulate(plan)
    diff = max((final_state[k].double() - one["state"][k].double()).abs().max().item() for k in final_state)
    ui.print(f"same weights as {world} replicas simulated in one process? max |w - w_sim| = "
             f"[bold]{diff:.1e}[/bold] (allowed 1e-4); losses {max(abs(a - b) for a, b in zip(losses, one['losses'])):.1e} apart")
    folder, samples = out_dir("24", args.out), plan.samples()
    save_results(folder, final_state, make_metrics(
        lesson="24", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out, loss_floor=floor,
        sync_every=plan.H, inner=plan.inner, outer=plan.outer, **sent, **proofs, same_batches=same,
        sweep=sweep, outer_settings=settings, dropout=dropout, max_abs_diff_vs_single_process=diff,
        held_out_loss_single_process=one["held_out"]))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
