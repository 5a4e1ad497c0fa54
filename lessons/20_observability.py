"""Lesson 20: seeing inside a distributed job, with torch.profiler and the flight recorder.

Parent: lesson 05 (lessons/05_ddp_spawn.py)

New since lesson 05: two instruments. torch.profiler records a few training steps on every
rank into a Chrome trace (open it in Perfetto), and the lesson reads the trace back: when
each of DDP's bucket all-reduces ran, how much of it hid behind backward, and how the step
split into communication and computation. The flight recorder keeps the last collectives
of every rank; with --skip-rank one rank stops training early, the others wait for it until
the timeout, every rank dumps its recorder, and the lesson names the collective, its
sequence number and the rank that never arrived. Ends on lesson 01's weights; --fsdp traces FSDP2.

Run:
    make lesson-20                                   # 2 ranks, traces in runs/lesson-20/
    make lesson-20 ARGS="--skip-rank 1 --timeout 10" # a rank skips a collective: diagnose it
    make lesson-20 ARGS="--fsdp"                     # and a trace of FSDP2, block by block
    .venv/bin/python lessons/20_observability.py --epochs 1

Doc: docs/20_observability.md
"""
import contextlib
import datetime
import gc
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 20_observability/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, DistributedSampler

import fsdp
import traces as trace
from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import WORLD_COLUMNS, host_store, master_address, spawn, world_rows
from apparatus.results import atomic_write, claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer

# More ranks than this on one machine teach nothing but waiting; and each rank is a whole
# Python process with torch loaded: about 0.4 GB of memory (PSS) each, measured here.
MAX_WORLD = 16
BUCKET_CAP_MB = 0.001  # ~1 KB buckets: our 22 KB MLP gets 3 buckets (DDP's default, 25 MB, gives 1)


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    parser.add_argument("--skip-rank", type=nonnegative_int, default=None,
                        help="make this rank stop training early (the flight recorder names it)")
    parser.add_argument("--skip-at-step", type=nonnegative_int, default=5, help="stop before this step")
    parser.add_argument("--fsdp", action="store_true", help="also trace FSDP2 on lesson 13's transformer")
    parser.set_defaults(timeout=15.0)  # a skipped collective fails after this, not after 60 s
    args = parser.parse_args()
    n = args.world_size
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD)
    if args.skip_rank is not None and not 0 < args.skip_rank < n:
        fail(f"--skip-rank {args.skip_rank}: choose a rank from 1 to {n - 1} (rank 0 writes the results)")
    if args.skip_rank is not None:  # a step past the end would skip nothing ("nobody is missing")
        steps = args.epochs * len(recipe.load_data(args.dataset, args.data_dir, args.download).train) \
            // recipe.GLOBAL_BATCH
        if args.skip_at_step >= steps:
            fail(f"--skip-at-step {args.skip_at_step}: this run has steps 0 to {steps - 1} "
                 f"({steps // args.epochs} per epoch); choose one of them")
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 20: a profiler trace and the flight recorder, on {args.world_size} DDP processes")

    # Step 1: Turn on the flight recorder, start the ranks with spawn()
    # One process per device is DDP's rule: with 2 GPUs, 2 processes each own one GPU; on a
    # CPU-only machine the processes share the cores and talk over gloo. MASTER_ADDR and
    # MASTER_PORT tell every process where the rendezvous *store* is, a small key-value
    # server they use to find each other. The parent hosts it, listening on 127.0.0.1 only
    # (a TCPStore of its own would listen on every interface), and holds the port until
    # the job ends: a second job on the same port fails at once instead of joining ours.
    ui.step(1, "Turn on the flight recorder, start the ranks with spawn()")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    folder = claim_out(out_dir("20", args.out))  # checked now, not after training; ours alone
    # The flight recorder: every rank keeps its last TORCH_FR_BUFFER_SIZE collectives in a
    # ring buffer (read once, when the rank starts, so set it before spawn()). Dumps go to
    # TORCH_FR_DUMP_TEMP_FILE + rank (NCCL's watchdog writes there itself on a timeout when
    # TORCH_NCCL_DUMP_ON_TIMEOUT=1; for gloo, worker() below writes them).
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(folder / "fr_rank_")
    trace.clear(folder)  # an earlier run's dumps and traces must not be read as this run's
    addr, port = master_address(args.master_port)  # --master-port, else $MASTER_ADDR/$MASTER_PORT
    store, port = host_store(addr, port, args.timeout)  # lives (and holds the port) until we exit
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    ui.print(f"the store listens on {addr}:{port}; next, spawn(worker, nprocs={args.world_size}) "
             f"starts the ranks and each runs worker(rank, ...)")
    ui.pause(next_step=(2, "Join the process group"))
    # spawn() does lesson 05's mp.spawn(..., join=True) job (common/distributed.py: rank 0
    # gets this terminal for --step; a failed rank stops the others, and spawn() exits with
    # one line naming it). A failed run still left its traces and dumps: read them, then that line.
    said, stopped = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(said):
            spawn(worker, (args.world_size, args, kind, folder), args.world_size)
    except SystemExit as exc:  # code 1 or 2: a rank failed; 129, 130, 143: Ctrl-C and the like
        stopped = exc
    # Not after Ctrl-C, nor after q at a --step pause: the ranks dump in Step 7, after the last one
    if (stopped is None or stopped.code in (1, 2)) and any(folder.glob("fr_rank_*")):
        read_back(ui, args, folder)  # Steps 8 and 9, after the ranks are gone
    sys.stderr.write(said.getvalue())
    if stopped:
        raise stopped


def worker(rank: int, world_size: int, args, kind: str, folder) -> None:
    """What every process runs: train(), and when a collective fails, dump the recorder."""
    try:
        train(rank, world_size, args, kind, folder)
    except RuntimeError as exc:  # a timed-out collective raises DistBackendError, a RuntimeError
        # What NCCL's watchdog does by itself on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), by
        # hand for gloo: save this rank's recorder, give the others time to save theirs.
        if dist.is_initialized():  # (it is, unless joining the group was what failed)
            dump_flight_recorder(rank)
        trace.wait_for_dumps(os.environ["TORCH_FR_DUMP_TEMP_FILE"], world_size, 2 * args.timeout)
        print(f"[rank {rank}] {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        # os._exit: a normal exit would first wait for this rank's other queued collectives to
        # time out one by one; spawn() sees the exit code and stops the other ranks
        os._exit(1)


def dump_flight_recorder(rank: int) -> None:
    """This rank's recorder as JSON (the pickle form is for torch's own fr_trace tool)."""
    c10d = torch._C._distributed_c10d  # private, but it is what the watchdog and fr_trace use
    dump = c10d._dump_nccl_trace_json if "nccl" in dist.get_backend() else c10d._dump_fr_trace_json
    path = trace.dump_path(os.environ["TORCH_FR_DUMP_TEMP_FILE"], rank)
    atomic_write(path, lambda f: f.write(dump(True, False)))  # whole or absent: spawn() may stop us next


def train(rank: int, world_size: int, args, kind: str, folder) -> None:
    """What every process runs (worker() calls it with the rank spawn() passed)."""
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
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else backend_for(device)  # GPUs: gloo too, for CPU tensors
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
    ui.print(f"global batch {recipe.GLOBAL_BATCH} = {world_size} ranks x {per_rank} samples; "
             f"{len(loader)} steps per epoch on every rank")

    # Step 4: Wrap the model with DDP, in small buckets
    # Same seed on every rank gives the same initial weights; DDP also broadcasts rank 0's
    # weights at construction, so the copies start identical either way. device_ids is for
    # GPUs only (one device per process); on the CPU it stays None.
    # find_unused_parameters=False (the default) is right here: every parameter gets a
    # gradient every step. True would make DDP walk the autograd graph after each forward.
    # bucket_cap_mb: DDP all-reduces gradients in buckets, each as soon as all its gradients
    # are ready; tiny buckets give our tiny model several, so the trace can show the overlap.
    ui.step(4, "Wrap the model with DDP, in small buckets")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = recipe.make_optimizer(ddp_model)

    # Step 5: Train under torch.profiler
    # The loop is lesson 01's, plus sampler.set_epoch(epoch): without it every epoch would
    # replay epoch 0's order. The loss each rank sees is its local batch's; the global
    # batch's loss is their average over ranks. We keep each step's loss on the device and
    # average them every `log_every` steps in one all-reduce: `.item()` makes the CPU wait
    # for the GPU to finish, and once per step that wait would stall the pipeline.
    # The profiler records steps 3 and 4 (schedule: skip 1, warm up 1, record 2) and
    # then writes this rank's Chrome trace. record_shapes adds each all-reduce's sizes.
    ui.step(5, "Train under torch.profiler")
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # this rank's losses since the last log, not yet synced
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    timer = Timer()
    profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []),
                       schedule=schedule(wait=1, warmup=1, active=2, repeat=1), record_shapes=True,
                       on_trace_ready=lambda p: p.export_chrome_trace(str(folder / f"trace_rank{rank}.json")))
    with ui.progress(steps, f"training on {world_size} ranks") as bar, profiler:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                done = len(losses) + len(pending)
                if rank == args.skip_rank and done == args.skip_at_step:
                    break  # the bug: this rank stops early; the others wait in step `done`'s collectives
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()       # DDP all-reduces gradients, bucket by bucket, in here
                optimizer.step()      # identical gradients -> identical steps on every rank
                pending.append(loss.detach())
                bar.advance()
                profiler.step()  # tells the schedule a step ended
                if (len(losses) + len(pending)) % log_every == 0 or done + 1 == steps:
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)  # SUM over ranks (the default op), then divide
                    losses += (chunk / world_size).tolist()  # the one host sync per log line
                    pending = []
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds
    if args.fsdp:  # the same profiler on FSDP2: lesson 13's transformer, sharded as lesson 15 does
        fsdp.trace(rank, world_size, device, folder, args.seed)

    # Step 6: Save on rank 0, then wait at a monitored barrier
    # All ranks hold the same weights, so one file is enough: rank 0 writes it. Every rank
    # writing the same path would race; and a rank that reads the file must wait until it
    # is complete, which is what the barrier is for.
    ui.step(6, "Save on rank 0, then wait at a monitored barrier")
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    if rank == 0:
        reference = recipe.train_reference(args.seed, args.epochs, data)  # lesson 01's weights
        diff = max_abs_diff(weights, reference)
        accuracy = recipe.accuracy(ddp_model.module, data.test, device)
        save_results(folder, weights, make_metrics(
            lesson="20", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=args.epochs * len(data.train), epochs=args.epochs, seed=args.seed,
            dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
            max_abs_diff_vs_single_device=diff))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} "
                 f"and metrics.json")
        ui.print(f"same weights as one device? max |w_ddp - w_lesson01| = [bold]{diff:.1e}[/bold] "
                 + ("(yes: the only difference is float sums added in another order)" if diff <= 1e-4
                    else "(NO: something differs from lesson 01's recipe)"))
    # Nobody reads final.pt before rank 0 has finished writing it. monitored_barrier (CPU
    # backends only: gloo) is a barrier that names, on a timeout, the ranks that never arrived.
    dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    if rank != 0:
        saved = torch.load(folder / "final.pt", weights_only=True)
        ui.say_all(f"read rank 0's final.pt after the barrier: max diff to my own weights "
                   f"{max_abs_diff(saved, weights):.1e}")
    dist.barrier()

    # Step 7: Dump the flight recorder, leave the process group
    # Free everything that holds the process group (the DDP model's reducer) and collect
    # garbage *before* destroying the group. On torch 2.14.1 gloo otherwise aborts at exit
    # now and then ("terminate called without an active exception").
    ui.step(7, "Dump the flight recorder, leave the process group")
    dump_flight_recorder(rank)  # for Step 9: what every rank called, in order
    del ddp_model, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    ui.print("done: every rank left the process group cleanly")


def read_back(ui, args, folder) -> None:
    """What the ranks left behind: their traces and their flight recorders' dumps."""
    # Step 8: Read the trace
    # Each rank's profiler wrote a Chrome trace: open it in https://ui.perfetto.dev (offline:
    # the page runs in your browser) or chrome://tracing. Here we read it back: per profiled
    # step, when backward ran and when each all-reduce ran on the backend's own threads.
    ui.step(8, "Read the trace")
    trace.report_traces(ui, folder, args.world_size)  # lessons/20_observability/traces.py: the tables
    fsdp.report(ui, folder, args.world_size)  # --fsdp: each block's all-gathers, reduce-scatter, compute

    # Step 9: Read the flight recorder
    # Every rank dumped its recorder (at the end, or when a collective timed out). Ranks
    # call collectives in the same order, so sequence numbers line up across ranks: the
    # first number that some rank never reached is where the job went wrong.
    ui.step(9, "Read the flight recorder")
    trace.report_recorder(ui, os.environ["TORCH_FR_DUMP_TEMP_FILE"], args.world_size)


if __name__ == "__main__":
    run(main)
