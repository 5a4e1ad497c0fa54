"""Lesson 25's companion: what one redistribution runs, what torch's source says it should run,
and what each rank's piece of a tensor is.

    counted()                    a block run under CommLog and torch's CommDebugMode at once
    planned(src, dst, mesh_shape)
                                 torch's plan for a redistribution: one step per mesh dimension
                                 that changes, each with its collective (the greedy planner of
                                 torch/distributed/tensor/_redistribute.py, transcribed)
    formula_bytes(steps, shape, mesh_shape)
                                 what one rank sends for that plan, by lesson 10's ring shares
    move_row(...)                one row of metrics.json's redistributions; table_row: as Step 3
                                 prints it; lowered: a line where gloo ran another collective
    uneven(X[:7], mesh, ...)     7 rows gathered from 4 ranks: the padding, measured
    held(piece, X, parts)        what a rank's piece of X is, as the slice of X it equals
                                 ("X[2:4]", "X[:, 0:2]", "X / 4")

Names: "S(0)" is Shard(0), "R" Replicate(), "P(sum)" Partial() (a pending sum): DTensor's own
short names (str(Shard(0)) is "S(0)"), so a placement prints as torch prints it.

Checked on torch 2.14.1 against its source, and measured by the lesson on gloo:
* which collective: _TransformInfo._comm_type_key in _redistribute.py: Partial -> Replicate
  all-reduce, Partial -> Shard reduce-scatter, Shard -> Replicate all-gather, Shard -> Shard
  all-to-all; Replicate -> Shard takes this rank's chunk (Shard._replicate_to_shard) and
  Shard -> Partial puts the piece in zeros (Shard._to_partial_tensor): no communication.
* the order on a mesh of 2 or more dimensions: generate_greedy_transform_infos. When the source
  is sharded, first from the last mesh dimension to the first, where a dimension whose target
  is Shard(d) while an earlier mesh dimension shards tensor dimension d differently goes to
  Replicate (an all-gather) first; then from the first to the last, whatever is still to do.
* on the CPU, all-to-all is an all-gather and a chunk: placement_types.py's Shard._to_new_shard_dim
  calls _collective_utils.shard_dim_alltoall, which for a mesh of device type "cpu" (outside
  LocalTensorMode) all-gathers and keeps its chunk, and says so in a warning ("CPU process group
  does not support alltoall yet, falling back with allgather + chunk!").
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode

from apparatus.comm import SHARE, CommLog

# The warning shard_dim_alltoall logs once per rank on the CPU, through torch's logging: the
# lesson says it in a line of its own (Step 3), once.
logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)


@contextmanager
def counted():
    """Everything the block sends, seen by two counters: CommLog (apparatus/comm.py, the package's
    one counter: kind, group size, bytes) and torch's CommDebugMode (its counts by op). After the
    block: .calls (CommLog's Collective records) and .torch (CommDebugMode's {op name: count})."""
    seen = SimpleNamespace(calls=[], torch={})
    log, torch_counter = CommLog(), CommDebugMode()
    with log.recording(), torch_counter:
        yield seen
    seen.calls = log.calls
    seen.torch = {str(op).rsplit(".", 1)[-1]: n for op, n in torch_counter.get_comm_counts().items()}


def kind(src, dst) -> str:
    """The collective one mesh dimension needs to go from placement src to dst (torch's
    _TransformInfo._comm_type_key; "none" where each rank computes its piece alone)."""
    if src == dst:
        return "none"
    if src.is_partial():
        return "all_reduce" if dst.is_replicate() else "reduce_scatter" if dst.is_shard() else "none"
    if src.is_shard():
        return "all_gather" if dst.is_replicate() else "all_to_all" if dst.is_shard() else "none"
    return "none"  # Replicate -> Shard: keep our chunk; Replicate -> Partial: refused (Step 3)


def local_shape(shape, placements, mesh_shape, skip: int | None = None) -> list[int]:
    """The shape of one rank's piece (even splits only), leaving mesh dimension `skip` out."""
    out = list(shape)
    for i, p in enumerate(placements):
        if i != skip and p.is_shard():
            assert out[p.dim] % mesh_shape[i] == 0, "the lesson's formulas assume even splits"
            out[p.dim] //= mesh_shape[i]
    return out


def planned(src, dst, mesh_shape) -> list[tuple[int, str, object, object]]:
    """torch's plan, step by step: (mesh dim, collective, placement before, after). For a 1-D
    mesh one step (or none); for more, generate_greedy_transform_infos's two passes."""
    current, steps = list(src), []

    def step(i, target):
        steps.append((i, kind(current[i], target), current[i], target))
        current[i] = target

    if any(p.is_shard() for p in src) and len(mesh_shape) > 1:
        for i in reversed(range(len(src))):  # last mesh dimension first
            target = dst[i]
            if target.is_shard():  # nested sharding: earlier mesh dims must shard its dim alike
                before = [j for j in range(i) if current[j].is_shard(target.dim)]
                if before != [j for j in range(i) if dst[j].is_shard(target.dim)]:
                    target = Replicate()
            if current[i] != target:
                step(i, target)
    for i in range(len(src)):  # then first to last
        if current[i] != dst[i]:
            step(i, dst[i])
    return steps


def formula_bytes(steps, shape, src, mesh_shape, element: int = 4, cpu: bool = False) -> float:
    """Bytes one rank sends for the plan `steps` (lesson 10's ring shares, apparatus/comm.py's
    SHARE), each collective's S from the placements at that point: the tensor as mesh dim i's
    group sees it (every other mesh dimension's split applied) is what an all-gather outputs, a
    reduce-scatter takes and an all-reduce sums; an all-to-all sends (N-1)/N of this rank's
    piece. cpu=True: an all-to-all is the all-gather gloo runs instead (of the whole S)."""
    placements, total = list(src), 0.0
    for i, collective, _, target in steps:
        n = mesh_shape[i]
        s = element * math.prod(local_shape(shape, placements, mesh_shape, skip=i))
        if collective == "all_to_all":
            total += SHARE["all_gather"](n) * s if cpu else SHARE["all_to_all"](n) * s / n
        elif collective != "none":
            total += SHARE[collective](n) * s
        placements[i] = target
    return total


def short(placements) -> str:
    """(Shard(0), Replicate()) -> "S(0),R": DTensor's own short names (str(Partial()) is "P(sum)")."""
    return ",".join(str(p) for p in placements)


def move_row(src, dst, mesh_shape, shape, seen, device_type: str, refused: str | None = None) -> dict:
    """One redistribution: torch's plan beside what ran (CommLog, CommDebugMode) and the bytes."""
    steps = planned(src, dst, mesh_shape)
    ran = [c.kind for c in seen.calls]
    row = {"from": short(src), "to": short(dst), "mesh": list(mesh_shape),
           "planned": [k for _, k, _, _ in steps if k != "none"] or ["none"],
           "collective": "refused" if refused else "+".join(ran) or "none",
           "group_sizes": [c.group_size for c in seen.calls],
           "comm_debug_mode": seen.torch,
           "bytes": sum(c.sent_bytes for c in seen.calls),
           "formula_bytes": 0.0 if refused else formula_bytes(steps, shape, src, mesh_shape),
           "refused": refused}
    if device_type == "cpu" and not refused:  # gloo: an all-gather where torch plans an all-to-all
        row["formula_bytes_as_gloo_runs_it"] = formula_bytes(steps, shape, src, mesh_shape, cpu=True)
    return row


def held(piece: torch.Tensor, X: torch.Tensor, parts: int = 1) -> str:
    """What one rank's piece of X is, as the slice of X it equals ("X[2:4]", "X[:, 0:2]", "X / 4").
    X holds 0, 1, 2, ... so each value names its cell; `parts`: how many ranks hold a share of a
    pending sum (Partial), each X / parts (distribute_tensor divides)."""
    cells = piece.double().cpu() * parts
    if cells.numel() == 0:
        return "nothing"
    first, last = int(cells.min().item()), int(cells.max().item())
    cols = X.shape[1]
    r0, r1, c0, c1 = first // cols, last // cols + 1, first % cols, last % cols + 1
    block = X[r0:r1, c0:c1].double().cpu()
    if block.shape != cells.shape or not torch.equal(block, cells):
        return "other values"
    rows = "" if (r0, r1) == (0, X.shape[0]) else f"{r0}:{r1}"
    where = ("X" if block.shape == X.shape else f"X[{rows}]" if (c0, c1) == (0, cols) else
             f"X[{rows or ':'}, {c0}:{c1}]")
    return where if parts == 1 else f"{where} / {parts}"


MOVE_COLUMNS = ["from -> to", "torch plans", "ran", "bytes sent", "formula"]


def table_row(row: dict) -> list:
    """Step 3's table: one redistribution, as rank 0 saw it (two placements: the 2-D mesh)."""
    if row["refused"]:
        return [f"{row['from']} -> {row['to']}", "-", "refused", "-", "-"]
    formula = f"{row['formula_bytes']:,.0f}"
    as_run = row.get("formula_bytes_as_gloo_runs_it", row["formula_bytes"])
    if as_run != row["formula_bytes"]:
        formula += f"; {as_run:,.0f} as run"
    return [f"{row['from']} -> {row['to']}", ", ".join(row["planned"]), row["collective"].replace("+", ", "),
            f"{row['bytes']:,.0f}", formula]


def lowered(rows: list[dict]) -> list[str]:
    """A line for each redistribution where torch planned an all-to-all and another collective ran."""
    out = []
    for row in rows:
        if "all_to_all" in row["planned"] and "all_to_all" not in row["collective"] and not row["refused"]:
            out.append(f"{row['from']} -> {row['to']}: torch plans {'+'.join(row['planned'])}; this CPU mesh ran "
                       f"{row['collective']} and kept its chunk (shard_dim_alltoall), {row['bytes']:,.0f} bytes "
                       f"sent where an all-to-all sends {row['formula_bytes']:,.0f}")
    return out


def uneven(seven: torch.Tensor, mesh, view, values, ui) -> dict:
    """7 rows as Shard(0), then gathered: the pieces are padded to one size first (Step 3)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    n = mesh.size()
    d = distribute_tensor(seven, mesh, [Shard(0)])
    rows_held = [piece.shape[0] for piece in view.pieces(d.to_local())]
    with counted() as ran:
        whole = d.redistribute(mesh, [Replicate()])
    values.add("X[:7] S(0) -> R on 1-D", whole, seven)
    gathered, size = sum(c.data_bytes for c in ran.calls), seven.numel() * seven.element_size()
    rows = math.ceil(seven.shape[0] / n)
    if n > 1:
        ui.print(f"X[:7] (7 rows) as S(0) on {n} ranks: they hold {rows_held} rows; S(0) -> R all-gathered "
                 f"{gathered:,} bytes, not X[:7]'s {size:,}: each piece padded to ceil(7/{n}) = {rows} rows first")
    return {"rows_held": rows_held, "gathered_bytes": gathered, "tensor_bytes": size, "padded_rows": rows * n}
