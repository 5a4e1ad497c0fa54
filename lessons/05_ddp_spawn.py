"""Lesson 05: DistributedDataParallel, one process per device, started with mp.spawn.

New since lesson 01: several processes train one model together. Each process (a *rank*)
holds a full copy of the model, reads its own slice of every global batch through
DistributedSampler, and DDP averages the gradients across ranks during backward, so all
copies take the same optimizer step. The result: the same weights as lesson 01, computed
by N processes. This lesson proves that with numbers, and writes every API out in full.

Run:
    make lesson-05                          # 2 ranks: CPU + gloo here, GPUs + NCCL if you have 2
    make lesson-05 ARGS="--world-size 3"
    .venv/bin/python lessons/05_ddp_spawn.py --world-size 4 --epochs 3

Doc: docs/05_ddp_spawn.md
"""
import datetime
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import (WORLD_COLUMNS, die_with_parent, host_store, master_address,
                                say_each, supervise, world_rows)
from apparatus.results import (claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown)
from apparatus.ui import UI, Timer
from common.processes import share_terminal_with_children

# More ranks than this on one machine teach nothing but waiting; and each rank is a whole
# Python process with torch loaded: about 0.4 GB of memory (PSS) each, measured here.
MAX_WORLD = 16


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    parser.add_argument("--crash-rank", type=nonnegative_int, default=None,
                        help="make this rank raise an error during training (to see what happens)")
    parser.add_argument("--crash-at-step", type=nonnegative_int, default=5,
                        help="the training step at which --crash-rank fails")
    args = parser.parse_args()
    n = args.world_size
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD)
    if args.crash_rank is not None and args.crash_rank >= n:
        fail(f"--crash-rank {args.crash_rank} does not exist in a world of {n} (ranks 0..{n - 1})")
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 05: DDP on {args.world_size} processes, started by mp.spawn")

    # Step 1: Start one process per rank with mp.spawn
    # One process per device is DDP's rule: with 2 GPUs, 2 processes each own one GPU; on a
    # CPU-only machine the processes share the cores and talk over gloo. MASTER_ADDR and
    # MASTER_PORT tell every process where the rendezvous *store* is, a small key-value
    # server they use to find each other. The parent hosts it, listening on 127.0.0.1 only
    # (a TCPStore of its own would listen on every interface), and holds the port until
    # the job ends: a second job on the same port fails at once instead of joining ours.
    ui.step(1, "Start one process per rank with mp.spawn")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    folder = claim_out(out_dir("05", args.out))  # checked now, not after training; ours alone
    addr, port = master_address(args.master_port)  # --master-port, else $MASTER_ADDR/$MASTER_PORT
    store, port = host_store(addr, port, args.timeout)  # lives (and holds the port) until we exit
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    ui.print(f"the store listens on {addr}:{port}; next, mp.spawn(worker, nprocs={args.world_size}) "
             f"starts the ranks and each runs worker(rank, ...)")
    # --step: the children get /dev/null as stdin, so tell rank 0 which terminal to ask on
    share_terminal_with_children()
    ui.pause(next_step=(2, "Join the process group"))
    # mp.spawn starts the processes with the "spawn" method (a fresh Python each), calls
    # worker(i, *args) in process i, and with join=True waits for all of them. If one
    # raises, mp.spawn terminates the others and re-raises here: no rank waits forever.
    # supervise(): Ctrl-C, SIGTERM or SIGHUP stop every rank before the parent says a word.
    try:
        with supervise():
            mp.spawn(worker, args=(args.world_size, args, kind, folder), nprocs=args.world_size,
                     join=True)
    except mp.ProcessRaisedException as exc:
        error = [line for line in str(exc.msg).splitlines() if line.strip()][-1]
        fail(f"rank {exc.error_index} failed with {error}; mp.spawn stopped the other ranks", code=1)
    except mp.ProcessExitedException as exc:
        fail(f"rank {exc.error_index} exited ({exc.signal_name or f'code {exc.exit_code}'}); "
             f"mp.spawn stopped the other ranks", code=1)


def worker(rank: int, world_size: int, args, kind: str, folder) -> None:
    """What every process runs. mp.spawn passes the rank as the first argument."""
    die_with_parent()  # if the parent is killed (even kill -9), the kernel ends this rank too
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

    # Step 3: Split the data with DistributedSampler
    # Each rank reads a different 1/N of every epoch: positions rank, rank+N, rank+2N, ...
    # of one shuffled order. shuffle=True belongs to the *sampler* (a DataLoader with a
    # sampler must not shuffle too), and the per-rank batch is the global batch / N, so one
    # step of N ranks sees exactly the 96 samples of one step of lesson 01.
    ui.step(3, "Split the data with DistributedSampler")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    per_rank = recipe.GLOBAL_BATCH // world_size
    loader = DataLoader(data.train, batch_size=per_rank, sampler=sampler)
    sampler.set_epoch(0)
    first = list(sampler)[:per_rank]
    ui.print(f"global batch {recipe.GLOBAL_BATCH} = {world_size} ranks x {per_rank} samples; "
             f"{len(loader)} steps per epoch on every rank")
    # say_each: rank 0 prints every rank's line in rank order (a barrier orders no output)
    say_each(ui, f"my {len(sampler)} samples start with indices {first[:6]} ...")

    # Step 4: Wrap the model with DDP
    # Same seed on every rank gives the same initial weights; DDP also broadcasts rank 0's
    # weights at construction, so the copies start identical either way. device_ids is for
    # GPUs only (one device per process); on the CPU it stays None.
    # find_unused_parameters=False (the default) is right here: every parameter gets a
    # gradient every step. True would make DDP walk the autograd graph after each forward.
    ui.step(4, "Wrap the model with DDP")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = recipe.make_optimizer(ddp_model)
    keys = list(ddp_model.state_dict())
    ui.print(f"the real model is ddp_model.module ({type(ddp_model.module).__name__}); "
             f"DDP's state_dict keys carry a prefix: {keys[:2]} ...")

    # Step 5: See that gradients are averaged
    # Compute one batch's gradient twice: first *locally* (inside no_sync(), DDP does not
    # communicate), then normally. DDP's gradient must equal the mean of all ranks' local
    # gradients, on every rank. No optimizer step is taken: training below is unaffected.
    ui.step(5, "See that gradients are averaged")
    x, y = next(iter(loader))
    x, y = x.to(device), y.to(device)
    with ddp_model.no_sync():
        F.cross_entropy(ddp_model(x), y).backward()
    local = model.head.weight.grad.clone()
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    mean_of_locals = torch.stack(gathered).mean(0)
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(ddp_model(x), y).backward()  # the all-reduce happens during this backward
    synced = model.head.weight.grad
    gap = (synced - mean_of_locals).abs().max().item()
    say_each(ui, f"head.weight.grad[0,:3] local {fmt(local[0, :3])}\n"
                 f"  after DDP {fmt(synced[0, :3])}\n  |DDP - mean of all ranks' local| = {gap:.1e}")
    torch.testing.assert_close(synced, mean_of_locals)
    optimizer.zero_grad(set_to_none=True)

    # Step 6: Train
    # The loop is lesson 01's, plus sampler.set_epoch(epoch): without it every epoch would
    # replay epoch 0's order. The loss each rank sees is its local batch's; the global
    # batch's loss is their average over ranks. We keep each step's loss on the device and
    # average them every `log_every` steps in one all-reduce: `.item()` makes the CPU wait
    # for the GPU to finish, and once per step that wait would stall the pipeline.
    ui.step(6, "Train")
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # this rank's losses since the last log, not yet synced
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    timer = Timer()
    with ui.progress(steps, f"training on {world_size} ranks") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                done = len(losses) + len(pending)
                if rank == args.crash_rank and done == args.crash_at_step:
                    raise RuntimeError(f"deliberate crash of rank {rank} at step {done} "
                                       f"(--crash-rank)")
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()       # DDP all-reduces gradients, bucket by bucket, in here
                optimizer.step()      # identical gradients -> identical steps on every rank
                pending.append(loss.detach())
                bar.advance()
                if (len(losses) + len(pending)) % log_every == 0 or done + 1 == steps:
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)  # SUM over ranks (the default op), then divide
                    losses += (chunk / world_size).tolist()  # the one host sync per log line
                    pending = []
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 7: Save on rank 0, then wait at a barrier
    # All ranks hold the same weights, so one file is enough: rank 0 writes it. Every rank
    # writing the same path would race; and a rank that reads the file must wait until it
    # is complete, which is what the barrier is for.
    ui.step(7, "Save on rank 0, then wait at a barrier")
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    if rank == 0:
        # Lesson 01's loop in this process, with as many threads as all ranks had together
        # (or on this rank's GPU): the same weights, and a fair speed to compare with
        threads = torch.get_num_threads() * world_size
        reference, one_rate = recipe.timed_single_process(args.seed, args.epochs, data, device, threads)
        diff = max_abs_diff(weights, reference)
        accuracy = recipe.accuracy(ddp_model.module, data.test, device)
        save_results(folder, weights, make_metrics(
            lesson="05", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=args.epochs * len(data.train), epochs=args.epochs, seed=args.seed,
            dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
            max_abs_diff_vs_single_device=diff, single_process_samples_per_second=round(one_rate, 1)))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} "
                 f"and metrics.json")
        ui.print(f"same weights as one device? max |w_ddp - w_lesson01| = [bold]{diff:.1e}[/bold] "
                 + ("(yes: the only difference is float sums added in another order)" if diff <= 1e-4
                    else "(NO: something differs from lesson 01's recipe)"))
        rate = args.epochs * len(data.train) / wall
        same = "on one GPU" if device.type == "cuda" else f"with the same {threads} threads"
        ui.print(f"speed: {world_size} ranks {rate:,.0f} samples/s; one process {same} "
                 f"{one_rate:,.0f} samples/s: DDP was {max(rate, one_rate) / min(rate, one_rate):.1f}x "
                 f"{'faster' if rate > one_rate else 'slower'} in this run")
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


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:+.4f}" for v in t.tolist()) + "]"


if __name__ == "__main__":
    run(main)
