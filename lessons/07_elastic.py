"""Lesson 07: elastic training: survive a dead worker by restarting and resuming from a snapshot.

New since lesson 06: torchrun becomes *elastic*. With c10d rendezvous and --max-restarts,
the torchrun agent answers a failed worker by stopping every worker and starting them all
again (up to --max-restarts times), and with --nnodes MIN:MAX the job may run on a range
of node counts. torchrun restarts processes; it cannot restore their memory. The training
script must do that itself: rank 0 saves a *snapshot* (model, optimizer, epoch, step) every
--snapshot-every steps, atomically, and every new attempt resumes from it, mid-epoch, at
the exact batch where the snapshot was taken. The run ends with lesson 01's weights.

By default one rank kills itself with SIGKILL at step 45 of the first attempt (like the OOM
killer or a lost machine would), so `make lesson-07` shows one failure, one restart and
one resume. Pass --fail-at-step 0 for a run without a failure.

Run:
    make lesson-07     # 1 node x 2 workers, c10d rendezvous, --max-restarts 3, one failure
    .venv/bin/python tools/nodes.py --elastic --nnodes 1 --nproc-per-node 2 --max-restarts 3 -- lessons/07_elastic.py
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --max-restarts 3 lessons/07_elastic.py
    .venv/bin/python lessons/07_elastic.py --fail-at-step 0   # a world of one, no agent: nothing restarts it

    Kill a worker yourself: make lesson-07 ARGS="--fail-at-step 0 --step-delay 0.2", then
    `kill -9 <pid>` with a pid from the table of Step 2.

Doc: docs/07_elastic.md
"""
import argparse
import datetime
import gc
import os
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from apparatus.state_dicts import snapshot_problem
from common.distributed import die_with_parent, env_store, free_port
from apparatus.results import (atomic_write, claim_out, make_metrics, max_abs_diff, out_dir,
                            plain_state_dict, remove_strays, save_results, shown)
from apparatus.ui import UI, Timer

SNAPSHOT_FORMAT = 1  # bump when the snapshot's contents change: old snapshots are then refused


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of 0 or more, got {text!r}")
    return value


@record  # torchrun's failure summary shows our exception, not only "exit code 1" (lesson 06)
def main() -> None:
    parser = lesson_parser(__doc__, distributed=True)
    parser.add_argument("--fail-at-step", type=nonnegative_int, default=None,
                        help="on the first attempt only, one rank kills itself (SIGKILL) when it "
                             "reaches this global step; 0 = never (default: a little before "
                             "half-way: step 45 of 96)")
    parser.add_argument("--fail-rank", type=nonnegative_int, default=None,
                        help="the global rank that dies at --fail-at-step (default: the last rank)")
    parser.add_argument("--snapshot-every", type=positive_int, default=10,
                        help="rank 0 saves a snapshot after every this many optimizer steps")
    parser.add_argument("--step-delay", type=nonnegative_float, default=0.0,
                        help="seconds to sleep after each step, to have time to kill a worker by hand")
    parser.add_argument("--fresh", action="store_true",
                        help="on the first attempt, delete a snapshot left by an earlier, "
                             "interrupted job instead of resuming from it")
    args = parser.parse_args()
    die_with_parent()  # if our torchrun agent is killed (even kill -9), we go too

    # Step 1: Read who we are and which attempt this is
    # Lesson 06's variables, plus the ones the elastic agent adds. TORCHELASTIC_RESTART_COUNT
    # is 0 on the first attempt and goes up by one at every restart after a failure; the
    # workers of every attempt are brand-new processes, so this variable is the only memory
    # of earlier attempts they get from torchrun. Everything else comes from the snapshot.
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if not launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    ui = UI(rank, world_size, step_mode=args.step)
    ui.title(f"Lesson 07: attempt {restart_count + 1} of at most {max_restarts + 1}, "
             f"{world_size} worker(s), {'started by torchrun' if launched else 'plain python: a world of one'}")
    ui.step(1, "Read who we are and which attempt this is")
    recipe.check_world_size(world_size, f"WORLD_SIZE={world_size}")
    fail_rank = world_size - 1 if args.fail_rank is None else args.fail_rank
    if fail_rank >= world_size:
        fail(f"--fail-rank {fail_rank} does not exist in a world of {world_size} (ranks 0..{world_size - 1})")
    ui.print(f"TORCHELASTIC_RESTART_COUNT={restart_count} TORCHELASTIC_MAX_RESTARTS={max_restarts} "
             f"WORLD_SIZE={world_size} TORCHELASTIC_RUN_ID={os.environ.get('TORCHELASTIC_RUN_ID', '-')}")
    folder = claim_out(out_dir("07", args.out)) if rank == 0 else out_dir("07", args.out)
    if max_restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # measured here: without it, about half of the restarts failed to connect (see the doc)
        ui.print("[yellow]note:[/yellow] torchrun lends its store to every attempt, so a restarted "
                 "group can read the last attempt's addresses (pytorch/pytorch#135712); start "
                 "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tools/nodes.py does)")

    # Step 2: Join the process group
    # As in lesson 06. Every attempt joins a *new* process group: the old one died with the
    # old processes. The pids change at every attempt; `kill -9` one to see a restart.
    # (With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 hosts this attempt's store.)
    ui.step(2, "Join the process group")
    kind, note = plan_device(args.device, local_world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    device = rank_device(kind, local_rank)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    share_cpu(local_world_size)
    dist.init_process_group(backend=backend, store=env_store(rank, world_size, args.timeout),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, [rank, local_rank, socket.gethostname(), os.getpid(), str(device)])
    ui.table(f"Workers of attempt {restart_count + 1}", ["rank", "local rank", "host", "pid", "device"],
             everyone)

    # Step 3: Decide what a snapshot holds
    # Exact resume needs everything that decides the next step: the weights, the optimizer's
    # state (SGD's momentum buffers: without them the first resumed steps differ), where we
    # are (epoch and step within it) and what decides the sample order (the seed: the order
    # of an epoch is a function of seed and epoch only). Progress is counted in *global*
    # steps of GLOBAL_BATCH samples, not per-rank batches, so a snapshot stays valid if the
    # job comes back with another world size. Only tensors, numbers, strings, lists and
    # dicts: that is what torch.load(weights_only=True) accepts.
    ui.step(3, "Decide what a snapshot holds")
    snapshot_path = folder / "snapshot.pt"
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    per_rank = recipe.GLOBAL_BATCH // world_size
    steps_per_epoch = len(data.train) // recipe.GLOBAL_BATCH
    total_steps = args.epochs * steps_per_epoch
    if args.fail_at_step is not None and args.fail_at_step > total_steps:
        fail(f"--fail-at-step {args.fail_at_step} is beyond the last step ({total_steps}); "
             f"use 1..{total_steps}, or 0 for no failure")
    fail_step = max(1, total_steps // 2 - 3) if args.fail_at_step is None else args.fail_at_step
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    optimizer = recipe.make_optimizer(model)
    losses: list[float] = []
    ledger: list[torch.Tensor] = []  # the sample ids of every step: the proof of exact resume

    def snapshot(global_step: int) -> dict:
        return {
            "format": SNAPSHOT_FORMAT,
            "model": plain_state_dict(model),
            "optimizer": optimizer.state_dict(),
            "epoch": global_step // steps_per_epoch,          # epoch we are in (0-based)
            "step_in_epoch": global_step % steps_per_epoch,   # global steps done in that epoch
            "global_step": global_step,
            "seed": args.seed, "dataset": data.name, "global_batch": recipe.GLOBAL_BATCH,
            "world_size": world_size, "restart_count": restart_count,  # for the curious only
            "losses": list(losses),
            "samples": torch.stack(ledger) if ledger else torch.empty(0, recipe.GLOBAL_BATCH,
                                                                      dtype=torch.long),
        }

    def save_snapshot(global_step: int) -> None:
        # Temporary file + fsync + rename (apparatus.results.atomic_write): a process killed in
        # the middle of torch.save leaves a stray temporary file, never a half snapshot.pt.
        state = snapshot(global_step)
        atomic_write(snapshot_path, lambda f: torch.save(state, f))

    ui.print(f"rank 0 saves {shown(snapshot_path)} every {args.snapshot_every} steps: "
             f"model, optimizer, epoch, step, seed, losses, sample ids")

    # Step 4: Resume from the last snapshot, if there is one
    # Rank 0 decides, alone: it tidies up (stray temporary files from a save that was cut
    # short; the old snapshot if --fresh on the first attempt), reads and checks the
    # snapshot, and broadcasts it (or the reason to refuse it) to every rank. Ranks that each
    # looked for the file themselves could disagree (no shared disk, or a file that appears
    # between two looks) and then wait for each other forever. Rank 0 of the next attempt
    # may be on another machine, so on real machines --out must be on shared storage.
    # weights_only=True refuses anything but plain data: unpickling arbitrary objects from
    # a file on disk would run arbitrary code.
    ui.step(4, "Resume from the last snapshot, if there is one")
    decision: list = [None]  # rank 0 fills it in: None (start at 0), a snapshot, or an error
    if rank == 0:
        for stray in remove_strays(folder, snapshot_path.name):
            ui.print(f"deleted {shown(stray)}: a save that was cut short (snapshot.pt is intact)")
        if args.fresh and restart_count == 0 and snapshot_path.exists():
            snapshot_path.unlink()
            ui.print(f"--fresh: deleted {shown(snapshot_path)} left by an earlier job")
        if snapshot_path.exists():
            try:
                snap = torch.load(snapshot_path, map_location="cpu", weights_only=True)
                problem = snapshot_problem(snap, snapshot(0), {
                    "format": SNAPSHOT_FORMAT, "seed": args.seed, "dataset": data.name,
                    "global_batch": recipe.GLOBAL_BATCH, "steps_per_epoch": steps_per_epoch},
                    total_steps, f"--epochs {args.epochs}")
                if not problem:  # the optimizer's state must fit too: try it here, on rank 0
                    optimizer.load_state_dict(snap["optimizer"])
            except Exception as exc:  # truncated, not a torch file, objects weights_only refuses
                problem = f"cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
            decision = [f"snapshot {shown(snapshot_path)} {problem}; delete it or pass --fresh "
                        f"to start over" if problem else snap]
    dist.broadcast_object_list(decision, src=0)
    start_step = 0
    if isinstance(decision[0], str):
        if rank == 0:
            fail(decision[0], code=1)
        raise SystemExit(1)  # rank 0 has said why
    if decision[0] is not None:
        snap = decision[0]
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        start_step = snap["global_step"]
        losses = list(snap["losses"])
        ledger = list(snap["samples"].cpu())
        if restart_count == 0:  # a new job, not a restart: say why it does not start at 0
            ui.print(f"found a snapshot left by an earlier job that did not finish; "
                     f"--fresh would delete it and start over")
        ui.print(f"[bold]attempt {restart_count + 1} (restart count {restart_count}): resuming from "
                 f"snapshot at epoch {snap['epoch'] + 1} step {snap['step_in_epoch']}/{steps_per_epoch}"
                 f"[/bold] (global step {start_step}, saved with {snap['world_size']} worker(s))")
    else:
        ui.print(f"attempt {restart_count + 1} (restart count {restart_count}): no snapshot, "
                 f"starting from step 0")

    # Step 5: Train from where the snapshot left off
    # Lesson 06's DDP loop, with three additions. (1) Mid-epoch resume: the epoch's order
    # comes from the sampler exactly as before (set_epoch), and we drop the batches the
    # snapshot already holds, so no sample is seen twice or skipped. (2) Every
    # --snapshot-every steps the losses and sample ids kept on the device are gathered (one
    # host sync, as lesson 05 logs) and rank 0 saves. (3) On the first attempt one rank dies.
    ui.step(5, "Train from where the snapshot left off")
    fail_at = fail_step if restart_count == 0 else 0  # a failure on the first attempt only
    if fail_at and not launched:
        ui.print(f"[yellow]note:[/yellow] --fail-at-step {fail_at} ignored: without torchrun nobody "
                 f"would restart us (try make lesson-07)")
        fail_at = 0
    elif fail_at and fail_at > start_step:
        ui.print(f"rank {fail_rank} will kill itself (SIGKILL) at step {fail_at} of this attempt")
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    global_step = start_step
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, sample ids) per step, on device
    timer = Timer()
    with ui.progress(total_steps, f"training on {world_size} ranks") as bar:
        bar.advance(start_step)
        for epoch in range(start_step // steps_per_epoch, args.epochs):
            sampler.set_epoch(epoch)
            my_ids = list(sampler)  # this rank's share of the epoch, in order: rank, rank+W, ...
            first = global_step - epoch * steps_per_epoch  # batches of this epoch already done
            # the sampler a DataLoader takes can be any list of indices: start it mid-epoch
            loader = DataLoader(data.train, batch_size=per_rank, sampler=my_ids[first * per_rank:])
            for b, (x, y) in enumerate(loader, start=first):
                if global_step + 1 == fail_at and rank == fail_rank:
                    ui.say_all(f"step {global_step + 1}: killing myself with SIGKILL "
                               f"(pid {os.getpid()}), as the OOM killer would")
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: just gone
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                global_step += 1
                # bookkeeping for the proof only: which samples went into this step
                pending.append((loss.detach(), torch.tensor(my_ids[b * per_rank:(b + 1) * per_rank])))
                bar.advance()
                if global_step % args.snapshot_every == 0 or global_step == total_steps:
                    step_ids = torch.empty(len(pending) * recipe.GLOBAL_BATCH, dtype=torch.long,
                                           device=device)  # every rank's ids of these steps
                    dist.all_gather_single(step_ids, torch.cat([i for _, i in pending]).to(device))
                    step_ids = step_ids.view(world_size, len(pending), per_rank).transpose(0, 1)
                    ledger += list(step_ids.reshape(len(pending), recipe.GLOBAL_BATCH).cpu())
                    chunk = torch.stack([l for l, _ in pending])
                    dist.all_reduce(chunk)
                    losses += (chunk / world_size).tolist()
                    pending = []
                if global_step % args.snapshot_every == 0 and rank == 0:
                    save_snapshot(global_step)
                    rate = timer.rate((global_step - start_step) * recipe.GLOBAL_BATCH)
                    ui.print(f"epoch {epoch + 1:>2} | step {global_step:>4}/{total_steps} | "
                             f"loss {losses[-1]:.4f} | {rate:>9,.0f} samples/s | snapshot saved")
                if args.step_delay:
                    time.sleep(args.step_delay)
    wall = timer.seconds
    trained = global_step - start_step

    # Step 6: Save the result and compare with one device
    # As in lessons 05-06, plus the proof that the resumed run saw every sample once per
    # epoch, in lesson 01's order. The job is complete, so rank 0 deletes the snapshot: the
    # next `make lesson-07` starts from scratch instead of "resuming" a finished run.
    ui.step(6, "Save the result and compare with one device")
    if rank == 0:
        weights = plain_state_dict(model)
        diff = max_abs_diff(weights, recipe.train_reference(args.seed, args.epochs, data))
        samples = torch.stack(ledger)
        exact = all(
            sorted(samples[e * steps_per_epoch + s].tolist())
            == sorted(order[s * recipe.GLOBAL_BATCH:(s + 1) * recipe.GLOBAL_BATCH])
            for e in range(args.epochs)
            for order in [recipe.epoch_order(len(data.train), args.seed, e)]
            for s in range(steps_per_epoch))
        accuracy = recipe.accuracy(model, data.test, device)
        save_results(folder, weights, make_metrics(
            lesson="07", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=trained * recipe.GLOBAL_BATCH, epochs=args.epochs, seed=args.seed,
            dataset=data.name, restarts=restart_count, max_restarts=max_restarts,
            resumed_from_step=start_step, snapshot_every=args.snapshot_every,
            fail_at_step=fail_step, every_sample_once_per_epoch=exact,
            max_abs_diff_vs_single_device=diff))
        atomic_write(folder / "samples.pt", lambda f: torch.save(samples, f))
        snapshot_path.unlink(missing_ok=True)
        ui.print(f"restarts: {restart_count}; this attempt trained steps {start_step + 1}..{global_step}")
        ui.print(f"every sample once per epoch, in lesson 01's order? {'yes' if exact else 'NO'}")
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')}; "
                 f"deleted {shown(snapshot_path)} (the job is complete)")
        ui.print(f"same weights as one device? max |w - w_lesson01| = [bold]{diff:.1e}[/bold]")
    dist.barrier()

    # Step 7: Leave the process group
    ui.step(7, "Leave the process group")
    del ddp_model, model, optimizer
    gc.collect()  # before destroy: see lesson 05, Step 8
    dist.destroy_process_group()
    ui.print("done")


if __name__ == "__main__":
    run(main)
