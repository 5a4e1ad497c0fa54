"""Measure lesson 11's race: flags, best-case bounds, per-worker statistics, tables, metrics.

Lesson 11 (lessons/11_sync_vs_async.py) tells the idea: N workers train the same recipe once
synchronously (a gloo all-reduce every step) and once asynchronously (Hogwild: one model in
shared memory, no lock), with one worker slowed down. What only *checks*, *measures* or
*prints* that race lives here, so the lesson reads top to bottom:

* check_args: the flag rules beyond a flag's type (2..8 workers that split the batch, a real
  --slow-rank, no faster "slow" worker, no --device cuda);
* show_bounds: step 1's best-case throughput of each mode, from the simulated compute times;
* shared_stats / record / clock: the per-worker statistics every process writes into shared
  memory (samples, updates, seconds computing and waiting, start and end of its clock);
* explain_straggler / wait_at: gloo's timeout and a broken barrier said in the lesson's words;
* replica_spread: are the N synchronous copies still identical?
* summarise: rank 0's per-worker table and every number step 4 compares;
* compare: step 4's table and sentence; save: step 5's final.pt and metrics.json.

Nothing here trains: the two training loops stay in the lesson, and this module does not
import it.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import recipe
from common.cli import fail
from apparatus.results import make_metrics, max_abs_diff, save_results, shown

MAX_WORLD = 8
# columns of the per-worker statistics every process writes into shared memory
SAMPLES, UPDATES, BUSY, WAIT, START, END = range(6)


def check_args(args) -> None:
    """Lesson 11's flag rules, each broken one a single `error:` line."""
    n = args.world_size
    if n < 2:
        fail(f"--world-size {n} is one worker: nothing to synchronise and nobody to be stale "
             f"behind; use --world-size 2 or more (the default is 4)")
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD, least=2)
    if args.slow_rank >= n:
        fail(f"--slow-rank {args.slow_rank} does not exist among {n} workers (0..{n - 1})")
    if args.slow_factor < 1:
        fail(f"--slow-factor {args.slow_factor:g} would make the slow worker faster; use 1 "
             f"(nobody slow) or more")
    if args.device == "cuda":
        fail("this lesson trains on the CPU on purpose (Hogwild shares one model in CPU "
             "memory between processes); leave out --device")


def show_bounds(ui, args, batch: int) -> dict:
    """Step 1: the simulated compute per batch and the best throughput each mode can reach
    with no overhead at all. Returns {"sync": samples/s, "async": samples/s}."""
    n = args.world_size
    work, slow = args.work_ms / 1e3, args.work_ms / 1e3 * args.slow_factor
    bounds = {"sync": recipe.GLOBAL_BATCH / slow,             # every step waits for the slowest
              "async": batch * ((n - 1) / work + 1 / slow)}   # everyone at their own pace
    ui.print(f"simulated compute per batch: {args.work_ms:g} ms; worker {args.slow_rank}: "
             f"{args.work_ms * args.slow_factor:g} ms")
    ui.print(f"best case (compute only, no overhead): sync {bounds['sync']:,.0f} samples/s "
             f"= N*B / slowest batch time; async {bounds['async']:,.0f} samples/s = the sum "
             f"of every worker's own rate")
    return bounds


def shared_stats(n: int, updates: int, hogwild: bool = False) -> dict:
    """Per-worker statistics and the loss of every update, in shared memory (made before
    the workers start, so all of them write the same tensors). Hogwild also records, per
    update, its staleness and which worker made it."""
    sh = {"stats": torch.zeros(n, 6, dtype=torch.float64).share_memory_(),
          "losses": torch.zeros(updates, dtype=torch.float64).share_memory_()}
    if hogwild:
        sh["staleness"] = torch.full((updates,), -1, dtype=torch.int64).share_memory_()
        sh["owner"] = torch.full((updates,), -1, dtype=torch.int64).share_memory_()
    return sh


def record(sh: dict, rank: int, samples: int, busy: float, wait: float = 0.0) -> None:
    """One update by `rank`: its samples, seconds computing and seconds waiting."""
    stats = sh["stats"]
    stats[rank, SAMPLES] += samples
    stats[rank, UPDATES] += 1
    stats[rank, BUSY] += busy
    stats[rank, WAIT] += wait


def clock(sh: dict, rank: int, start: float, end: float) -> None:
    """When `rank` started and stopped training (the wall time spans all workers)."""
    sh["stats"][rank, START], sh["stats"][rank, END] = start, end


def explain_straggler(exc: RuntimeError, rank: int, step: int, args) -> None:
    """Re-raise gloo's timeout as what it means here. The first worker to time out exits;
    the others then see "Connection closed by peer": the same cause, the same message."""
    text = str(exc)
    if "Timed out" not in text and "Connection closed by peer" not in text:
        raise exc
    what = "waited" if "Timed out" in text else "lost a worker that had waited"
    raise RuntimeError(
        f"rank {rank} {what} more than --timeout {args.timeout:g}s in all-reduce at step "
        f"{step}: a synchronous step waits for the slowest worker (worker {args.slow_rank}: "
        f"{args.work_ms * args.slow_factor:g} ms per batch); raise --timeout or lower "
        f"--slow-factor") from None


def wait_at(barrier, rank: int, args, where: str, extra: float = 0.0) -> None:
    """A multiprocessing barrier with the lesson's timeout, and an error that says so."""
    try:
        barrier.wait(timeout=args.timeout + extra)
    except threading.BrokenBarrierError:
        raise RuntimeError(f"worker {rank} waited more than --timeout {args.timeout:g}s at "
                           f"{where} for the other workers") from None


def replica_spread(model) -> float:
    """Largest difference between any rank's weights and rank 0's (0.0 when in lockstep).
    Every rank calls it (a broadcast and an all-reduce)."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    gap = (mine - rank0).abs().max().view(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


_lesson01: dict = {}


def lesson01_weights(args, data) -> dict:
    """recipe.train_reference: lesson 01's final weights for this seed and epochs (once)."""
    if not _lesson01:
        _lesson01.update(recipe.train_reference(args.seed, args.epochs, data))
    return _lesson01


def summarise(ui, mode: str, model, data, sh: dict, args) -> dict:
    """Rank 0, once everyone is done: a per-worker table and the numbers of step 4."""
    stats, losses = sh["stats"], sh["losses"].tolist()
    n = stats.shape[0]
    wall = (stats[:, END].max() - stats[:, START].min()).item()
    if "staleness" in sh:
        staleness, owner = sh["staleness"].tolist(), sh["owner"].tolist()
    else:  # sync: nothing is ever stale, and every update is everyone's
        staleness, owner = [0] * len(losses), [None] * len(losses)

    def stale_of(r):
        return [s for s, o in zip(staleness, owner) if o in (r, None)]

    rows = []
    for r in range(n):
        mine = stale_of(r)
        rows.append([r, int(stats[r, UPDATES]), int(stats[r, SAMPLES]),
                     f"{stats[r, SAMPLES].item() / wall:,.0f}",
                     f"{stats[r, BUSY].item() / wall:.0%}",
                     f"{stats[r, WAIT].item() / wall:.0%}" if mode == "sync" else "-",
                     f"{sum(mine) / max(len(mine), 1):.1f}", max(mine, default=0)])
    ui.table(f"{mode}: per worker, {wall:.2f} s wall",
             ["worker", "updates", "samples", "samples/s", "computing", "waiting",
              "staleness", "max"], rows)
    with torch.no_grad():
        x, y = data.test.tensors
        test_loss = F.cross_entropy(model(x), y).item()
    last = losses[-(len(losses) // args.epochs):]  # the updates of the last epoch
    state = {k: v.detach() for k, v in model.state_dict().items()}
    samples = int(stats[:, SAMPLES].sum())
    return {
        "samples": samples,
        "samples_per_second": round(samples / wall, 1),
        "wall_seconds": round(wall, 3),
        "updates": len(losses),
        "staleness_mean": round(sum(staleness) / len(staleness), 3),
        "staleness_max": int(max(staleness)),
        "last_epoch_loss": round(sum(last) / len(last), 4),
        "test_loss": round(test_loss, 4),
        "final_accuracy": recipe.accuracy(model, data.test, torch.device("cpu")),
        "max_abs_diff_vs_single_device": max_abs_diff(state, lesson01_weights(args, data)),
        "per_worker": [{"worker": r, "updates": int(stats[r, UPDATES]),
                        "samples": int(stats[r, SAMPLES]),
                        "samples_per_second": round(stats[r, SAMPLES].item() / wall, 1),
                        "busy_fraction": round(stats[r, BUSY].item() / wall, 3),
                        "wait_fraction": round(stats[r, WAIT].item() / wall, 3),
                        "staleness_mean": round(sum(stale_of(r)) / max(1, len(stale_of(r))), 3)}
                       for r in range(n)],
        "losses": losses,
    }


SHOWN_AS = [("samples/s, all workers", "samples_per_second", "{:,.0f}"),
            ("best case from step 1", "bound", "{:,.0f}"),
            ("wall seconds", "wall_seconds", "{:.2f}"),
            ("updates to the weights", "updates", "{:,}"),
            ("mean staleness (updates)", "staleness_mean", "{:.2f}"),
            ("max staleness", "staleness_max", "{:,}"),
            ("train loss, last epoch", "last_epoch_loss", "{:.4f}"),
            ("test loss", "test_loss", "{:.4f}"),
            ("test accuracy", "final_accuracy", "{:.1%}"),
            ("max |w - lesson 01's w|", "max_abs_diff_vs_single_device", "{:.1e}")]


def compare(ui, results: dict, bounds: dict, args, classes: int) -> None:
    """Step 4: the modes side by side, and (when both ran) what asynchrony bought."""
    modes = list(results)
    for m in modes:
        results[m]["bound"] = round(bounds[m], 1)
    ui.table(f"Same samples, same start; worker {args.slow_rank} is {args.slow_factor:g}x slower",
             [""] + modes, [[label] + [form.format(results[m][key]) for m in modes]
                            for label, key, form in SHOWN_AS])
    if len(modes) == 2:
        speedup = results["async"]["samples_per_second"] / results["sync"]["samples_per_second"]
        ui.print(f"async got through the samples {speedup:.1f}x faster (best case "
                 f"{bounds['async'] / bounds['sync']:.1f}x) and reached "
                 f"{results['async']['final_accuracy']:.1%} test accuracy against sync's "
                 f"{results['sync']['final_accuracy']:.1%} (chance is {1 / classes:.0%})")


def save(ui, folder, results: dict, states: dict, args, data) -> None:
    """Step 5: final.pt and metrics.json for the first mode run (sync when it ran); the
    top-level fields describe that run, and "modes" holds every mode's numbers."""
    n = args.world_size
    mode = next(iter(results))
    r = results[mode]
    save_results(folder, states[mode], make_metrics(
        lesson="11", world_size=n, backend="gloo" if mode == "sync" else "shared-memory",
        device="cpu", losses=r["losses"], final_accuracy=r["final_accuracy"],
        wall_seconds=r["wall_seconds"], samples=r["samples"], mode=mode,
        epochs=args.epochs, seed=args.seed, dataset=data.name, slow_rank=args.slow_rank,
        slow_factor=args.slow_factor, work_ms=args.work_ms,
        worker_batch=recipe.GLOBAL_BATCH // n,
        modes={m: {k: v for k, v in results[m].items() if k != "losses"} for m in results}))
    ui.print(f"wrote {shown(folder / 'final.pt')} ({mode} weights) and "
             f"{shown(folder / 'metrics.json')}")
