"""Lesson 15: ZeRO and FSDP2: each rank holds a shard of the optimizer state, gradients, weights.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13: the same transformer on N ranks, each on 1/N of every batch, and lesson
13's bytes (4 + 4 + 8 per parameter) split across them. --strategy ddp: every rank holds all;
zero1: ShardedOptimizer (ZeRO-1 by hand, below) keeps on each rank the AdamW state of its own
parameters; zero1-torch: torch's ZeroRedundancyOptimizer; fsdp: fully_shard on every block and
the root (ZeRO-3; --no-reshard-after-forward: ZeRO-2-like). Measured on every rank: the bytes
it holds and sends per step beside their formulas, the peak of one step (torch's MemTracker),
and lesson 13's weights within 1e-3. Lesson 13's activation steps stay there.

Run:
    make lesson-15
    make lesson-15 ARGS="--strategy zero1 --world-size 3"
    .venv/bin/python lessons/15_zero_fsdp.py --world-size 4 --no-reshard-after-forward

Doc: docs/15_zero_fsdp.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 15_zero_fsdp/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus import sharding  # what each rank holds and sends, beside the formulas (15, 16, 19)
import sharded  # this lesson's own helpers: ZeRO-1's flat rows, FSDP2's story, the step recorder
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--strategy", choices=("ddp", "zero1", "zero1-torch", "fsdp"),
                        default="fsdp", help="what each rank keeps (see the docstring)")
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                        action="store_false", help="fsdp: keep gathered weights until backward")
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")  # before any rank starts
    return args


class ShardedOptimizer(sharded.DropIn):
    """ZeRO-1 by hand, with ZeroRedundancyOptimizer's constructor. Whole parameters are dealt
    to the ranks (biggest first, to the least loaded), so any optimizer class sees whole
    tensors; each rank's optimizer_class (self.optim) holds its own parameters' state only.
    step() reduce-scatters the gradients, steps this rank's parameters and all-gathers them."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(list({id(p): p for p in params}.values()), defaults)  # tied: once
        load, self.shards = [0] * dist.get_world_size(), [[] for _ in range(dist.get_world_size())]
        for p in sorted(self.param_groups[0]["params"], key=lambda p: -p.numel()):  # same order
            self.shards[owner := load.index(min(load))].append(p)              # on every rank
            load[owner] += p.numel()
        # collectives want equal pieces: every rank's row is padded to the biggest shard
        self.size, self.device = max(load), self.param_groups[0]["params"][0].device
        self.adopt(optimizer_class([{"params": self.shards[dist.get_rank()]}], **defaults))  # (DropIn)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.run(closure)  # with gradients on, as torch's optimizers run it
        rows = torch.stack([sharded.flat_row(s, self.size, self.device, grad=True) for s in self.shards])
        mine, row = self.shards[dist.get_rank()], rows.new_empty(self.size)
        dist.reduce_scatter_single(row, rows.view(-1))  # row `rank` of every rank, summed
        for p, grad in zip(mine, sharded.pieces(row / dist.get_world_size(), mine)):
            p.grad = grad.clone() if p.grad is not None else None  # sum of N means -> the mean
        self.optim.step()
        dist.all_gather_single(rows.view(-1), sharded.flat_row(mine, self.size, self.device))
        sharded.unflatten(rows, self.shards)  # every rank's updated parameters, to every rank
        return loss


def main() -> None:
    args = parse_args()
    claim_out(out_dir("15", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 15: {args.strategy} on {args.world_size} ranks")

    # Step 1: Start the ranks, one device each
    ui.step(1, "Start the ranks, one device each")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(note or f"{args.world_size} ranks, one GPU each")
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
    # Lesson 13's batches (its Step 2 shows them and their floor): rank r trains on rows
    # [r B/N, (r+1) B/N) of each, so the N ranks together see the whole batch.
    ui.step(2, "Make the data")
    floor = T.loss_floor()
    ui.print(f"lesson 13's batches: {T.GLOBAL_BATCH} sequences of {T.SEQ} tokens per step, "
             f"{T.GLOBAL_BATCH // world} on each of the {world} ranks; the floor {floor:.4f} nats/token")

    # Step 3: Build the model, then shard it (--strategy)
    ui.step(3, "Build the model, then shard it (--strategy)")
    model = T.make_model(args.seed).to(device)
    if args.strategy == "fsdp":  # ZeRO-3: each block one FSDP group, then the root (the rest)
        mesh = dist.init_device_mesh(device.type, (world,))
        for block in model.blocks:  # --no-reshard-after-forward: keep them gathered till backward
            fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
        fully_shard(model, mesh=mesh)  # the root at its default: gathered once, kept for backward
        sharding.show_shards(ui, model)
    train_model = model  # what the batches go through; DDP's gradients live in its buckets
    if args.strategy in ("ddp", "zero1-torch"):
        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
    optimizer = T.make_optimizer(model)
    if args.strategy.startswith("zero1"):  # ZeRO-1 by hand, or torch's: the same constructor
        zero = ShardedOptimizer if args.strategy == "zero1" else ZeroRedundancyOptimizer
        optimizer = zero(model.parameters(), torch.optim.AdamW, lr=T.LR, eps=T.EPS)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train, recording the collectives and the peak memory
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # On this rank's rows; the recorder notes the collectives the strategy makes, FSDP2's
    # hooks, and the peak memory of one step.
    ui.step(4, "Train, recording the collectives and the peak memory")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    record = sharded.StepRecorder(model, optimizer, args.steps, log_every)  # the printed steps
    with ui.progress(args.steps, "training") as bar, record:
        for step in range(args.steps):
            record.at(step)  # CommLog on the printed steps, MemTracker on the last (slower ops)
            x, y = T.batch(step, args.seed)
            x, y = T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)
            loss = T.loss_fn(train_model(x), y)
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

    # Step 6: Count the bytes each rank holds and sends
    # From each rank's own tensors (local shards, padding included), beside the ZeRO formulas.
    ui.step(6, "Count the bytes each rank holds and sends")
    per_rank = sharding.report_bytes(ui, model, optimizer, args.strategy)  # every rank's table
    held, one_device = sum(per_rank["per_rank_bytes"].values()), 16 * n_params  # lesson 13: 4 + 4 + 8
    ui.print(f"rank 0 holds {held:,} bytes, {held / n_params:.1f} per parameter: "
             f"{held / one_device:.0%} of the {one_device:,} one device holds (lesson 13)")
    peaks = record.report_peak(ui, held)  # every rank's peak, beside what it holds
    comm = sharded.report_comm(ui, record, args, optimizer)

    # Step 7: Compare with lesson 13, save the results
    # final_state is the full state dict gathered to rank 0's CPU: a plain model loads it.
    # Lesson 13's weights within 1e-3, beside the floor: one process in N chunks, as N ranks.
    ui.step(7, "Compare with lesson 13, save the results")
    folder = out_dir("15", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    del train_model, optimizer
    if rank != 0:  # rank 0 alone writes
        return teardown()
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=world)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")
    save_results(folder, final_state, make_metrics(
        lesson="15", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, **compared, **comm, **per_rank, **peaks))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")
    teardown()


if __name__ == "__main__":
    run(main)
