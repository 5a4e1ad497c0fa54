"""Step 7 of lesson 12: BatchNorm statistics per rank, and synchronised by hand.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/batchnorm.py
    .venv/bin/python lessons/12_pitfalls/batchnorm.py --break batchnorm
or as part of the whole lesson: make lesson-12 ARGS="--break batchnorm".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 7.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks (Steps 1, 2, 10) and this step only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

import torch
import torch.distributed as dist
import torch.nn as nn
from rich.markup import escape

from common import recipe
from kit import fmt, gather

STEP = 7
NAMES = ['batchnorm']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # BatchNorm normalises with the mean and variance of *its* batch: on N ranks that is the
    # per-rank batch (96/N samples), not the global one, and each rank's running statistics
    # drift apart. (That is why the shared recipe has no BatchNorm.) nn.SyncBatchNorm
    # all-gathers the statistics so every rank uses the global batch's; it runs on GPUs only,
    # so on the CPU we do what it does by hand: all-reduce sums, sums of squares and counts.
    broken = args.brk == "batchnorm"
    torch.manual_seed(args.seed)
    layer, bn = nn.Linear(recipe.FEATURES, 8), nn.BatchNorm1d(8)  # a tiny model of our own
    reference = nn.BatchNorm1d(8)  # one process, the whole global batch: the right answer
    if not broken:
        try:  # what nn.SyncBatchNorm says about CPU tensors
            sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(8)))
            sync(torch.randn(4, 8))
        except ValueError as exc:
            ui.print(f"nn.SyncBatchNorm on the CPU: ValueError: {escape(str(exc))}; so we sync by hand")
    order = recipe.epoch_order(len(data.train), args.seed, 0)
    used_means = []
    for step in range(3):  # three training-mode forwards, as in three training steps
        batch = order[step * recipe.GLOBAL_BATCH:(step + 1) * recipe.GLOBAL_BATCH]
        with torch.no_grad():
            h_all = layer(data.train.tensors[0][batch])
            reference(h_all)
            h = h_all[rank::world_size]  # this rank's share of the global batch
            if broken:
                bn(h)
                used_means.append(h.mean(0))
            else:
                used_means.append(synced_batch_norm(bn, h)[1])
    rows = gather([bn.running_mean[:3].tolist(), bn.running_var[:3].tolist()])
    ui.print(f"{'broken: plain BatchNorm1d on each rank' if broken else 'fixed: statistics all-reduced over every rank'}"
             f"; running_mean[:3] and running_var[:3] after 3 steps:")
    for r, (m, v) in enumerate(rows):
        ui.print(f"  rank {r}:       mean {fmt(m)}  var {fmt(v)}")
    ui.print(f"  one process:  mean {fmt(reference.running_mean[:3])}  var {fmt(reference.running_var[:3])}")
    diff = max((bn.running_mean - reference.running_mean).abs().max().item(),
               (bn.running_var - reference.running_var).abs().max().item())
    batch_gap = (used_means[-1] - h_all.mean(0)).abs().max().item()
    diffs = gather([diff, batch_gap])
    for r, (d, g) in enumerate(diffs):
        ui.print(f"  rank {r}: max |running stats - one process| = {d:.1e}; "
                 f"max |mean it normalised with - global batch mean| = {g:.1e}")
    evidence["batchnorm"] = {"max_diff_running_stats": max(d for d, _ in diffs),
                             "max_diff_batch_mean": max(g for _, g in diffs),
                             "ranks_agree": all(row == rows[0] for row in rows)}


def synced_batch_norm(bn: nn.BatchNorm1d, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm with the global batch's statistics (forward only).

    nn.SyncBatchNorm does this on GPUs (it all-gathers each rank's mean, invstd and count,
    and also syncs in backward). Sums and counts add up across ranks, so one all_reduce of
    [sum, sum of squares, count] gives the global mean and variance exactly.
    """
    c = h.shape[1]
    stats = torch.cat([h.sum(0), (h * h).sum(0), torch.tensor([float(len(h))])]).double()
    dist.all_reduce(stats)  # SUM over ranks
    n = stats[-1]
    mean = stats[:c] / n
    var = stats[c:2 * c] / n - mean * mean  # biased: what BatchNorm normalises with
    m = bn.momentum
    bn.running_mean.mul_(1 - m).add_(m * mean.float())
    bn.running_var.mul_(1 - m).add_(m * (var * n / (n - 1)).float())  # unbiased, as BatchNorm
    bn.num_batches_tracked += 1
    out = (h - mean.float()) / torch.sqrt(var.float() + bn.eps) * bn.weight + bn.bias
    return out, mean.float()


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "batchnorm": (
        "Symptom: each rank normalised with its own small batch's statistics, and the ranks' "
        "running mean and variance disagree with each other and with one process on the whole "
        "batch; nothing fails, and the saved model (rank 0's) carries statistics of 1/N of "
        "the data. Cause: BatchNorm computes statistics over the batch it sees, which under "
        "DDP is the per-rank batch. Fix: nn.SyncBatchNorm.convert_sync_batchnorm(model) before "
        "DDP on GPUs (it all-gathers the statistics), or use GroupNorm/LayerNorm, which need "
        "no batch statistics."),
}
