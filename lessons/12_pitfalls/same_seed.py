"""Step 4 of lesson 12: the same seed is right for the weights, wrong for augmentation.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/same_seed.py
    .venv/bin/python lessons/12_pitfalls/same_seed.py --break same-seed
or as part of the whole lesson: make lesson-12 ARGS="--break same-seed".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 4.
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

from common import recipe
from kit import fmt

STEP = 4
NAMES = ['same-seed']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # Same seed everywhere is right for the initial weights (every copy must start equal)
    # and wrong for augmentation: ranks seeded alike draw the *same* noise, so a global batch
    # of 96 gets only 96/N different augmentations. Per-rank randomness comes from a private
    # generator seeded with (seed, rank); the global RNG stays the same on every rank.
    broken = args.brk == "same-seed"
    per_rank = recipe.GLOBAL_BATCH // world_size
    order = recipe.epoch_order(len(data.train), args.seed, 0)[:recipe.GLOBAL_BATCH]
    x = data.train.tensors[0][order[rank::world_size]]  # this rank's share of one batch
    if broken:
        torch.manual_seed(args.seed)  # the same seed on every rank
        noise = torch.randn(x.shape)
    else:
        g = torch.Generator().manual_seed(args.seed * 2**32 + rank)  # distinct per (seed, rank)
        noise = torch.randn(x.shape, generator=g)
    augmented = x + 0.1 * noise  # "jitter": the simplest augmentation there is
    noises = [torch.empty_like(noise) for _ in range(world_size)]
    dist.all_gather(noises, noise)
    label = "broken: torch.manual_seed(seed) on every rank" if broken else \
        "fixed: torch.Generator().manual_seed(seed * 2**32 + rank)"
    ui.print(f"{label}; x + 0.1 * noise on each rank's {tuple(augmented.shape)} batch; "
             f"its first noise vector:")
    for r, n in enumerate(noises):
        ui.print(f"  rank {r}: {fmt(n[0, :4])} ...")
    distinct = torch.unique(torch.cat(noises), dim=0).shape[0]
    ui.print(f"distinct noise vectors in the global batch of {recipe.GLOBAL_BATCH}: {distinct}"
             f"{'  <- every rank drew the same ones' if distinct == per_rank else ''}")
    evidence["same_seed"] = {"distinct_noise_vectors": distinct, "global_batch": recipe.GLOBAL_BATCH}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "same-seed": (
        "Symptom: every rank drew exactly the same random augmentation, so a global batch has "
        "only 1/N as many different augmentations as samples; nothing fails. Cause: "
        "torch.manual_seed(seed) on every rank makes the global random stream identical "
        "everywhere (DataLoader workers inherit their seeds from it too). Fix: keep the same "
        "seed for the initial weights, and draw per-rank randomness from a private "
        "torch.Generator seeded with (seed, rank)."),
}
