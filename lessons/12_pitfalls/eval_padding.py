"""Step 8 of lesson 12: evaluate every sample exactly once; DistributedSampler pads.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/eval_padding.py
    .venv/bin/python lessons/12_pitfalls/eval_padding.py --break eval-padding
or as part of the whole lesson: make lesson-12 ARGS="--break eval-padding".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 8.
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
from torch.utils.data import DistributedSampler

from common import recipe
from kit import gather

N_VAL = 101  # a validation set that 2, 3 and 4 ranks cannot split evenly

STEP = 8
NAMES = ['eval-padding']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # DistributedSampler gives every rank the same number of samples; when N does not divide
    # the data set it *pads* by repeating the first samples (drop_last=False). Those repeats
    # are counted twice, and averaging per-rank accuracies adds its own skew. The fix: split
    # without padding (rank, rank+N, ...) and all-reduce the *sums*: correct and count.
    broken = args.brk == "eval-padding"
    model = recipe.make_model(args.seed)
    model.load_state_dict(recipe.train_reference(args.seed, epochs=1, data=data))  # 1 epoch
    model.eval()
    x_val, y_val = data.test.tensors[0][:N_VAL], data.test.tensors[1][:N_VAL]
    with torch.no_grad():
        right = model(x_val).argmax(1) == y_val  # the single-process answer, per sample
    truth = right.sum().item() / N_VAL
    if broken:
        mine = list(DistributedSampler(x_val, num_replicas=world_size, rank=rank, shuffle=False))
    else:
        mine = list(range(rank, N_VAL, world_size))  # no padding: some ranks get one less
    with torch.no_grad():
        correct = (model(x_val[mine]).argmax(1) == y_val[mine]).sum().item()
    rows = gather([correct, len(mine)])
    for r, (c, n) in enumerate(rows):
        ui.print(f"  rank {r}: {c}/{n} correct = {c / n:.2%}")
    if broken:
        seen = sum(n for _, n in rows)
        measured = sum(c / n for c, n in rows) / world_size
        ui.print(f"broken: DistributedSampler(val, shuffle=False) evaluated {seen} predictions for "
                 f"{N_VAL} samples (samples {list(range(seen - N_VAL))} twice)")
        ui.print(f"  mean of the per-rank accuracies: {measured:.2%}   one process: {truth:.2%}"
                 f"   <- wrong by {100 * (measured - truth):+.2f} points")
    else:
        totals = torch.tensor([correct, len(mine)])  # int64: counts add up exactly
        dist.all_reduce(totals)  # SUM of correct answers and of counts over ranks
        measured = totals[0].item() / totals[1].item()
        ui.print(f"fixed: all_reduce(\\[correct, count]) = {totals.tolist()} -> "
                 f"{measured:.2%}; one process: {truth:.2%} (equal: {'yes' if measured == truth else 'NO'})")
    evidence["eval"] = {"distributed_accuracy": measured, "one_process_accuracy": truth,
                        "predictions": sum(n for _, n in rows), "samples": N_VAL}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "eval-padding": (
        "Symptom: the distributed accuracy differs from the single-process accuracy of the "
        "same model on the same data, and the prediction count exceeds the data set. Cause: "
        "DistributedSampler pads every rank to the same length by repeating the first samples "
        "(drop_last=False), and a mean of per-rank accuracies weighs ranks, not samples. Fix: "
        "split without padding and all-reduce the sums, correct and count, then divide once."),
}
