"""Check exercise 17: f and g, the conjugate functions of tensor parallelism.

The learner's parallel_mlp runs a small MLP (width 8, hidden 16) split over 2 and then 4 ranks
on gloo: each rank holds its rows of fc (column-parallel) and the matching columns of proj
(row-parallel). Every rank gets the same input; the output, the input's gradient and each
shard's gradient are compared with one process running the whole MLP, and the collectives of
one forward and one backward are counted (apparatus/comm.py's CommLog, the package's one counter).
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/17_conjugate_functions.py"
WORLDS = (2, 4)  # numbers of ranks, each run in turn in one answer process
WIDTH, HIDDEN = 8, 16


def _whole():
    """The whole MLP and its input (the same on every rank, one seed)."""
    import torch

    g = torch.Generator().manual_seed(0)
    fc_w, fc_b = torch.randn(HIDDEN, WIDTH, generator=g), torch.randn(HIDDEN, generator=g)
    proj_w, proj_b = torch.randn(WIDTH, HIDDEN, generator=g), torch.randn(WIDTH, generator=g)
    x = torch.randn(3, 5, WIDTH, generator=g)
    return x, fc_w, fc_b, proj_w, proj_b


def _rows(rank: int, world: int) -> slice:
    return slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)


def _rank_17(rank: int, world: int, path: str) -> dict:
    """In the answer's ranks: the learner's split MLP on this rank's rows of fc and columns of
    proj; its output and gradients, and the collectives counted (the check computes the
    whole MLP itself)."""
    import torch

    from apparatus.comm import CommLog
    from check_exercise import load

    class Split(torch.nn.Module):  # the learner's function as a module: its calls are "forward"
        def forward(self, *args):
            return module.parallel_mlp(*args)

    module = load(Path(path))
    x, fc_w, fc_b, proj_w, proj_b = _whole()
    rows = _rows(rank, world)
    mine = [t.clone().requires_grad_() for t in (x, fc_w[rows], fc_b[rows], proj_w[:, rows], proj_b)]
    log = CommLog()
    with log.recording():
        ours = Split()(*mine)
        ours.pow(2).sum().backward()
    return {"out": ours.detach(), "grads": [t.grad for t in mine],
            "calls": [(c.phase, c.kind) for c in log.calls]}


def _on_ranks(module, worlds: list) -> dict:
    """In the answer's process: _rank_17 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_17, (module.__file__,), Path(module.__file__))


def _compared(rank: int, world: int, got: dict) -> dict:
    """How far (relative) the rank's output and gradients are from one process's whole MLP."""
    import torch.nn.functional as F

    whole = [t.clone().requires_grad_() for t in _whole()]
    out = F.linear(F.gelu(F.linear(whole[0], whole[1], whole[2])), whole[3], whole[4])
    out.pow(2).sum().backward()
    rows = _rows(rank, world)
    truth = [whole[0].grad, whole[1].grad[rows], whole[2].grad[rows], whole[3].grad[:, rows], whole[4].grad]
    names = ["x", "fc_weight", "fc_bias", "proj_weight", "proj_bias"]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731  (relative)
    return {"out": rel(got["out"], out.detach()),
            "grads": {n: rel(a, b) if a is not None else float("inf")
                      for n, a, b in zip(names, got["grads"], truth, strict=True)}}


def check(path: Path) -> str:
    """Output and every gradient as one process; one all-reduce each way."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    every = answer(path, _on_ranks, WORLDS, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        got = every[world]
        ranks = [_compared(rank, world, r) for rank, r in enumerate(got)]  # here, not in the ranks
        setup = f"with the MLP split over {world} ranks"
        out = max(r["out"] for r in ranks)
        if out > 1e-5:
            raise NotYet(f"{setup}, the output is {out:.1e} (relative) away from one process's: each rank "
                         f"holds only its part of proj's output. Which function must sum the "
                         f"parts over the ranks in forward?")
        worst = {n: max(r["grads"][n] for r in ranks) for n in ranks[0]["grads"]}
        if worst["x"] > 1e-5 and worst["proj_weight"] > 1e-5:  # wrong before f: g sums in backward
            raise NotYet(f"{setup}, the output is right but the gradients of x, fc and proj's weight are "
                         f"off (proj_weight by {worst['proj_weight']:.1e}, relative): the gradient that "
                         f"arrives at g's output is already the same on every rank. Does g sum it "
                         f"again in backward, where it should pass it through unchanged?")
        if worst["x"] > 1e-5:
            raise NotYet(f"{setup}, the output is right but the input's gradient is "
                         f"{worst['x']:.1e} (relative) away: each rank's gradient of x comes from its own "
                         f"rows of fc only. Which function must sum them in backward?")
        bad = [n for n, d in worst.items() if d > 1e-5]
        if bad:
            raise NotYet(f"{setup}, the gradients of {', '.join(bad)} are off (by up to "
                         f"{max(worst[n] for n in bad):.1e}, relative): does a function sum in a direction "
                         f"where it should pass the gradient through unchanged?")
        calls = [tuple(c) for c in got[0]["calls"]]
        expected = [("forward", "all_reduce"), ("backward", "all_reduce")]
        if sorted(calls) != sorted(expected):
            raise NotYet(f"{setup}, the numbers are right, but rank 0 made these collectives: "
                         f"{calls or 'none'}; tensor parallelism needs exactly one all-reduce in "
                         f"forward (g) and one in backward (f)")
    return ("on 2 and 4 ranks the split MLP gives one process's output and gradients, with one "
            "all-reduce in forward (g) and one in backward (f)")
