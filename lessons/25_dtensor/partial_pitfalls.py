"""Lesson 25's companion, Step 5: what goes wrong when a Partial tensor's pieces are read as if
each were the tensor, and what DTensor does instead.

    max_and_norm(y, exact, mesh, view, values)   y Partial (rank r holds a summand y_r of y):
                                                 the max and the norm of the pieces against
                                                 DTensor's own, and the same norm when y is
                                                 Shard(0) (where combining the pieces is right)
    clipping(mesh, device, seed, view, values)   clip_grad_norm_ on DTensor gradients (one
                                                 Shard(0), one Partial) against one process, and
                                                 the mistake: each rank clips its own pieces

Why the pieces lie: a Partial tensor is y = y_0 + y_1 + ... + y_{N-1}, the sum still to be done.
max(y_0 + y_1) is not max(max y_0, max y_1), and ||y_0 + y_1||^2 is not ||y_0||^2 + ||y_1||^2
(the cross terms are missing). A Shard(0) tensor's pieces are disjoint rows of y: there the sum
of the squared norms is the squared norm, and only one rank's own norm alone is wrong.

What DTensor does (torch 2.14.1, torch/distributed/tensor/_ops/_math_ops.py,
common_reduction_strategy): a reduction of a Partial input whose reduce op differs from the
Partial's (max of a pending sum, a norm of a pending sum) is not linear, so the input is
redistributed to Replicate first: an all-reduce the lesson counts. The rule comes from
pytorch/pytorch#165962 (a pull request: "By delaying the redistribution, we do the operation
first, and then the partial reduction. This leads to incorrect results for max, min, gradient
norm clipping, and more."). In 2.14.1 it holds for a Partial reduced by another op than its
own: a sum of a pending sum stays Partial. A norm of a Shard(0) input needs no such step: each rank's norm is
a _NormPartial, reduced as a root of a sum of squares.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from redistribution import counted, short

MAX_NORM = 1.0  # clip_grad_norm_'s max_norm: below the gradients' norm, so clipping scales them


def _ran(seen) -> str:
    return "+".join(c.kind for c in seen.calls) or "none"


def max_and_norm(y, exact, mesh, view, values) -> tuple[list[list], dict]:
    """y: a Partial DTensor, exact: the same tensor computed in one process. Rows for the table
    and the numbers for metrics.json."""
    summands = view.pieces(y.to_local())  # rank r's y_r
    with counted() as took_max:
        y_max = y.max()
    with counted() as took_norm:
        y_norm = torch.linalg.vector_norm(y)
    z = y.redistribute(mesh, [Shard(0)])  # the same y, its rows dealt out instead
    rows_of_z = view.pieces(z.to_local())
    with counted() as took_shard_norm:
        z_norm = torch.linalg.vector_norm(z)
    exact_max, exact_norm = exact.max(), torch.linalg.vector_norm(exact)
    values.add("y.max() (Partial)", y_max, exact_max)
    values.add("norm(y) (Partial)", y_norm, exact_norm)
    values.add("norm(y) (Shard(0))", z_norm, exact_norm)
    one_max, one_norm = view.mine(exact_max).item(), view.mine(exact_norm).item()
    pieces_max = max(s.max().item() for s in summands)
    pieces_norm = math.sqrt(sum(s.double().square().sum().item() for s in summands))
    shard_norm = math.sqrt(sum(s.double().square().sum().item() for s in rows_of_z))
    own_norm = rows_of_z[0].double().norm().item()
    numbers = {"max_one_process": one_max, "max_dtensor": view.mine(y_max.full_tensor()).item(),
               "max_of_local_pieces": pieces_max, "norm_one_process": one_norm,
               "norm_dtensor": view.mine(y_norm.full_tensor()).item(),
               "norm_of_local_pieces": pieces_norm, "norm_of_shard_pieces": shard_norm,
               "norm_of_rank_0_shard_alone": own_norm,
               "dtensor_ran": {"max of P(sum)": _ran(took_max), "norm of P(sum)": _ran(took_norm),
                               "norm of S(0)": _ran(took_shard_norm)},
               "dtensor_result": {"max of P(sum)": str(y_max.placements[0]), "norm of P(sum)": str(y_norm.placements[0]),
                                  "norm of S(0)": str(z_norm.placements[0])}}
    shard_dtensor = view.mine(z_norm.full_tensor()).item()
    rows = [["P(sum)", "max", f"{one_max:.4f}", f"{numbers['max_dtensor']:.4f}", _said(pieces_max, one_max)],
            ["P(sum)", "norm", f"{one_norm:.4f}", f"{numbers['norm_dtensor']:.4f}", _said(pieces_norm, one_norm)],
            ["S(0)", "norm", f"{one_norm:.4f}", f"{shard_dtensor:.4f}", _said(shard_norm, one_norm)],
            ["S(0)", "norm of rank 0's piece", f"{one_norm:.4f}", "", _said(own_norm, one_norm)]]
    return rows, numbers


def _said(value: float, truth: float) -> str:
    right = abs(value - truth) <= 1e-4 * max(1.0, abs(truth))
    return f"{value:.4f} ({'right' if right else 'wrong'})"


def _loss(a, v, xb, b):
    """Two parameters: a's gradient comes out sharded like a, b's (a whole vector multiplied by
    a batch split by rows) as a sum over the batch rows each rank holds: Partial."""
    return ((a @ v) ** 2).sum() + ((xb @ b) ** 2).sum()


def clipping(mesh, device, seed: int, view, values) -> tuple[list[list], dict]:
    """clip_grad_norm_ on DTensor gradients, against the same in one process, and the mistake."""
    torch.manual_seed(seed + 1)  # the same inputs on every rank (and on every simulated one)
    a0, v, xb, b0 = (torch.randn(*s, device=device) for s in ((8, 4), (4,), (8, 4), (4,)))
    a = distribute_tensor(a0, mesh, [Shard(0)]).requires_grad_()    # a sharded parameter
    b = distribute_tensor(b0, mesh, [Replicate()]).requires_grad_()  # a whole one
    _loss(a, distribute_tensor(v, mesh, [Replicate()]), distribute_tensor(xb, mesh, [Shard(0)]), b).backward()
    placements = [short(p.grad.placements) for p in (a, b)]
    own = [torch.zeros_like(p.to_local()).requires_grad_() for p in (a, b)]  # plain tensors, as if
    for mine, p in zip(own, (a, b)):                                         # each rank had its own
        mine.grad = p.grad.to_local().clone()                                # pieces as parameters
    # one process: the same parameters whole
    a1, b1 = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    _loss(a1, v, xb, b1).backward()
    one_total = torch.nn.utils.clip_grad_norm_([a1, b1], MAX_NORM)
    # right: torch's clip_grad_norm_ on the DTensor parameters (its norms are DTensor ops)
    with counted() as clipped:
        total = torch.nn.utils.clip_grad_norm_([a, b], MAX_NORM)
    values.add("clip_grad_norm_: a.grad", a.grad, a1.grad)
    values.add("clip_grad_norm_: b.grad", b.grad, b1.grad)
    # the mistake: each rank clips its own pieces, as if they were the gradients
    own_total = torch.nn.utils.clip_grad_norm_(own, MAX_NORM)
    wrong = [DTensor.from_local(g.grad, mesh, p.grad.placements, run_check=False) for g, p in zip(own, (a, b))]
    values.add("each rank clips its pieces: a.grad", wrong[0], a1.grad, mistake=True)
    values.add("each rank clips its pieces: b.grad", wrong[1], b1.grad, mistake=True)
    gap = lambda names: max((values.full[n].double() - values.one_process[n].double()).abs().max().item() for n in names)  # noqa: E731
    right_gap = gap(["clip_grad_norm_: a.grad", "clip_grad_norm_: b.grad"])
    wrong_gap = gap(["each rank clips its pieces: a.grad", "each rank clips its pieces: b.grad"])
    one, mine = view.mine(one_total).item(), view.mine(total.full_tensor()).item()
    per_rank = [t.item() for t in view.pieces(own_total)]
    numbers = {"gradient_placements": placements, "total_norm_one_process": one, "total_norm_dtensor": mine,
               "total_norm_each_rank_alone": per_rank, "clipped_gap_dtensor": right_gap,
               "clipped_gap_each_rank_alone": wrong_gap}
    rows = [["one process", f"{one:.4f}", "-"],
            ["clip_grad_norm_ on the DTensors", f"{mine:.4f}", f"{right_gap:.1e}"],
            ["each rank clips its own pieces", ", ".join(f"{t:.2f}" for t in per_rank), f"{wrong_gap:.4f}"]]
    numbers["dtensor_ran"] = _ran(clipped)
    return rows, numbers
