"""Check exercise 15: ZeRO-2 by hand (gradients sharded during backward, as well as the state).

The learner's ZeroTwo (a subclass of lesson 15's ShardedOptimizer) trains a small model with
a tied weight and a frozen layer on 3 ranks for 3 AdamW steps; each rank compares its
weights with the same steps in one process, reports which parameters still hold a .grad at
the end of backward and after step(). Then the same model without its frozen layer trains
again, under ZeroTwo and under lesson 15's ShardedOptimizer (ZeRO-1), and torch's MemTracker
measures the peak of each one's last step. (Without the frozen layer: MemTracker hooks the
gradient of every parameter of each module it meets, and a frozen one raises, torch 2.14.1,
torch/distributed/_tools/mem_tracker.py, _pre_fw_hook.)
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/15_zero2.py"
STEPS = 3
WORLD = 3
WIDTH = 32  # the weights and their gradients, not the activations (4 rows), fill the memory


def _model(frozen: bool = True):
    import torch
    import torch.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
            self.b.weight = self.a.weight  # tied: one tensor, two layers
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.frozen.requires_grad_(not frozen)
            self.mid = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
            self.head = nn.Linear(WIDTH, 4)

        def forward(self, x):
            return self.head(self.mid(torch.tanh(self.b(self.frozen(torch.tanh(self.a(x)))))))

    torch.manual_seed(0)
    return Tied()


def _train(opt, model, batches, rank, foreign=frozenset(), track=False):
    """One step per batch on this rank's rows, the last one under MemTracker if `track`.
    Returns (its peak in bytes, or 0; how many parameters another rank owns still held a
    .grad when the last backward ended)."""
    import warnings
    from contextlib import nullcontext

    from torch.distributed._tools.mem_tracker import MemTracker
    # MemTracker's own gradient hook runs after ZeroTwo's, which may have freed the gradient
    warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
    tracker, kept = MemTracker(), 0
    for i, x in enumerate(batches):
        last = track and i == len(batches) - 1
        if last:  # what exists before the step: the weights, their gradients, AdamW's state
            tracker.track_external(model, opt)
        with tracker if last else nullcontext():
            opt.zero_grad()
            model(x[rank * 4:(rank + 1) * 4]).square().mean().backward()
            kept = sum(1 for p in model.parameters() if id(p) in foreign and p.grad is not None)
            opt.step()
    peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return peak, kept


def _batches():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * 4, WIDTH, generator=g) for _ in range(STEPS)]


def _rank_15(rank: int, world: int, path: str) -> dict:
    """In the answer's ranks: ZeroTwo trains; the weights, which gradients each rank kept, and
    MemTracker's peaks come back (one process's weights are trained by the check itself)."""
    import torch

    from check_exercise import load

    module = load(Path(path))
    model = _model()
    opt = module.ZeroTwo(model.parameters(), torch.optim.AdamW, lr=1e-2)
    mine = {id(p) for p in opt.shards[rank]}
    foreign = {id(p) for p in model.parameters()} - mine
    batches = _batches()
    _, kept = _train(opt, model, batches, rank, foreign)
    two, one = _model(frozen=False), _model(frozen=False)  # the peaks: ZeRO-2 and ZeRO-1
    peak, _ = _train(module.ZeroTwo(two.parameters(), torch.optim.AdamW, lr=1e-2), two, batches,
                     rank, track=True)
    peak_zero1, _ = _train(module.lesson_15.ShardedOptimizer(one.parameters(), torch.optim.AdamW,
                                                             lr=1e-2), one, batches, rank, track=True)
    params = list(model.parameters())
    return {"weights": [p.detach().clone() for p in params],
            "kept_after_backward": kept,
            "foreign": sum(1 for p in params if id(p) in foreign and p.grad is not None),
            "own_missing": sum(1 for p in opt.shards[rank] if p.requires_grad and p.grad is None),
            "grad_elements": sum(p.grad.numel() for p in params if p.grad is not None),
            "elements": sum(p.numel() for p in params if p.requires_grad),
            "peak": peak, "peak_zero1": peak_zero1}


def _single() -> list:
    """The same steps in one process: each step's gradient the mean of the ranks' losses."""
    import torch

    single = _model()
    ref = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for x in _batches():
        ref.zero_grad()
        sum(single(x[r * 4:(r + 1) * 4]).square().mean() for r in range(WORLD)).div(WORLD).backward()
        ref.step()
    return [p.detach() for p in single.parameters()]


def _on_ranks(module) -> list:
    """In the answer's process: _rank_15 on WORLD ranks."""
    from check_exercise import run_world

    return run_world(WORLD, _rank_15, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """Backward leaves each rank only its own shard's gradients; the weights are one process's;
    the peak of a step is below ZeRO-1's on every rank."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    ranks = answer(path, _on_ranks, limit_s=WORLD_TIMEOUT_S + 30)
    setup = f"{WORLD} ranks, {STEPS} AdamW steps, a tied weight and a frozen layer"
    single = _single()
    worst = max((a - b).abs().max().item() for r in ranks for a, b in zip(r["weights"], single, strict=True))
    if worst > 1e-5:
        raise NotYet(f"{setup}: the weights end {worst:.1e} away from one process (allowed "
                     f"1e-5). Is each gradient the mean over the ranks, and freed only after "
                     f"the reduce-scatter has read it?")
    kept = [r for r, x in enumerate(ranks) if x["kept_after_backward"] or x["foreign"]]
    if kept:
        r = kept[0]
        raise NotYet(f"{setup}: the weights are right, but at the end of backward rank {r} "
                     f"still holds the gradients of {ranks[r]['kept_after_backward']} parameters "
                     f"another rank steps: every rank keeps every gradient, as DDP and ZeRO-1 "
                     f"do. Which of a bucket's gradients does a rank need after the "
                     f"reduce-scatter? (self.shards[dist.get_rank()])")
    if any(x["own_missing"] for x in ranks):
        raise NotYet(f"{setup}: a rank freed a gradient of its own shard too; keep those")
    higher = [r for r, x in enumerate(ranks) if x["peak"] >= x["peak_zero1"]]
    if higher:
        r = higher[0]
        raise NotYet(f"{setup}: the gradients are sharded, but rank {r}'s peak in a step is "
                     f"{ranks[r]['peak']:,} bytes, not below ShardedOptimizer's "
                     f"{ranks[r]['peak_zero1']:,}: does something build a buffer as big as "
                     f"all the gradients?")
    held = sum(x["grad_elements"] for x in ranks)
    peaks = ", ".join(f"{x['peak_zero1']:,} -> {x['peak']:,}" for x in ranks)
    return (f"on {WORLD} ranks backward leaves each rank only its own gradients ({held:,} "
            f"gradient elements in all, each parameter's on one rank, instead of {WORLD} x "
            f"{ranks[0]['elements']:,}); the peak of one step (torch's MemTracker), rank by "
            f"rank, ShardedOptimizer -> yours: {peaks} bytes; weights as one process "
            f"(max diff {worst:.1e})")
