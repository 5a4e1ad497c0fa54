"""Step 3 of lesson 12: forget sampler.set_epoch(epoch) and every epoch replays epoch 0's order.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/set_epoch.py
    .venv/bin/python lessons/12_pitfalls/set_epoch.py --break set-epoch
or as part of the whole lesson: make lesson-12 ARGS="--break set-epoch".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 3.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks (Steps 1, 2, 10) and this step only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

from torch.utils.data import DistributedSampler

from common import recipe

STEP = 3
NAMES = ['set-epoch']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch only
    # changes when you call set_epoch(). Forget it and every epoch replays epoch 0's order:
    # each rank sees the same 1/N of the data, in the same order, every epoch.
    broken = args.brk == "set-epoch"
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    orders = []
    for epoch in range(args.epochs):
        if not broken:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
        if not broken:  # the order lesson 01 uses, dealt out rank, rank+N, rank+2N, ...
            assert orders[-1] == recipe.epoch_order(len(data.train), args.seed, epoch)[rank::world_size]
    label = "broken: no set_epoch()" if broken else "fixed: set_epoch(epoch) before each epoch"
    ui.print(f"{label}; the first 6 sample indices of rank 0, epoch by epoch:")
    for epoch, order in enumerate(orders):
        ui.print(f"  epoch {epoch}: {order[:6]}")
    seen = len(set().union(*orders))
    same = all(order == orders[0] for order in orders)
    ui.print(f"every epoch the same order: {'YES' if same else 'no'}; rank 0 saw {seen} distinct "
             f"samples of {len(data.train)} in {args.epochs} epochs")
    evidence["set_epoch"] = {"first_indices": [o[:6] for o in orders], "same_every_epoch": same,
                             "distinct_seen_by_rank_0": seen}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "set-epoch": (
        "Symptom: every epoch shows the same sample order on every rank, and each rank sees the "
        "same 1/N of the data forever; nothing fails, the model just trains on a less shuffled "
        "stream. Cause: DistributedSampler seeds its shuffle with seed + epoch, and the epoch "
        "only changes when you call sampler.set_epoch(epoch). Fix: call "
        "sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader."),
}
