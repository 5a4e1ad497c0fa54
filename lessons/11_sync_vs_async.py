"""Lesson 11: synchronous vs asynchronous updates, raced with one deliberately slow worker.

New since lesson 10: there we combined gradients; here we ask *when*. Synchronous training
(what DDP does) waits at every step until all N workers' gradients are summed, so the step
takes as long as the slowest worker. Asynchronous training (Hogwild: N processes updating
one model in shared memory, `torch.multiprocessing` + `model.share_memory()`) never waits,
but a worker's gradient may be computed on weights that others have changed since: it is
*stale*. Both train the shared recipe on the same samples with one worker slowed down
(`--slow-rank`, `--slow-factor`); the lesson prints throughput, staleness and the loss and
accuracy each reaches.

It opens its own topic (when updates land, not how gradients travel), so it names no parent
lesson. What only checks flags, measures or prints (the flag rules, the best-case bounds, the
per-worker statistics and tables, the straggler's error message, metrics.json) is in
lessons/11_sync_vs_async/sync_async.py.

Run:
    make lesson-11
    make lesson-11 ARGS="--slow-factor 8"
    .venv/bin/python lessons/11_sync_vs_async.py --world-size 4 --slow-rank 1 --slow-factor 4 --work-ms 8
    .venv/bin/python lessons/11_sync_vs_async.py --mode sync --slow-factor 1000 --timeout 3   # too slow

Doc: docs/11_sync_vs_async.md
"""
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 11_sync_vs_async/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from common import recipe
from common.cli import lesson_parser, nonnegative_int, positive_float, run
from common.distributed import choose_port, env_store, spawn, teardown
from apparatus.results import claim_out, out_dir
from apparatus.ui import UI
from sync_async import (check_args, clock, compare, explain_straggler, record,
                                  replica_spread, save, shared_stats, show_bounds, summarise,
                                  wait_at)


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=4)
    parser.add_argument("--slow-rank", type=nonnegative_int, default=1,
                        help="the worker that is slowed down")
    parser.add_argument("--slow-factor", type=positive_float, default=4.0,
                        help="the slow worker's simulated compute takes this many times longer "
                             "(1 = no slow worker)")
    parser.add_argument("--work-ms", type=positive_float, default=8.0,
                        help="simulated compute per worker batch, in milliseconds (a sleep, "
                             "standing in for a bigger model on a device of its own)")
    parser.add_argument("--mode", choices=["both", "sync", "async"], default="both",
                        help="which of the two trainings to run")
    args = parser.parse_args()
    check_args(args)  # 2..8 workers that split the batch of 96, a real --slow-rank, CPU only
    return args


def main() -> None:
    args = parse_args()
    claim_out(out_dir("11", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    n = args.world_size
    ui.title(f"Lesson 11: synchronous vs asynchronous updates, {n} workers, "
             f"worker {args.slow_rank} {args.slow_factor:g}x slower")

    # Step 1: Set up the race
    # Same data, same initial weights and the same samples in both modes: the recipe's
    # epochs, in batches of 96/N per worker. Compute is simulated with a sleep of
    # --work-ms per batch (times --slow-factor on the slow worker): with 4 processes on
    # 2 cores, real compute would measure the cores' contention, not the algorithms.
    ui.step(1, "Set up the race")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    batch = recipe.GLOBAL_BATCH // n
    steps = args.epochs * len(data.train) // recipe.GLOBAL_BATCH  # synchronous steps
    ui.print(f"{n} workers x {batch} samples per batch; {args.epochs} epochs = "
             f"{args.epochs * len(data.train):,} samples in each mode")
    bounds = show_bounds(ui, args, batch)  # the best throughput each mode could reach
    # Everything the workers share lives in shared memory, made here, before they start:
    # the statistics each worker writes, and for Hogwild the model itself.
    shared = {}
    if args.mode in ("both", "sync"):
        shared["sync"] = shared_stats(n, steps)
    if args.mode in ("both", "async"):
        model = recipe.make_model(args.seed, data.in_features, data.classes)
        model.share_memory()  # the parameters move to shared memory: one copy for all workers
        ctx = mp.get_context("spawn")  # Values and Barriers a process not forked from us can share
        shared["async"] = {
            "model": model,
            "next_batch": ctx.Value("l", 0),  # the next batch to hand out
            "version": ctx.Value("l", 0),     # how many updates the shared model has had
            "start_line": ctx.Barrier(n), "finish_line": ctx.Barrier(n),
            **shared_stats(n, steps * n, hogwild=True)}  # one update per worker batch
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(choose_port(args.master_port))
    # --step: pause here; the workers pause again once their process group exists
    ui.pause(next_step=(2, "Train synchronously") if "sync" in shared else None)
    spawn(worker, (n, args, shared, bounds), n)


def worker(rank: int, n: int, args, shared: dict, bounds: dict) -> None:
    torch.set_num_threads(1)  # N workers share the cores
    ui = UI(rank, n, step_mode=args.step)
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    results, states = {}, {}

    if "sync" in shared:
        # Step 2: Train synchronously
        # N processes in a gloo group, each with its own copy of the model. Each computes
        # the gradient of its 96/N samples, all-reduce sums the N gradients (lesson 10) and
        # every copy takes the same step. The all-reduce is also a barrier: nobody goes on
        # before the slowest has arrived. DDP does the same inside backward(); we write it
        # out to time the waiting.
        ui.step(2, "Train synchronously")
        # env_store: the store env:// would make, but on 127.0.0.1 only (lesson 05)
        dist.init_process_group("gloo", store=env_store(rank, n, args.timeout), rank=rank,
                                world_size=n, timeout=datetime.timedelta(seconds=args.timeout))
        model = train_sync(rank, n, args, data, ui, shared["sync"])
        spread = replica_spread(model)  # are the N copies still identical?
        if rank == 0:
            results["sync"] = summarise(ui, "sync", model, data, shared["sync"], args)
            results["sync"]["replicas_max_diff"] = spread
            ui.print(f"all {n} copies ended identical (max difference {spread:.1e}), equal to "
                     f"lesson 01's weights up to "
                     f"{results['sync']['max_abs_diff_vs_single_device']:.1e}: synchronous "
                     f"training is plain SGD on the global batch")
            states["sync"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dist.barrier()  # rank 0 has read everything before anyone leaves
        del model

    if "async" in shared:
        # Step 3: Train asynchronously (Hogwild)
        # One model in shared memory, N processes. Each takes the next batch from a shared
        # counter, computes its gradient on the weights as they are *now*, and applies it
        # with its own optimizer: no lock, no waiting. A shared version counter tells each
        # worker how many updates the others made in between: the staleness.
        ui.step(3, "Train asynchronously (Hogwild)")  # (--step waits on the group of Step 2)
        teardown()  # the asynchronous part needs no process group: memory is shared
        a = shared["async"]
        train_async(rank, n, args, data, ui, a)
        # all updates are in; the slow worker may still be in its last batch, so allow
        # for that on top of the timeout
        wait_at(a["finish_line"], rank, args, "the finish line",
                extra=args.work_ms / 1e3 * args.slow_factor)
        if rank == 0:
            results["async"] = summarise(ui, "async", a["model"], data, a, args)
            states["async"] = {k: v.detach().clone() for k, v in a["model"].state_dict().items()}
    if rank != 0:
        return
    ui.world_size = 1  # the other workers have left: rank 0 alone asks from here (--step)

    # Step 4: Compare
    # Throughput is what asynchrony buys; staleness is what it costs; the loss and the
    # accuracy say whether the cost mattered on this problem.
    ui.step(4, "Compare")
    compare(ui, results, bounds, args, data.classes)

    # Step 5: Save the results
    # metrics.json's top-level fields describe the synchronous run (or the only run made),
    # and "modes" holds both. final.pt holds the synchronous weights when there are any:
    # they are the ones every rerun reproduces exactly.
    ui.step(5, "Save the results")
    save(ui, out_dir("11", args.out), results, states, args, data)


def simulate_work(rank: int, args) -> None:
    """The worker's compute beyond our tiny MLP: a sleep, so that the timing shows the
    algorithm rather than N processes fighting over 2 cores."""
    factor = args.slow_factor if rank == args.slow_rank else 1.0
    time.sleep(args.work_ms / 1e3 * factor)


def train_sync(rank: int, n: int, args, data, ui: UI, sh: dict):
    """Step 2's loop: local gradient, all-reduce (wait for everyone), identical step."""
    losses = sh["losses"]
    model = recipe.make_model(args.seed, data.in_features, data.classes)  # same seed: same start
    optimizer = recipe.make_optimizer(model)
    params = list(model.parameters())
    x_all, y_all = data.train.tensors
    per_epoch = len(y_all) // recipe.GLOBAL_BATCH
    step = 0
    dist.barrier()  # everyone has loaded: start the clock together
    ui.print(f"{n} workers joined the gloo group and loaded the data: the clock starts")
    start = time.time()
    for epoch in range(args.epochs):
        order = torch.tensor(recipe.epoch_order(len(y_all), args.seed, epoch))
        for k in range(per_epoch):
            # rank r's share of global batch k: positions r, r+N, ... (DistributedSampler's)
            idx = order[k * recipe.GLOBAL_BATCH + rank:(k + 1) * recipe.GLOBAL_BATCH:n]
            t0 = time.time()
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            simulate_work(rank, args)
            t1 = time.time()
            # one message per step: every gradient, flattened, and the loss at the end
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().view(1)])
            try:
                dist.all_reduce(flat)  # SUM; returns once the slowest worker has sent too
            except RuntimeError as exc:
                explain_straggler(exc, rank, step, args)  # a timeout, in one clear line
            flat /= n  # the mean of N means over 96/N samples = the mean over 96 samples
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()  # the same gradient on every copy: the same step
            record(sh, rank, len(idx), busy=t1 - t0, wait=time.time() - t1)
            if rank == 0:
                losses[step] = flat[-1].item()  # the global batch's loss
            step += 1
        if rank == 0:
            ui.log(epoch + 1, step, args.epochs * per_epoch,
                   losses[step - per_epoch:step].mean().item(),
                   step * recipe.GLOBAL_BATCH / (time.time() - start))
    clock(sh, rank, start, time.time())
    return model


def train_async(rank: int, n: int, args, data, ui: UI, sh: dict) -> None:
    """Step 3's loop: next batch from a shared counter, gradient, lock-free update."""
    model, next_batch, version = sh["model"], sh["next_batch"], sh["version"]
    losses, staleness, owner = sh["losses"], sh["staleness"], sh["owner"]
    # Each worker has its own optimizer (and momentum buffers) over the *shared* parameters.
    # lr / N: N updates of 96/N samples then move the weights as far as one synchronous
    # update of 96 samples: both runs take the same step per sample.
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.LR / n, momentum=recipe.MOMENTUM)
    x_all, y_all = data.train.tensors
    batch = recipe.GLOBAL_BATCH // n
    per_epoch = len(y_all) // batch
    total = args.epochs * per_epoch
    orders = [torch.tensor(recipe.epoch_order(len(y_all), args.seed, e))
              for e in range(args.epochs)]
    wait_at(sh["start_line"], rank, args, "the start line")  # start the clock together
    ui.print(f"{n} workers share one model and loaded the data: the clock starts")
    start = time.time()
    while True:
        with next_batch.get_lock():  # every batch is handed out exactly once
            b = next_batch.value
            next_batch.value += 1
        if b >= total:
            break
        epoch, k = divmod(b, per_epoch)
        idx = orders[epoch][k * batch:(k + 1) * batch]  # the same samples as the sync run
        read = version.value  # the weights we are about to read have had this many updates
        t0 = time.time()
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()   # the gradient lands in this process's own .grad tensors
        simulate_work(rank, args)
        busy = time.time() - t0
        optimizer.step()  # writes straight into the shared weights: no lock (Hogwild)
        with version.get_lock():
            staleness[b] = version.value - read  # updates by the others since we read
            version.value += 1
        losses[b] = loss.item()
        owner[b] = rank
        record(sh, rank, len(idx), busy=busy)
        if (b + 1) % per_epoch == 0:  # whoever finishes an epoch's last batch reports it
            ui.say_all(f"epoch {epoch + 1:>2} | update {b + 1:>4}/{total} | loss "
                       f"{loss.item():.4f} | {(b + 1) * batch / (time.time() - start):>9,.0f} "
                       f"samples/s")
    clock(sh, rank, start, time.time())


if __name__ == "__main__":
    run(main)
