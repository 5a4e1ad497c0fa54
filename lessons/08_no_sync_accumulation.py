"""Lesson 08: gradient accumulation with no_sync(), one all-reduce per optimizer step.

New since lesson 05: every rank cuts its share of the global batch into `--accum-steps`
micro-batches and adds up their gradients before one optimizer step (the way to train a
big batch that does not fit in memory at once). Plain DDP all-reduces the gradients after
*every* micro-batch's backward; inside `with ddp_model.no_sync():` it does not, so they
travel once per optimizer step. A DDP communication hook counts every all-reduce, so you
see the saving as a number, and see what the classic mistakes really do.

Run:
    make lesson-08                                   # 2 ranks x 4 micro-batches of 12
    make lesson-08 ARGS="--accum-steps 8"
    .venv/bin/python lessons/08_no_sync_accumulation.py --world-size 2 --accum-steps 4 --bucket-cap-mb 0.01

Doc: docs/08_no_sync_accumulation.md
"""
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import recipe
from common.cli import fail, lesson_parser, positive_float, positive_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import choose_port, spawn, teardown
from common.results import make_metrics, max_abs_diff, out_dir, save_results, shown
from common.ui import UI, Timer, share_terminal_with_children

MAX_WORLD = 16  # more ranks than this on one machine teaches nothing but waiting


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    parser.add_argument("--accum-steps", type=positive_int, default=4,
                        help="micro-batches whose gradients are added up per optimizer step")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=None,
                        help="DDP's bucket size in MiB (default: DDP's own, 25); smaller "
                             "buckets mean more all-reduce calls per sync")
    args = parser.parse_args()
    n, a = args.world_size, args.accum_steps
    if n > MAX_WORLD:
        fail(f"--world-size {n} is more processes than make sense on one machine; use {MAX_WORLD} or fewer")
    if recipe.GLOBAL_BATCH % n:
        ok = [d for d in range(1, MAX_WORLD + 1) if recipe.GLOBAL_BATCH % d == 0]
        fail(f"--world-size {n} does not divide the global batch of {recipe.GLOBAL_BATCH} "
             f"samples into equal per-rank batches; use one of {', '.join(map(str, ok))}")
    per_rank = recipe.GLOBAL_BATCH // n
    if per_rank % a:
        ok = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        fail(f"--accum-steps {a} does not cut each rank's {per_rank} samples (global batch "
             f"{recipe.GLOBAL_BATCH} / {n} ranks) into equal micro-batches; use one of "
             f"{', '.join(map(str, ok))}")
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 08: gradient accumulation over {args.accum_steps} micro-batches "
             f"with no_sync(), on {args.world_size} processes")

    # Step 1: Start one process per rank with mp.spawn
    # Exactly lesson 05's start, through the helper it led to: pick the device kind once,
    # choose a free port for the rendezvous store, and start one worker per rank.
    ui.step(1, "Start one process per rank with mp.spawn")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(choose_port(args.master_port))
    ui.print(f"mp.spawn(worker, nprocs={args.world_size}) with MASTER_PORT={os.environ['MASTER_PORT']}")
    # --step: the children get /dev/null as stdin, so tell rank 0 which terminal to ask on
    share_terminal_with_children()
    ui.pause(next_step=(2, "Join the process group"))
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


def worker(rank: int, world_size: int, args, kind: str) -> None:
    ui = UI(rank, world_size, step_mode=args.step)
    share_cpu(world_size)
    accum = args.accum_steps

    # Step 2: Join the process group
    # As in lesson 05: env:// reads MASTER_ADDR/MASTER_PORT, and the timeout bounds every
    # collective, so a rank that stops answering becomes an error instead of a hang.
    ui.step(2, "Join the process group")
    device = rank_device(kind, rank)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    ui.print(f"{world_size} ranks joined over {backend}, each on {device.type}")

    # Step 3: Cut each rank's batch into micro-batches
    # One optimizer step still sees the recipe's 96 samples: world size x accum-steps x
    # micro-batch. The DataLoader yields micro-batches; every `accum` consecutive ones
    # belong to one optimizer step. With the same DistributedSampler as lesson 05, one
    # step's micro-batches on all ranks are exactly the 96 samples of lesson 01's step.
    ui.step(3, "Cut each rank's batch into micro-batches")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    micro = recipe.GLOBAL_BATCH // (world_size * accum)
    loader = DataLoader(data.train, batch_size=micro, sampler=sampler)
    steps_per_epoch = len(loader) // accum
    ui.print(f"global batch {recipe.GLOBAL_BATCH} = {world_size} ranks x {accum} micro-batches "
             f"x {micro} samples; {steps_per_epoch} optimizer steps per epoch, "
             f"{len(loader)} micro-batches per epoch on every rank")

    # Step 4: Count DDP's all-reduces with a communication hook
    # A comm hook replaces DDP's built-in all-reduce: the reducer calls it once per
    # *bucket* of gradients that is ready. Ours counts the call and the bucket's bytes,
    # then does exactly what DDP would have done (PyTorch's own allreduce_hook). Two
    # backward passes show how many buckets one sync needs: calls per sync = buckets.
    ui.step(4, "Count DDP's all-reduces with a communication hook")
    model, ddp_model, optimizer, counter = build(args, data, device)
    x, y = next(iter(loader))
    for i in range(2):
        calls, sent = counter.calls, counter.bytes
        F.cross_entropy(ddp_model(x.to(device)), y.to(device)).backward()
        ui.print(f"backward {i + 1}: {counter.calls - calls} all-reduce call(s) of "
                 f"{counter.sizes[calls:]} gradients, {counter.bytes - sent:,} bytes")
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"the model has {n_params:,} float32 parameters: one full sync sends "
             f"{4 * n_params:,} bytes from every rank")
    del model, ddp_model, optimizer

    # Step 5: Accumulate naively: DDP syncs every micro-batch
    # Gradient accumulation without no_sync: backward adds each micro-batch's gradient
    # into .grad, and the optimizer steps after `accum` of them. It is *correct* (DDP
    # all-reduces the running sum, and the sum of averages is the average of sums), but
    # every backward all-reduces: `accum` syncs per optimizer step where one would do.
    # Each micro-batch's loss is divided by `accum`: four means over 12 samples, each
    # divided by 4, add up to the mean over the rank's 48, so the step is lesson 01's.
    ui.step(5, "Accumulate naively: DDP syncs every micro-batch")
    model, ddp_model, optimizer, naive = build(args, data, device)
    with ui.progress(args.epochs * steps_per_epoch, "naive  ") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y) / accum
                loss.backward()                      # all-reduces, every time
                if (i + 1) % accum == 0:             # the last micro-batch of this step
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    bar.advance()
    w_naive = weights(model)
    spread_naive = rank_spread(model)
    del model, ddp_model, optimizer

    # Step 6: Accumulate with no_sync: one sync per optimizer step
    # The only change: every micro-batch but the last runs forward *and* backward inside
    # `with ddp_model.no_sync():`. Those backwards only add into .grad on this rank; the
    # last micro-batch's backward all-reduces the whole accumulated sum, once.
    ui.step(6, "Accumulate with no_sync: one sync per optimizer step")
    model, ddp_model, optimizer, counted = build(args, data, device)
    losses: list[float] = []
    step_loss = 0.0
    log_every = max(1, steps_per_epoch // 2)
    steps = args.epochs * steps_per_epoch
    timer = Timer()
    with ui.progress(steps, "no_sync") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device), y.to(device)
                if (i + 1) % accum != 0:
                    with ddp_model.no_sync():        # forward and backward: no all-reduce
                        loss = F.cross_entropy(ddp_model(x), y) / accum
                        loss.backward()
                else:                                # the last micro-batch: sync, then step
                    loss = F.cross_entropy(ddp_model(x), y) / accum
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                step_loss += loss.item()
                if (i + 1) % accum == 0:
                    losses.append(step_loss)  # this rank's mean loss over its 48 samples
                    step_loss = 0.0
                    bar.advance()
                    if len(losses) % log_every == 0:
                        # for the log only: the global loss (this all_reduce is ours, not
                        # DDP's, so the hook does not count it)
                        shown_loss = torch.tensor(losses[-1], device=device)
                        dist.all_reduce(shown_loss)
                        ui.log(epoch + 1, len(losses), steps, shown_loss.item() / world_size,
                               timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds
    w_no_sync = weights(model)
    spread_no_sync = rank_spread(model)
    final_model = model  # kept for the accuracy and the saved weights
    del ddp_model, optimizer

    # Step 7: Compare the counts and the weights
    # Same data, same order, same arithmetic: the two runs must end with the same weights
    # (up to float rounding), and those must be lesson 01's. Only the traffic differs.
    ui.step(7, "Compare the counts and the weights")
    reference = recipe.train_reference(args.seed, args.epochs, data) if rank == 0 else None
    diff_naive = max_abs_diff(w_naive, reference) if rank == 0 else None
    diff_no_sync = max_abs_diff(w_no_sync, reference) if rank == 0 else None
    diff_between = max_abs_diff(w_naive, w_no_sync)
    ui.table("All-reduces in the whole run (rank 0's counter; every rank sends the same)",
             ["accumulation", "calls", "per batch", "MB sent", "max|w-w01|", "ranks agree"],
             [["naive", naive.calls, f"{naive.calls / steps:g}", f"{naive.bytes / 1e6:.2f}",
               f"{diff_naive:.1e}" if rank == 0 else "", agree(spread_naive)],
              ["no_sync", counted.calls, f"{counted.calls / steps:g}", f"{counted.bytes / 1e6:.2f}",
               f"{diff_no_sync:.1e}" if rank == 0 else "", agree(spread_no_sync)]])
    ui.print("per batch: all-reduce calls per global batch of 96 samples; max|w-w01|: "
             "largest weight difference to lesson 01")
    ui.print(f"calls: naive / no_sync = {naive.calls} / {counted.calls} = "
             f"[bold]{naive.calls / counted.calls:g}[/bold] (accum-steps is {accum}); bytes: "
             f"{naive.bytes / counted.bytes:g}x; max |w_naive - w_no_sync| = {diff_between:.1e}")

    # Step 8: Where no_sync goes: forward, backward, or both
    # DDP decides at *forward* time whether the coming backward syncs: its forward() reads
    # require_backward_grad_sync (the flag no_sync() sets to False) and, only when it is
    # True, arms the reducer (reducer.prepare_for_backward). backward() never reads the
    # flag. So what matters is where the forward runs. Measured, not assumed:
    ui.step(8, "Where no_sync goes: forward, backward, or both")
    variants = {}
    rows = []
    for name, around, label in (("no_sync_forward_only", "forward", "forward only"),
                                ("no_sync_backward_only", "backward", "backward only"),
                                ("no_sync_forward_and_backward", "both", "both")):
        variants[name] = measure(args, data, device, loader, sampler, steps, reference,
                                 no_sync_around=around)
        rows.append(variant_row(label, variants[name], rank))
    ui.table("no_sync() around ... of every micro-batch but the last", VARIANT_COLUMNS, rows)

    # Step 9: Two more mistakes: the loss scale and the early step
    # Forgetting `/ accum`: the summed gradient is `accum` times too large, as if the
    # learning rate were `accum` times larger. Calling optimizer.step() for every
    # micro-batch: inside no_sync each rank steps on its *own* gradient, so the ranks'
    # weights drift apart, and nothing in DDP ever brings them back together.
    ui.step(9, "Two more mistakes: the loss scale and the early step")
    variants["loss_not_divided"] = measure(args, data, device, loader, sampler, steps, reference,
                                           divide_loss=False)
    variants["step_inside_loop"] = measure(args, data, device, loader, sampler, steps, reference,
                                           step_every_micro_batch=True)
    ui.table("Mistakes, measured with the same counter", VARIANT_COLUMNS,
             [variant_row("no / accum", variants["loss_not_divided"], rank),
              variant_row("step each micro", variants["step_inside_loop"], rank)])
    ui.print("rank spread: largest |w_rank - w_rank0| over all weights and ranks (0: ranks agree)")

    # Step 10: Save on rank 0, then wait at a barrier
    # The no_sync run's weights and every count. Lesson 05's rule: one writer, a barrier.
    ui.step(10, "Save on rank 0, then wait at a barrier")
    folder = out_dir("08", args.out)
    all_losses = torch.tensor(losses, device=device)
    dist.all_reduce(all_losses)  # per-step losses averaged over ranks: the global batch's
    if rank == 0:
        accuracy = recipe.accuracy(final_model, data.test, device)
        save_results(folder, w_no_sync, make_metrics(
            lesson="08", world_size=world_size, backend=backend, device=str(device),
            losses=(all_losses / world_size).tolist(), final_accuracy=accuracy,
            wall_seconds=wall, samples=args.epochs * len(data.train), epochs=args.epochs,
            seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
            accum_steps=accum, micro_batch=micro, optimizer_steps=steps,
            bucket_cap_mb=args.bucket_cap_mb, bucket_sizes=counted.sizes[-counted.last_sync:],
            allreduce_calls={"naive": naive.calls, "no_sync": counted.calls},
            allreduce_bytes={"naive": naive.bytes, "no_sync": counted.bytes},
            max_abs_diff_vs_single_device=diff_no_sync,
            max_abs_diff_naive_vs_single_device=diff_naive,
            max_abs_diff_naive_vs_no_sync=diff_between,
            variants=variants))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} and metrics.json")
    dist.barrier()

    # Step 11: Leave the process group
    # Free everything that holds the group (DDP reducers), collect garbage, then destroy.
    ui.step(11, "Leave the process group")
    del final_model
    teardown()
    ui.print("done: every rank left the process group cleanly")


class AllReduceCounter:
    """The hook's state: every bucket DDP all-reduced, as a number of gradients."""

    def __init__(self):
        self.sizes: list[int] = []   # elements per call, in call order
        self.bytes = 0
        self.last_sync = 0           # calls in the most recent backward that synced

    @property
    def calls(self) -> int:
        return len(self.sizes)


def counting_allreduce_hook(counter: AllReduceCounter, bucket: dist.GradBucket):
    """DDP calls this once per bucket that is ready: count it, then all-reduce as usual."""
    buffer = bucket.buffer()  # the bucket's gradients, flattened into one tensor
    counter.sizes.append(buffer.numel())
    counter.bytes += buffer.numel() * buffer.element_size()
    counter.last_sync = bucket.index() + 1 if bucket.is_last() else counter.last_sync
    return allreduce_hook(None, bucket)  # divide by world size, all_reduce: DDP's default


def build(args, data, device):
    """A fresh model (same seed on every rank), its DDP wrapper with the counting hook, SGD."""
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    kwargs = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
    counter = AllReduceCounter()
    ddp_model.register_comm_hook(counter, counting_allreduce_hook)  # before the first backward
    return model, ddp_model, recipe.make_optimizer(ddp_model), counter


def measure(args, data, device, loader, sampler, steps, reference, *, no_sync_around="both",
            divide_loss=True, step_every_micro_batch=False) -> dict:
    """Step 6's loop with one thing changed; returns what the counter and the weights say."""
    accum = args.accum_steps
    model, ddp_model, optimizer, counter = build(args, data, device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last = (i + 1) % accum == 0
            scale = accum if divide_loss else 1
            if last or no_sync_around == "none":
                (F.cross_entropy(ddp_model(x), y) / scale).backward()
            elif no_sync_around == "forward":
                with ddp_model.no_sync():
                    out = ddp_model(x)                # forward inside ...
                (F.cross_entropy(out, y) / scale).backward()  # ... backward outside
            elif no_sync_around == "backward":
                out = ddp_model(x)                    # forward outside ...
                with ddp_model.no_sync():
                    (F.cross_entropy(out, y) / scale).backward()  # ... backward inside
            else:                                     # "both": the right way
                with ddp_model.no_sync():
                    (F.cross_entropy(ddp_model(x), y) / scale).backward()
            if last or step_every_micro_batch:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    w = weights(model)
    result = {"allreduce_calls": counter.calls, "allreduce_bytes": counter.bytes,
              "calls_per_global_batch": counter.calls / steps,
              "rank_disagreement": rank_spread(model),
              "final_accuracy": recipe.accuracy(model, data.test, device)}
    if reference is not None:  # rank 0
        result["max_abs_diff_vs_single_device"] = max_abs_diff(w, reference)
    del ddp_model, optimizer
    return result


VARIANT_COLUMNS = ["run", "calls", "per batch", "max|w-w01|", "rank spread", "accuracy"]


def variant_row(label: str, v: dict, rank: int) -> list:
    diff = f"{v['max_abs_diff_vs_single_device']:.1e}" if rank == 0 else ""
    return [label, v["allreduce_calls"], f"{v['calls_per_global_batch']:g}", diff,
            f"{v['rank_disagreement']:.1e}" if v["rank_disagreement"] else "0",
            f"{v['final_accuracy']:.1%}"]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def rank_spread(model) -> float:
    """Largest |w_rank - w_rank0| over every weight and every rank (0.0: all ranks agree)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)  # not a DDP all-reduce: the counters do not see it
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def agree(spread: float) -> str:
    return "yes" if spread == 0.0 else f"no ({spread:.1e})"


if __name__ == "__main__":
    run(main)
