"""Lesson 14: DDP by hand, from lesson 10's all-reduce up.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13: N processes train lesson 13's transformer, each on 1/N of every batch,
through HandDDP, our own DistributedDataParallel: rank 0's weights broadcast, then a hook
starts each gradient's all-reduce (or its bucket's) as soon as backward has produced it, and
finish_gradient_synchronization() waits and averages before the optimizer steps. We count
the all-reduces, their bytes and their overlap with backward, beside torch's DDP, and end
with lesson 13's weights (within 1e-3) and torch DDP's. Lesson 13's memory steps stay in
lesson 13: every rank here holds what one device held there; only the peak of one step is
printed, per rank, beside it.

Run:
    make lesson-14
    make lesson-14 ARGS="--world-size 4 --bucket-mb 0.05"
    .venv/bin/python lessons/14_ddp_by_hand.py --world-size 3 --device cpu

Doc: docs/14_ddp_by_hand.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist

from apparatus.comm import COLUMNS, compare, counted_ddp, table_rows
from apparatus.memory import StepPeak, report_peak, state_bytes
from common import transformer as T
from common.cli import lesson_parser, positive_float, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--bucket-mb", type=positive_float, default=0.1,
                        help="MiB of gradients per all-reduce, like DDP's bucket_cap_mb")
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")  # every rank takes as many rows
    return args


class HandDDP(torch.nn.Module):
    """DistributedDataParallel by hand, around any model. Call finish_gradient_synchronization()
    after loss.backward(), before optimizer.step(). bucket_mb=None: one all-reduce per gradient."""

    def __init__(self, module, bucket_mb=None):
        super().__init__()
        self.module, self.world = module, dist.get_world_size()
        for t in [*module.parameters(), *module.buffers()]:  # a tied tensor is listed once
            dist.broadcast(t.detach(), src=0)  # every rank starts from rank 0's weights
        # Buckets in backward's order, the head's first; frozen parameters get no gradient
        cap, self.buckets = (bucket_mb or 0) * 2**20, [[]]
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            if self.buckets[-1] and sum(q.numel() * q.element_size() for q in self.buckets[-1] + [p]) > cap:
                self.buckets.append([])
            self.buckets[-1].append(p)
            # autograd calls it once per backward, when p.grad holds all of p's gradient
            p.register_post_accumulate_grad_hook(lambda _, i=len(self.buckets) - 1: self._grad_ready(i))
        self.missing, self.pending = [len(b) for b in self.buckets], []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, i):
        self.missing[i] -= 1
        # Start buckets in order: all ranks must call the same collectives in the same order
        while len(self.pending) < len(self.buckets) and self.missing[len(self.pending)] == 0:
            bucket = self.buckets[len(self.pending)]  # one flat tensor: one message
            flat = torch.cat([p.grad.flatten() for p in bucket])
            self.pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))  # no wait

    def finish_gradient_synchronization(self):
        assert len(self.pending) == len(self.buckets), "a parameter got no gradient this step"
        for bucket, flat, work in self.pending:
            work.wait()
            flat.div_(self.world)  # a SUM, then divide (ReduceOp.AVG works too, gloo included)
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(g.view_as(p))
        self.missing, self.pending = [len(b) for b in self.buckets], []


def main() -> None:
    args = parse_args()
    claim_out(out_dir("14", args.out))  # checked now, not after training; ours alone
    kind, note = plan_device(args.device, args.world_size)  # one GPU per rank, or the CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, kind, note), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 14: DDP by hand on {world} processes" + (f" ({note})" if note else ""))

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

    # Step 3: Build the model, move it to the device, wrap it in HandDDP
    ui.step(3, "Build the model, move it to the device, wrap it in HandDDP")
    model = T.make_model(args.seed).to(device)
    ddp_model = HandDDP(model, args.bucket_mb)
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train, all-reducing the gradients during backward
    # Lesson 13's loop on this rank's rows, plus one line: the hooks start the all-reduces
    # inside loss.backward(); finish_gradient_synchronization() waits for them and averages.
    # torch's MemTracker follows the last step on every rank (apparatus/memory.py).
    ui.step(4, "Train, all-reducing the gradients during backward")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    peak = StepPeak(model, optimizer, args.steps - 1)  # slows the ops it sees: one step only
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            peak.at(step)
            x, y = T.batch(step, args.seed)
            x, y = x.to(device), y.to(device)
            x, y = T.shard(x, rank, world), T.shard(y, rank, world)
            loss = T.loss_fn(ddp_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ddp_model.finish_gradient_synchronization()
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    peak.stop()  # the tracker leaves the ops alone again
    wall = timer.seconds
    # At rest each rank holds what lesson 13's one device held; inside a step come the
    # activations of its own rows (1/N of lesson 13's) and temporaries, HandDDP's buckets too.
    peaks = report_peak(ui, peak, sum(state_bytes(model, optimizer).values()))  # every rank's
    dist.all_reduce(every := torch.tensor(losses, device=device))  # sum the ranks' losses:
    losses = (every / world).tolist()  # their mean is the whole batch's loss
    final_state = plain_state_dict(model)  # what we save; the comparison below trains fresh copies

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Count the all-reduces, compare the weights
    # Fresh runs recorded by apparatus/comm.py (every all-reduce: bytes, start, end; backward's
    # compute time). torch's DDP trains the whole run. The floor: lesson 13 summing in N chunks.
    ui.step(6, "Count the all-reduces, compare the weights")
    mb, make = args.bucket_mb, lambda: T.make_model(args.seed).to(device)  # noqa: E731
    local = lambda s: [T.shard(t, rank, world).to(device) for t in T.batch(s, args.seed)]  # noqa: E731
    runs = compare({"HandDDP per parameter": HandDDP, f"HandDDP {mb:g} MiB": lambda m: HandDDP(m, mb),
                    f"torch DDP {mb:g} MiB": lambda m: counted_ddp(m, bucket_cap_mb=mb)},
                   make, T.make_optimizer, local, T.loss_fn, [7, 7, args.steps])  # 1 warm-up step
    ui.table("All-reduces per step, on rank 0", COLUMNS, table_rows(runs))
    diff_torch = max_abs_diff(final_state, runs[f"torch DDP {mb:g} MiB"][1])
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=world)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}; max |w - w_torch_ddp| = {diff_torch:.1e}")

    # Step 7: Save the results
    # Lesson 13's keys, plus what Step 6 counted and compared.
    ui.step(7, "Save the results")
    folder = out_dir("14", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="14", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, bucket_mb=mb,
        comm={name: summary for name, (summary, _) in runs.items()}, **compared,
        max_abs_diff_vs_torch_ddp=diff_torch, **peaks))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
