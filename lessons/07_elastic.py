"""Lesson 07: elastic training: survive a dead worker by restarting and resuming from a snapshot.

Parent: lesson 06 (lessons/06_torchrun_multinode.py)

New since lesson 06: with --max-restarts, torchrun's agent answers a failed worker by
starting all workers again. It cannot restore their memory: rank 0 saves a *snapshot*
every --snapshot-every steps, and a new attempt resumes from it, mid-epoch, at the exact
batch. By default one rank kills itself (SIGKILL) at step 45 of the first attempt. The rest
is lesson 06: several processes train one model together. Each process (a *rank*)
holds a full copy of the model, reads its own slice of every global batch through
DistributedSampler, and DDP averages the gradients across ranks during backward, so all
copies take the same optimizer step. The result: the same weights as lesson 01, computed
by N processes. This lesson proves that with numbers, and writes every API out in full.

Run:
    make lesson-07     # 1 node x 2 workers, c10d rendezvous, --max-restarts 3, one failure
    make lesson-07 ARGS="--fail-at-step 0 --step-delay 0.2"   # then kill -9 a pid of Step 3
    .venv/bin/python lessons/07_elastic.py --fail-at-step 0   # a world of one: nothing restarts it

Doc: docs/07_elastic.md (also: plain torchrun commands, membership changes, when it pays)
"""
import datetime
import gc
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 07_elastic/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import die_with_parent, env_store, free_port, say_each
from common.processes import error_file_whole
from elastic import (SNAPSHOT_FORMAT, Ledger, fail_plan, kill_myself, nonnegative_float,
                               read_snapshot, resumed)
from apparatus.results import (atomic_write, claim_out, make_metrics, max_abs_diff, out_dir,
                               plain_state_dict, save_results, shown)
from apparatus.ui import UI, Timer

# More ranks than this on one machine teach nothing but waiting; and each rank is a whole
# Python process with torch loaded: about 0.4 GB of memory (PSS) each, measured here.
MAX_WORLD = 16


def parse_args():
    parser = lesson_parser(__doc__, distributed=True)
    parser.add_argument("--fail-rank", type=nonnegative_int, help="the rank that dies (default: the last)")
    parser.add_argument("--fail-at-step", type=nonnegative_int,
                        help="the step --fail-rank dies at, attempt 1 only (default: near half-way; 0: never)")
    parser.add_argument("--snapshot-every", type=positive_int, default=10, help="rank 0 saves every N steps")
    parser.add_argument("--step-delay", type=nonnegative_float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--fresh", action="store_true", help="first attempt: delete an old job's snapshot")
    args = parser.parse_args()
    n = int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets it (Step 1); plain python: 1
    recipe.check_world_size(n, f"WORLD_SIZE={n}")
    recipe.check_world_size(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "--nproc-per-node", most=MAX_WORLD)
    if args.fail_rank is not None and args.fail_rank >= n:
        fail(f"--fail-rank {args.fail_rank} does not exist in a world of {n} (ranks 0..{n - 1})")
    return args


# @record: torchrun's failure summary shows our error and traceback, not only "exit code 1"
# (error_file_whole, common/processes.py: no SIGTERM from the agent cuts that file short)
@record
@error_file_whole
def main() -> None:
    args = parse_args()
    # Step 1: Read who we are from the environment
    # torchrun starts the workers, on every node, and sets these variables for each. The
    # elastic agent adds TORCHELASTIC_RESTART_COUNT: 0, then one more at every restart. The
    # workers of each attempt are new processes; the rest of the past is in the snapshot.
    # One process per device is DDP's rule: with 2 GPUs, 2 processes each own one GPU; on a
    # CPU-only machine the processes share the cores and talk over gloo. MASTER_ADDR and
    # MASTER_PORT tell every process where the rendezvous *store* is, a small key-value
    # server they use to find each other. Where our code hosts one, it listens on 127.0.0.1 only
    # (a TCPStore of its own would listen on every interface), and holds the port until
    # the job ends: a second job on the same port fails at once instead of joining ours.
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))                  # 0 .. WORLD_SIZE-1, unique in the job
    local_rank = int(os.environ.get("LOCAL_RANK", 0))      # 0 .. LOCAL_WORLD_SIZE-1, on this node
    world_size = int(os.environ.get("WORLD_SIZE", 1))      # workers in the whole job
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # workers on this node
    node_rank = int(os.environ.get("GROUP_RANK", 0))       # which agent (node) started us
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # attempts before ours
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))    # --max-restarts
    if not launched:  # plain python: a world of one, its store on 127.0.0.1 and a free port
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    ui = UI(rank, world_size, step_mode=args.step)
    ui.title(f"Lesson 07: attempt {restart_count + 1} of at most {max_restarts + 1}, {world_size} "
             f"worker(s), {'started by torchrun' if launched else 'plain python: a world of one'}")
    ui.step(1, "Read who we are from the environment")
    kind, note = plan_device(args.device, local_world_size)  # GPUs per *node* count
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    folder = claim_out(out_dir("07", args.out)) if rank == 0 else out_dir("07", args.out)
    ui.print(f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} "
             f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}")
    die_with_parent()  # if the parent is killed (even kill -9), the kernel ends this rank too
    share_cpu(local_world_size)  # each rank gets its share of this node's cores, not all of them

    # Step 2: Join the process group
    # Each attempt joins a *new* group (make lesson-07: rank 0 hosts its store; the others are
    # a client), and init_process_group blocks until all `world_size` ranks have met there.
    # The timeout bounds that wait *and* every later collective: a rank that never comes or
    # never answers turns into an error after `timeout` instead of a frozen terminal.
    # device_id (GPUs only) tells NCCL our device now, so it builds its communicator at once
    # instead of guessing the device at the first collective.
    ui.step(2, "Join the process group")
    device = rank_device(kind, local_rank)  # cuda:<LOCAL_RANK> (node 1 counts from 0 too), or the CPU
    backend = backend_for(device)     # nccl for GPUs, gloo for CPU tensors
    if device.type == "cuda":
        torch.cuda.set_device(device)  # so that NCCL and `cuda` without an index mean our GPU
    timeout = datetime.timedelta(seconds=args.timeout)
    store = env_store(rank, world_size, args.timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)

    # Step 3: See which rank lives on which node
    # Every worker reports itself; rank 0 prints the map. RANK, not LOCAL_RANK, picks the shard:
    # Each rank reads a different 1/N of every epoch: positions rank, rank+N, rank+2N, ...
    # of one shuffled order. shuffle=True belongs to the *sampler* (a DataLoader with a
    # sampler must not shuffle too), and the per-rank batch is the global batch / N, so one
    # step of N ranks sees exactly the 96 samples of one step of lesson 01. So progress is
    # counted in these global steps: a snapshot stays valid for another world size.
    ui.step(3, "See which rank lives on which node")
    me = [rank, node_rank, local_rank, socket.gethostname(), os.getpid(), str(device), backend]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, me)
    ui.table("Ranks and nodes", ["rank", "node", "local rank", "host", "pid", "device", "backend"], everyone)
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

    # Step 4: Train with DDP: wrap the model
    # Same seed on every rank gives the same initial weights; DDP also broadcasts rank 0's
    # weights at construction, so the copies start identical either way. device_ids is for
    # GPUs only (one device per process); on the CPU it stays None.
    # find_unused_parameters=False (the default) is right here: every parameter gets a
    # gradient every step. True would make DDP walk the autograd graph after each forward.
    ui.step(4, "Train with DDP: wrap the model")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = recipe.make_optimizer(ddp_model)

    # Step 5: Train from the last snapshot, if there is one
    # Everything that decides the next step goes into the snapshot: the weights, the
    # optimizer's state (SGD's momentum), where we are, and the seed (an epoch's order is a
    # function of seed and epoch). Only tensors, numbers, strings, lists and dicts: what
    # torch.load(weights_only=True) accepts. Rank 0 writes it with atomic_write (temporary
    # file, fsync, rename): a process killed in the middle leaves a stray temporary file,
    # never half a snapshot.pt.
    # The loop is lesson 01's, plus sampler.set_epoch(epoch): without it every epoch would
    # replay epoch 0's order. The loss each rank sees is its local batch's; the global
    # batch's loss is their average over ranks. We keep each step's loss on the device and
    # average them every `log_every` steps in one all-reduce: `.item()` makes the CPU wait
    # for the GPU to finish, and once per step that wait would stall the pipeline.
    ui.step(5, "Train from the last snapshot, if there is one")
    snapshot_path = folder / "snapshot.pt"

    def snapshot(step: int) -> dict:  # "model" without DDP's "module." prefix (lesson 09)
        return {"format": SNAPSHOT_FORMAT, "model": plain_state_dict(model), "optimizer": optimizer.state_dict(),
                "global_step": step, "epoch": step // len(loader), "step_in_epoch": step % len(loader),
                "seed": args.seed, "dataset": data.name, "global_batch": recipe.GLOBAL_BATCH,
                "world_size": world_size, "losses": list(losses), "samples": ledger.tensor()}

    losses: list[float] = []
    ledger = Ledger(None, world_size, device)  # the sample ids of every step: the proof
    # Rank 0 decides, alone, and broadcasts the snapshot or why it refuses it: ranks that
    # each looked for the file could disagree (no shared disk, a file that appears between
    # two looks) and wait for each other forever. So on real machines --out must be shared.
    decision = [read_snapshot(ui, snapshot_path, args.fresh and not restart_count, snapshot(0),
                              len(loader), args.epochs, optimizer) if rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)  # every rank gets rank 0's decision
    snap = resumed(ui, decision[0], restart_count, max_restarts, len(loader))  # None, or one
    if snap:
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        losses, ledger = list(snap["losses"]), Ledger(snap["samples"], world_size, device)
    start = len(losses)  # 0 without a snapshot
    pending: list[torch.Tensor] = []  # this rank's losses since the last log, not yet synced
    steps = args.epochs * len(loader)
    log_every = args.snapshot_every  # losses synced (and sample ids gathered) when rank 0 saves
    fail_at, fail_rank = fail_plan(ui, args, steps, start, launched, restart_count)
    timer = Timer()
    with ui.progress(steps, f"training on {world_size} ranks") as bar:
        bar.advance(start)
        for epoch in range(start // len(loader), args.epochs):
            sampler.set_epoch(epoch)
            # Mid-epoch resume: the epoch's order is the sampler's, as before, minus the batches
            # the snapshot holds. A DataLoader's sampler can be any list of indices.
            mine = list(sampler)[(len(losses) + len(pending) - epoch * len(loader)) * per_rank:]
            for i, (x, y) in enumerate(DataLoader(data.train, batch_size=per_rank, sampler=mine)):
                done = len(losses) + len(pending)
                if rank == fail_rank and done + 1 == fail_at:
                    kill_myself(ui, done + 1)  # SIGKILL: no exception, no cleanup, just gone
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()       # DDP all-reduces gradients, bucket by bucket, in here
                optimizer.step()      # identical gradients -> identical steps on every rank
                pending.append(loss.detach())
                ledger.add(mine[i * per_rank:(i + 1) * per_rank])  # for the proof only
                bar.advance()
                if (len(losses) + len(pending)) % log_every == 0 or done + 1 == steps:
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)  # SUM over ranks (the default op), then divide
                    losses += (chunk / world_size).tolist()  # the one host sync per log line
                    pending = []
                    ledger.sync()
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate((len(losses) - start) * recipe.GLOBAL_BATCH))
                    if rank == 0 and len(losses) % log_every == 0:
                        atomic_write(snapshot_path, lambda f, s=snapshot(len(losses)): torch.save(s, f))
                time.sleep(args.step_delay)
    wall = timer.seconds

    # Step 6: Check that every sample was trained once per epoch
    # The proof of exact resume: every step's 96 sample ids, gathered from every rank, are
    # lesson 01's batch of that step, whatever was killed when.
    ui.step(6, "Check that every sample was trained once per epoch")
    exact = ledger.every_sample_once(len(data.train), args.seed, args.epochs, len(loader))
    ui.print(f"every sample once per epoch, in lesson 01's order? [bold]{'yes' if exact else 'NO'}[/bold]")

    # Step 7: Save on rank 0, then wait at a barrier
    # All ranks hold the same weights, so one file is enough: rank 0 writes it. Every rank
    # writing the same path would race. The job is complete, so rank 0 deletes the snapshot:
    # the next make lesson-07 starts from scratch instead of "resuming" a finished run.
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
            lesson="07", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=(steps - start) * recipe.GLOBAL_BATCH, epochs=args.epochs, seed=args.seed,
            dataset=data.name, global_batch=recipe.GLOBAL_BATCH, restarts=restart_count,
            max_restarts=max_restarts, resumed_from_step=start, snapshot_every=args.snapshot_every,
            fail_at_step=args.fail_at_step, every_sample_once_per_epoch=exact,
            max_abs_diff_vs_single_device=diff, single_process_samples_per_second=round(one_rate, 1)))
        atomic_write(folder / "samples.pt", lambda f: torch.save(ledger.tensor(), f))
        snapshot_path.unlink(missing_ok=True)
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} "
                 f"and metrics.json; deleted {shown(snapshot_path)} (the job is complete)")
        ui.print(f"same weights as one device? max |w_ddp - w_lesson01| = [bold]{diff:.1e}[/bold] "
                 + ("(yes: the only difference is float sums added in another order)" if diff <= 1e-4
                    else "(NO: something differs from lesson 01's recipe)"))
        rate = (steps - start) * recipe.GLOBAL_BATCH / wall
        same = "on one GPU" if device.type == "cuda" else f"with the same {threads} threads"
        ui.print(f"speed: {world_size} ranks {rate:,.0f} samples/s; one process {same} "
                 f"{one_rate:,.0f} samples/s: DDP was {max(rate, one_rate) / min(rate, one_rate):.1f}x "
                 f"{'faster' if rate > one_rate else 'slower'} in this run")
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
