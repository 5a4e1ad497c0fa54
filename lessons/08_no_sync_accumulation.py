"""Lesson 08: gradient accumulation with no_sync(), one all-reduce per optimizer step.

Parent: lesson 05 (lessons/05_ddp_spawn.py)

New since lesson 05: each rank adds up the gradients of `--accum-steps` micro-batches
before one optimizer step (a big batch that does not fit in memory at once). Inside
`with ddp_model.no_sync():` DDP does not all-reduce, so gradients travel once per step, not
once per micro-batch. Step 6 compares the naive loop and two classic mistakes with it.
Lesson 05's start is kept, with spawn() from common/distributed.py in place of mp.spawn, and
its gradient-average check stays in lesson 05.

Run:
    make lesson-08                                   # 2 ranks x 4 micro-batches of 12
    make lesson-08 ARGS="--accum-steps 8"
    .venv/bin/python lessons/08_no_sync_accumulation.py --world-size 2 --accum-steps 4 --bucket-cap-mb 0.01

Doc: docs/08_no_sync_accumulation.md
"""
import datetime
import gc
import os
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 08_no_sync_accumulation/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import accumulation
from apparatus.comm import CommLog, counted_ddp
from common import recipe
from common.cli import lesson_parser, positive_float, positive_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import (WORLD_COLUMNS, host_store, master_address, say_each, spawn,
                                world_rows)
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer

# More ranks than this on one machine teach nothing but waiting; and each rank is a whole
# Python process with torch loaded: about 0.4 GB of memory (PSS) each, measured here.
MAX_WORLD = 16


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    parser.add_argument("--accum-steps", type=positive_int, default=4,
                        help="micro-batches whose gradients are added up per optimizer step")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=None,
                        help="DDP's bucket size in MiB (default: DDP's own, 25); smaller "
                             "buckets mean more all-reduce calls per sync")
    args = parser.parse_args()
    n = args.world_size
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD)
    accumulation.check_accum_steps(args.accum_steps, n)  # equal micro-batches on every rank
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 08: gradient accumulation over {args.accum_steps} micro-batches "
             f"with no_sync(), on {args.world_size} processes")

    # Step 1: Start one process per rank with spawn()
    # One process per device is DDP's rule: with 2 GPUs, 2 processes each own one GPU; on a
    # CPU-only machine the processes share the cores and talk over gloo. MASTER_ADDR and
    # MASTER_PORT tell every process where the rendezvous *store* is, a small key-value
    # server they use to find each other. The parent hosts it, listening on 127.0.0.1 only
    # (a TCPStore of its own would listen on every interface), and holds the port until
    # the job ends: a second job on the same port fails at once instead of joining ours.
    ui.step(1, "Start one process per rank with spawn()")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    folder = claim_out(out_dir("08", args.out))  # checked now, not after training; ours alone
    addr, port = master_address(args.master_port)  # --master-port, else $MASTER_ADDR/$MASTER_PORT
    store, port = host_store(addr, port, args.timeout)  # lives (and holds the port) until we exit
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    ui.print(f"the store listens on {addr}:{port}; next, spawn(worker, nprocs={args.world_size}) "
             f"starts the ranks and each runs worker(rank, ...)")
    ui.pause(next_step=(2, "Join the process group"))
    # spawn() does lesson 05's mp.spawn(..., join=True) job, the package's one way to start
    # ranks (common/distributed.py): each rank is forked from a server that imported torch
    # once, rank 0 gets this terminal for --step, and if one rank fails the others are
    # stopped and the job ends with one line naming it. Ctrl-C stops every rank first.
    spawn(worker, (args.world_size, args, kind, folder), args.world_size)


def worker(rank: int, world_size: int, args, kind: str, folder) -> None:
    """What every process runs. spawn() passes the rank as the first argument."""
    ui = UI(rank, world_size, step_mode=args.step)
    share_cpu(world_size)  # each rank gets its share of the cores, not all of them

    # Step 2: Join the process group
    # Each rank connects to the parent's store at MASTER_ADDR:MASTER_PORT (is_master=False:
    # a client), and init_process_group blocks until all `world_size` ranks have met there.
    # The timeout bounds that wait *and* every later collective: a rank that never comes or
    # never answers turns into an error after `timeout` instead of a frozen terminal.
    # device_id (GPUs only) tells NCCL our device now, so it builds its communicator at once
    # instead of guessing the device at the first collective.
    ui.step(2, "Join the process group")
    device = rank_device(kind, rank)  # one GPU per rank: cuda:<rank>, or the CPU
    backend = backend_for(device)     # nccl for GPUs, gloo for CPU tensors
    if device.type == "cuda":
        torch.cuda.set_device(device)  # so that NCCL and `cuda` without an index mean our GPU
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    ui.table("The world", WORLD_COLUMNS, world_rows(rank, device, backend))

    # Step 3: Cut each rank's batch into micro-batches
    # Each rank reads a different 1/N of every epoch: positions rank, rank+N, rank+2N, ...
    # of one shuffled order. shuffle=True belongs to the *sampler* (a DataLoader with a
    # sampler must not shuffle too). New: the loader yields micro-batches of global batch /
    # (N x accum) samples, and every `accum` consecutive ones make one optimizer step, so one
    # step of N ranks sees exactly the 96 samples of one step of lesson 01.
    ui.step(3, "Cut each rank's batch into micro-batches")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    per_rank = recipe.GLOBAL_BATCH // world_size
    accum, micro = args.accum_steps, per_rank // args.accum_steps
    loader = DataLoader(data.train, batch_size=micro, sampler=sampler)
    sampler.set_epoch(0)
    first = list(sampler)[:per_rank]
    ui.print(f"global batch {recipe.GLOBAL_BATCH} = {world_size} ranks x {accum} micro-batches "
             f"x {micro} samples; {len(loader) // accum} optimizer steps per epoch on every rank")
    # say_each: rank 0 prints every rank's line in rank order (a barrier orders no output)
    say_each(ui, f"my {len(sampler)} samples start with indices {first[:6]} ...")

    # Step 4: Wrap the model with DDP, its all-reduces counted
    # Same seed on every rank gives the same initial weights; DDP also broadcasts rank 0's
    # weights at construction, so the copies start identical either way. device_ids is for
    # GPUs only (one device per process); on the CPU it stays None.
    # find_unused_parameters=False (the default) is right here: every parameter gets a
    # gradient every step. True would make DDP walk the autograd graph after each forward.
    # New: counted_ddp (apparatus/comm.py): DDP plus a comm hook that counts its all-reduces.
    ui.step(4, "Wrap the model with DDP, its all-reduces counted")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = counted_ddp(model, **accumulation.bucket_kwargs(args))
    optimizer = recipe.make_optimizer(ddp_model)
    keys = list(ddp_model.state_dict())
    ui.print(f"the real model is ddp_model.module ({type(ddp_model.module).__name__}); "
             f"DDP's state_dict keys carry a prefix: {keys[:2]} ...")

    # Step 5: Accumulate with no_sync: one sync per optimizer step
    # The loop is lesson 01's, plus sampler.set_epoch(epoch): without it every epoch would
    # replay epoch 0's order. The loss each rank sees is its local batch's; the global
    # batch's loss is their average over ranks. We keep each step's loss on the device and
    # average them every `log_every` steps in one all-reduce: `.item()` makes the CPU wait
    # for the GPU to finish, and once per step that wait would stall the pipeline.
    # New: every micro-batch but the last runs forward *and* backward inside no_sync(), and
    # only adds into .grad; the last one's backward all-reduces the sum, once. Each loss is
    # divided by `accum`, so the summed gradient is the mean over the step's 96 samples.
    ui.step(5, "Accumulate with no_sync: one sync per optimizer step")
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # this rank's losses since the last log, not yet synced
    steps = args.epochs * (len(loader) // accum)
    log_every = max(1, len(loader) // accum // 4)
    log, step_loss = CommLog(), 0.0  # log: DDP's all-reduces, recorded in backward only
    timer = Timer()
    with ui.progress(steps, f"training on {world_size} ranks") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                done = len(losses) + len(pending)
                sync = (i + 1) % accum == 0  # the last micro-batch of this optimizer step
                x, y = x.to(device), y.to(device)
                with nullcontext() if sync else ddp_model.no_sync():  # forward AND backward
                    loss = F.cross_entropy(ddp_model(x), y) / accum
                    with log.recording(), log.backward():
                        loss.backward()  # DDP all-reduces gradients, bucket by bucket, in here
                step_loss = step_loss + loss.detach()  # this rank's loss over its 48 samples
                if not sync:
                    continue
                optimizer.step()      # identical gradients -> identical steps on every rank
                optimizer.zero_grad(set_to_none=True)
                pending.append(step_loss)
                step_loss = 0.0
                bar.advance()
                if (len(losses) + len(pending)) % log_every == 0 or done + 1 == steps:
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)  # SUM over ranks (the default op), then divide
                    losses += (chunk / world_size).tolist()  # the one host sync per log line
                    pending = []
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 6: Compare with naive accumulation and two mistakes
    # The loop of Step 5 on fresh models, one thing changed each (lessons/08_no_sync_accumulation/accumulation.py): no
    # no_sync; no_sync around the forward only, or the backward only (DDP decides at
    # *forward* time whether backward syncs); no `/ accum`; a step after every micro-batch.
    ui.step(6, "Compare with naive accumulation and two mistakes")
    reference = recipe.train_reference(args.seed, args.epochs, data) if rank == 0 else None
    no_sync = accumulation.result(log, model, steps, reference, data, device)
    naive, variants = accumulation.compare(ui, args, data, device, loader, sampler, reference,
                                           no_sync, model)

    # Step 7: Save on rank 0, then wait at a barrier
    # All ranks hold the same weights, so one file is enough: rank 0 writes it. Every rank
    # writing the same path would race; and a rank that reads the file must wait until it
    # is complete, which is what the barrier is for.
    ui.step(7, "Save on rank 0, then wait at a barrier")
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    if rank == 0:
        diff = max_abs_diff(weights, reference)
        accuracy = recipe.accuracy(ddp_model.module, data.test, device)
        save_results(folder, weights, make_metrics(
            lesson="08", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=args.epochs * len(data.train), epochs=args.epochs, seed=args.seed,
            dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
            accum_steps=accum, micro_batch=micro, optimizer_steps=steps, variants=variants,
            bucket_cap_mb=args.bucket_cap_mb, bucket_sizes=no_sync["bucket_sizes"],
            allreduce_calls={"naive": naive["allreduce_calls"], "no_sync": no_sync["allreduce_calls"]},
            allreduce_bytes={"naive": naive["allreduce_bytes"], "no_sync": no_sync["allreduce_bytes"]},
            max_abs_diff_naive_vs_single_device=naive["max_abs_diff_vs_single_device"],
            max_abs_diff_naive_vs_no_sync=naive["max_abs_diff_vs_no_sync"],
            max_abs_diff_vs_single_device=diff))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} "
                 f"and metrics.json")
        ui.print(f"same weights as one device? max |w_ddp - w_lesson01| = [bold]{diff:.1e}[/bold] "
                 + ("(yes: the only difference is float sums added in another order)" if diff <= 1e-4
                    else "(NO: something differs from lesson 01's recipe)"))
    dist.barrier()  # nobody reads final.pt before rank 0 has finished writing it
    if rank != 0:
        saved = torch.load(folder / "final.pt", weights_only=True)
        ui.say_all(f"read rank 0's final.pt after the barrier: max diff to my own weights "
                   f"{max_abs_diff(saved, weights):.1e}")
    dist.barrier()

    # Step 8: Leave the process group
    # Free everything that holds the process group (the DDP model's reducer) and collect
    # garbage *before* destroying the group. On torch 2.14.1 gloo otherwise aborts at exit
    # now and then ("terminate called without an active exception").
    ui.step(8, "Leave the process group")
    del ddp_model, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    ui.print("done: every rank left the process group cleanly")


if __name__ == "__main__":
    run(main)
