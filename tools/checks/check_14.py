"""Check exercise 14: gradient all-reduces that start during backward, and torch DDP's weights.

The learner's OverlappedSync wraps a small model with a tied weight (the head shares the
embedding's tensor), a frozen layer and a buffer, on 3 ranks; each rank trains 3
SGD steps on its own batches, recorded by apparatus.comm.CommLog (every dist.all_reduce:
when it started, whether the caller waited for it, and which backward it fell in). The same
steps with torch's DistributedDataParallel give the weights to match.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used: the harness imports this file while it is
# itself being imported (also in every rank it starts), so a top-level import would be circular
STARTER = "exercises/14_overlap_sync.py"
STEPS = 3


def _model():
    import torch
    import torch.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 16)
            self.mid = nn.Linear(16, 16)
            self.frozen = nn.Linear(16, 16)
            self.frozen.requires_grad_(False)     # no gradient: must not be all-reduced
            self.head = nn.Linear(16, 12, bias=False)
            self.head.weight = self.emb.weight    # tied: one tensor, two layers
            self.register_buffer("scale", torch.full((1,), 0.5))

        def forward(self, x):
            return self.head(self.frozen(torch.tanh(self.mid(self.emb(x))))) * self.scale

    torch.manual_seed(0)
    return Tied()


def _train(wrapped, model, rank: int, sync, log=None) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # every rank its own batch
        x, y = torch.randint(0, 12, (6, 5), generator=g), torch.randint(0, 12, (6, 5), generator=g)
        loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        with log.backward() if log else contextlib.nullcontext():
            loss.backward()
        sync()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_14(rank: int, world: int, path: str) -> dict:
    """In the answer's ranks: the learner's OverlappedSync trains; its weights and CommLog's
    record come back (torch DDP's weights are trained by the check, in ranks of its own)."""
    import torch

    from apparatus.comm import CommLog
    from check_exercise import load

    torch.set_num_threads(1)
    module = load(Path(path))
    model = _model()
    sync = module.OverlappedSync(model)
    log = CommLog()
    with log.recording(), log.watching(model):
        ours = _train(model, model, rank, sync.finish_gradient_synchronization, log)
    summary = log.summary(STEPS)
    summary["trainable"] = sum(1 for p in model.parameters() if p.requires_grad)
    summary["frozen_grad"] = model.frozen.weight.grad is not None
    summary["weights"] = ours
    return summary


def _ddp_14(rank: int, world: int) -> dict:
    """The same steps under torch's DistributedDataParallel: the weights to match (no learner
    code runs in these ranks)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    reference = _model()
    ddp = DDP(reference)
    theirs = _train(ddp, reference, rank, lambda: None)
    del ddp
    return theirs


def _on_ranks(module, world: int) -> list:
    """In the answer's process: _rank_14 on `world` ranks."""
    from check_exercise import run_world

    return run_world(world, _rank_14, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """All-reduces start during backward; the weights are torch DDP's (tied and frozen too)."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer, max_diff, run_world

    for world in (3,):  # an odd number of ranks
        ranks = answer(path, _on_ranks, world, limit_s=WORLD_TIMEOUT_S + 30)
        r0 = ranks[0]
        setup = (f"with {world} ranks ({r0['trainable']} trainable tensors: the tied "
                 f"embedding/head weight counts once, the frozen layer not at all)")
        if r0["frozen_grad"]:
            raise NotYet(f"{setup}: the frozen layer ended with a .grad; parameters with "
                         f"requires_grad=False need no gradient and no all-reduce")
        if r0["calls_per_step"] != r0["trainable"]:
            raise NotYet(f"{setup}: {r0['calls_per_step']:g} all-reduces per step; expected one "
                         f"per trainable tensor, {r0['trainable']}. A tied weight is one tensor: "
                         f"is it reduced twice? Is a frozen one reduced at all?")
        if r0["launched_during_backward"] < 0.5:
            raise NotYet(f"{setup}: the right number of all-reduces, but "
                         f"{r0['launched_during_backward']:.0%} of them started while backward "
                         f"was still running: each should start from a hook the moment its "
                         f"gradient is ready (Tensor.register_post_accumulate_grad_hook)")
        if r0["async_fraction"] < 1:
            raise NotYet(f"{setup}: the all-reduces start during backward, but "
                         f"{1 - r0['async_fraction']:.0%} of them block it until they finish; "
                         f"start them with async_op=True and wait in "
                         f"finish_gradient_synchronization()")
        theirs = run_world(world, _ddp_14, (), path)  # torch's DDP, in the check's own ranks
        worst = max(max_diff(r["weights"], t) for r, t in zip(ranks, theirs, strict=True))
        if worst > 1e-5:
            raise NotYet(f"{setup}: the weights end {worst:.1e} away from torch DDP's after "
                         f"{STEPS} steps (allowed: 1e-5). Does finish_gradient_synchronization() "
                         f"wait for every all-reduce, and divide the sums by the world size?")
    return (f"on 3 ranks every all-reduce started during backward without blocking it, "
            f"one per trainable tensor ({r0['trainable']}), and the weights match torch's DDP "
            f"(max diff {worst:.1e})")
