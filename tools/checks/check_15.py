"""Check exercise 15: ZeRO-2 by hand (gradients sharded as well as the optimizer state).

The learner's ZeroTwo (a subclass of lesson 15's ShardedOptimizer) trains a small model with
a tied weight and a frozen layer on 3 ranks for 3 AdamW steps; each rank compares its
weights with the same steps in one process and reports which parameters still hold a .grad.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/15_zero2.py"
STEPS = 3
WORLD = 3


def _model():
    import torch
    import torch.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight  # tied: one tensor, two layers
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(torch.tanh(self.b(self.frozen(torch.tanh(self.a(x))))))

    torch.manual_seed(0)
    return Tied()


def _rank_15(rank: int, world: int, path: str) -> dict:
    import torch

    from check_exercise import load

    module = load(Path(path))
    model, single = _model(), _model()
    opt = module.ZeroTwo(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ref = torch.optim.AdamW(single.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(world * 4, 8, generator=g)
        opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4]).square().mean().backward()
        opt.step()
        ref.zero_grad()
        sum(single(x[r * 4:(r + 1) * 4]).square().mean() for r in range(world)).div(world).backward()
        ref.step()
    mine = {id(p) for p in opt.shards[rank]}
    params = list(model.parameters())
    return {"diff": max((a - b).abs().max().item() for a, b in zip(params, single.parameters())),
            "foreign": sum(1 for p in params if id(p) not in mine and p.grad is not None),
            "own_missing": sum(1 for p in opt.shards[rank] if p.requires_grad and p.grad is None),
            "grad_elements": sum(p.grad.numel() for p in params if p.grad is not None),
            "elements": sum(p.numel() for p in params if p.requires_grad)}


def check(path: Path) -> str:
    """After step(), each rank holds only its own shard's gradients; weights as one process."""
    from check_exercise import NotYet, load, run_world

    load(path)
    ranks = run_world(WORLD, _rank_15, (str(path),), path)
    setup = f"{WORLD} ranks, {STEPS} AdamW steps, a tied weight and a frozen layer"
    worst = max(r["diff"] for r in ranks)
    if worst > 1e-5:
        raise NotYet(f"{setup}: the weights end {worst:.1e} away from one process (allowed "
                     f"1e-5). Free the gradients after the step, never before: the "
                     f"reduce-scatter needs everyone's")
    foreign = [r for r, x in enumerate(ranks) if x["foreign"]]
    if foreign:
        r = foreign[0]
        raise NotYet(f"{setup}: the weights are right, but rank {r} still holds the gradients "
                     f"of {ranks[r]['foreign']} parameters another rank steps "
                     f"({ranks[r]['grad_elements']:,} gradient elements of "
                     f"{ranks[r]['elements']:,}): that is ZeRO-1. Which gradients does a rank "
                     f"need after the reduce-scatter? (self.shards[dist.get_rank()])")
    if any(x["own_missing"] for x in ranks):
        raise NotYet(f"{setup}: a rank freed a gradient of its own shard too; keep those")
    held = sum(x["grad_elements"] for x in ranks)
    return (f"on {WORLD} ranks each rank keeps only its own gradients ({held:,} gradient "
            f"elements in all, each parameter's on one rank, instead of {WORLD} x "
            f"{ranks[0]['elements']:,}); weights as one process (max diff {worst:.1e})")
