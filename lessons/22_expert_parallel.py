"""Lesson 22: expert parallel: a mixture of experts over all-to-all.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13: each block's MLP becomes E experts and a router (top-k, a capacity per
expert; lessons/22_expert_parallel/moe.py). N ranks hold E/N experts and 1/N of the rows each: an
all-to-all takes every token to its expert's rank and a second brings it home. Measured beside
the same model in one process: gradients, tokens per expert, drops, bytes, capacity 1.0 vs 2.0.

Run:
    make lesson-22
    make lesson-22 ARGS="--capacity-factor 2.0"
    .venv/bin/python lessons/22_expert_parallel.py --world-size 4 --experts 8 --top-k 2

Doc: docs/22_expert_parallel.md
"""
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 22_expert_parallel/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist

import moe
import moe_report
from apparatus.comm import CommLog
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=60,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    moe.add_flags(parser)  # --experts, --top-k, --capacity-factor, --dtype
    return moe.check_flags(parser.parse_args())  # k <= E; the world size divides the rows and the experts


def sync_gradients(model, world):
    """Shared parameters: all-reduce, as DDP does. An expert's one copy already holds every rank's
    gradient, summed by the all-to-all's backward: no all-reduce. Both: / N (Step 6 checks)."""
    shared = [p for name, p in model.named_parameters() if ".experts." not in name]
    flat = torch.cat([p.grad.flatten() for p in shared])  # one message, not one per tensor
    dist.all_reduce(flat)
    for p, g in zip(shared, flat.split([p.numel() for p in shared])):
        p.grad.copy_(g.view_as(p))
    for p in model.parameters():  # the same division for both kinds
        p.grad.div_(world)


def main() -> None:
    args = parse_args()
    folder = claim_out(out_dir("22", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    kind, note = plan_device(args.device, args.world_size)  # one GPU per rank, or the CPU
    ui.title(f"Lesson 22: expert parallel on {args.world_size} processes" + (f" ({note})" if note else ""))

    # Step 1: Train the same mixture of experts in one process
    # The baseline, and capacity factors 1.0 and 2.0 for Step 11: trained once, then cached.
    ui.step(1, "Train the same mixture of experts in one process")
    refs, trained = moe.train_baselines(args)  # trained: those the cache did not hold yet
    moe_report.show_baselines(refs, trained, args.steps, ui)
    ui.pause(next_step=(2, "Choose this rank's device and join the process group"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, moe.Setup.of(args), kind, folder), args.world_size)


def worker(rank: int, world: int, args, setup: moe.Setup, kind: str, folder: Path) -> None:
    ui = UI(rank, world, step_mode=args.step)

    # Step 2: Choose this rank's device and join the process group
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(2, "Choose this rank's device and join the process group")
    device = rank_device(kind, rank)  # one GPU per rank (cuda:<rank>), or the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun would set them
    init_from_env(backend_for(device), args.timeout, device)  # lesson 05's init_process_group
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 3: Make the data
    # Sequences from an order-2 Markov chain: the next token depends on the previous two,
    # so the model must use attention to see them. We know the chain's transition table,
    # so we can compute the best loss any model could reach: the floor.
    ui.step(3, "Make the data")
    x, y = T.batch(0, args.seed)
    ui.print(f"{T.VOCAB} tokens; one global batch = {tuple(x.shape)} inputs and "
             f"{tuple(y.shape)} targets (the inputs shifted by one)")
    floor = T.loss_floor()
    ui.print(f"loss of uniform guessing: ln {T.VOCAB} = {torch.tensor(T.VOCAB).log():.4f}; "
             f"the floor (best possible): {floor:.4f} nats/token")

    # Step 4: Replace each MLP with experts, keep this rank's share
    # Same router everywhere; expert e is seeded by its number, wherever it lives (Step 1 too).
    ui.step(4, "Replace each MLP with experts, keep this rank's share")
    model = moe.moe_model(setup, rank, world).to(device)
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in moe.moe_model(setup).parameters())  # every expert
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}; {setup.dtype}")
    moe_report.describe(model, rank, world, ui)  # who holds which expert, and the capacity

    # Step 5: Route one batch: the split sizes of the all-to-all
    ui.step(5, "Route one batch: the split sizes of the all-to-all")
    moe_report.show_routing(model, T.shard(x, rank, world).to(device), rank, world, ui)

    # Step 6: Scale the gradients: all-reduce the shared ones, not the experts'
    ui.step(6, "Scale the gradients: all-reduce the shared ones, not the experts'")
    grads = moe_report.check_gradients(model, sync_gradients, setup, rank, world, device, ui)

    # Step 7: Train, sending tokens to their experts and back with all-to-all
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # Ours: our rows, the balancing loss, sync_gradients; CommLog on logged steps (it is slow).
    ui.step(7, "Train, sending tokens to their experts and back with all-to-all")
    losses: list[float] = []
    seen, sent = [], []  # per step: tokens kept and dropped per expert; bytes into all-to-alls
    timer = Timer()
    log_every = max(1, args.steps // 5)
    logged, log = sorted({0, *range(log_every - 1, args.steps, log_every)}), CommLog()
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            x, y = x.to(device), y.to(device)
            x, y, calls = T.shard(x, rank, world), T.shard(y, rank, world), len(log.calls)
            with log.recording() if step in logged else contextlib.nullcontext():
                loss = T.loss_fn(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                (loss + moe.AUX_COEF * moe.aux_loss(model)).backward()
                sync_gradients(model, world)
            optimizer.step()
            losses.append(loss.item())
            seen.append(moe.counts(model))
            sent.append(sum(c.data_bytes for c in log.calls[calls:] if c.kind == "all_to_all"))
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    dist.all_reduce(every := torch.tensor(losses, device=device))  # sum the ranks' losses:
    losses = (every / world).tolist()  # their mean is the whole batch's loss
    dist.all_reduce(seen := torch.stack(seen))  # every rank's tokens: (steps, blocks, kept/dropped, E)
    dist.all_reduce(sent := torch.tensor(sent, device=device))
    final_state = moe.gather_state(model, world)  # every expert, under the one-process names

    # Step 8: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(8, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return
    refs, _ = moe.train_baselines(args)  # Step 1's, from the cache
    seen, sent = seen.cpu(), sent.cpu()

    # Step 9: Count tokens per expert and dropped tokens, beside one process's
    ui.step(9, "Count tokens per expert and dropped tokens, beside one process's")
    same = moe_report.show_counts(seen, refs[setup]["counts"], logged, ui)

    # Step 10: Count the all-to-all bytes beside the formula
    # All ranks, per step: 4 passes of every kept token's values, and E split sizes per rank and layer.
    ui.step(10, "Count the all-to-all bytes beside the formula")
    kept, width = seen[:, :, 0].sum((1, 2)), T.DIM * setup.torch_dtype.itemsize  # tokens; bytes per token
    formula = ((4 * width * kept + T.N_BLOCKS * world * setup.experts * 8) * (world > 1)).tolist()
    measured = {s + 1: int(sent[s]) for s in logged}  # the steps CommLog recorded
    moe_report.show_bytes(measured, formula, log, ui)

    # Step 11: Compare capacity factors 1.0 and 2.0
    ui.step(11, "Compare capacity factors 1.0 and 2.0")
    capacities = moe_report.compare_capacities(refs, setup, world, ui)

    # Step 12: Compare the weights with one process, save the results
    ui.step(12, "Compare the weights with one process, save the results")
    diff = max((w - refs[setup]["state"][k]).abs().max().item() for k, w in final_state.items())  # in float64
    ui.print(f"same weights as one process? max |w - w_1| = [bold]{diff:.1e}[/bold] (allowed 1e-3); same routing: {same}")
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="22", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, **moe_report.metrics(setup, seen, refs[setup], measured, formula, grads, capacities),
        max_abs_diff_vs_single_device=diff))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
