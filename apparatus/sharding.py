"""What each rank holds and sends under DDP, ZeRO-1 and FSDP2: lessons 15, 16 and 19 measure it.

* held_bytes(model, optimizer): bytes of parameters, gradients and optimizer state that this
  rank holds, read from the storages of its local tensors (a DTensor's local shard), each
  storage once. FSDP2 pads every dim-0 shard to ceil(rows / N) rows (torch 2.14.1,
  fsdp/_fully_shard/_fsdp_param.py: `padded_sharded_param_size = chunks[0].size()`) and
  keeps the padded storage, so the padding is counted: that is memory the rank really holds.
* formula_bytes(strategy, shapes, world, rank, owned): the same three numbers from the
  shapes alone: what the ZeRO paper's formulas say, padding included.
* comm_formula(strategy, shapes, world, owned_max, reshard): bytes one rank sends per step,
  by the ring formulas lesson 10 derives (apparatus/comm.py counts the real calls).
* shard_rows(model): one row per parameter: global shape, placements, local shape, bytes.
"""
from __future__ import annotations

import math

import torch

from common import transformer as T

KEYS = ("parameters", "gradients", "optimizer_state")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def inner_optimizer(optimizer):
    """The optimizer that holds the state: ZeroRedundancyOptimizer and the lesson's
    ShardedOptimizer keep a local one in `.optim` that sees only this rank's parameters."""
    return getattr(optimizer, "optim", optimizer)


def owned_numel(optimizer) -> int:
    """Elements of the parameters this rank's optimizer steps."""
    return sum(_local(p).numel() for g in inner_optimizer(optimizer).param_groups for p in g["params"])


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state"}: bytes this rank holds, padding included.
    As apparatus/memory.py does, AdamW's one-number `step` counters are left out.

    FSDP2 modules are resharded first: a forward without a backward (an evaluation) leaves
    the root's parameters gathered (and every block's under reshard_after_forward=False), and
    model.parameters() would then be the full, unsharded tensors."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):  # an FSDPModule
            module.reshard()
    params = list(model.parameters())
    state = [t for s in inner_optimizer(optimizer).state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": storage_bytes(state)}


def _rows(shape) -> tuple[int, int]:
    """(rows, elements per row) of a tensor of this shape; FSDP2 shards dim 0."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def fsdp_local_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(rows rank holds, rows every rank stores): torch.chunk gives ceil(rows / N) rows to
    each rank until they run out; FSDP2 pads every shard to that size."""
    padded = -(-rows // world)
    return max(0, min(padded, rows - rank * padded)), padded


def formula_bytes(strategy: str, shapes: dict, world: int, rank: int, owned: int,
                  element: int = 4) -> dict[str, int]:
    """What rank `rank` should hold, fp32 AdamW (4 + 4 + 8 bytes per parameter held).

    ddp: everything, everywhere. zero1: everything but the optimizer state, which covers
    only the `owned` elements this rank steps. fsdp: the padded dim-0 shard of every
    parameter and of its gradient; the optimizer state of the unpadded shard.
    """
    total = sum(math.prod(s) for s in shapes.values())
    if strategy == "ddp":
        return dict(zip(KEYS, (element * total, element * total, 2 * element * total)))
    if strategy.startswith("zero1"):
        return dict(zip(KEYS, (element * total, element * total, 2 * element * owned)))
    padded = local = 0
    for shape in shapes.values():
        rows, per_row = _rows(shape)
        mine, each = fsdp_local_rows(rows, world, rank)
        padded += each * per_row
        local += mine * per_row
    return dict(zip(KEYS, (element * padded, element * padded, 2 * element * local)))


def comm_formula(strategy: str, shapes: dict, world: int, owned_max: int, reshard: bool,
                 element: int = 4) -> float:
    """Bytes one rank sends per step, counted as lesson 10 counts a ring.

    ddp:         all-reduce the gradients: 2(N-1)/N * P
    zero1:       reduce-scatter the gradients, all-gather the parameters, each of N shards
                 padded to the biggest (owned_max): 2 * (N-1)/N * N * owned_max
    zero1-torch: DDP's all-reduce, then each parameter broadcast by its owner: 3(N-1)/N * P
    fsdp:        per FSDP group (the root, each block): all-gather in forward, again in
                 backward when resharded after forward, reduce-scatter in backward:
                 (N-1)/N each, of the padded group.
    """
    n = world
    if n == 1:
        return 0.0
    share = (n - 1) / n
    total = element * sum(math.prod(s) for s in shapes.values())
    if strategy == "ddp":
        return 2 * share * total
    if strategy == "zero1":
        return 2 * share * n * owned_max * element
    if strategy == "zero1-torch":
        return 3 * share * total
    groups: dict[str, int] = {}  # the root (""), each block
    for name, shape in shapes.items():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        rows, per_row = _rows(shape)
        groups[group] = groups.get(group, 0) + element * n * fsdp_local_rows(rows, n, 0)[1] * per_row
    sent = 0.0
    for group, size in groups.items():
        gathers = 2 if reshard else 1
        sent += share * size * (gathers + 1)
    return sent


def shard_rows(model: torch.nn.Module, limit: int | None = None) -> list[list]:
    """[name, global shape, placements, local shape, bytes stored] per parameter."""
    rows = []
    for name, p in list(model.named_parameters())[:limit]:
        placements = ", ".join(str(pl) for pl in getattr(p, "placements", ())) or "plain tensor"
        local = _local(p)
        rows.append([name, tuple(p.shape), placements, tuple(local.shape),
                     f"{local.untyped_storage().nbytes():,}"])
    return rows


# --- the tables lessons 15, 16 and 19 print ----------------------------------------------

def show_shards(ui, model, limit: int = 5) -> None:
    """Rank 0's first DTensor shards after fully_shard."""
    ui.table("rank 0's first shards", ["parameter", "global shape", "placements",
                                       "local shape", "bytes stored"], shard_rows(model, limit))


def recipe_shapes() -> dict:
    """{name: shape} of the Part 2 transformer's parameters, unsharded."""
    return {name: tuple(p.shape) for name, p in T.make_model().named_parameters()}


def report_bytes(ui, model, optimizer, strategy: str) -> dict:
    """Every rank's held_bytes beside formula_bytes, gathered to rank 0 and printed."""
    import torch.distributed as dist

    shapes = recipe_shapes()
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = (held_bytes(model, optimizer),
            formula_bytes(strategy, shapes, world, rank, owned_numel(optimizer)))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    one_device = 16 * sum(math.prod(s) for s in shapes.values())
    ui.table(f"Bytes each rank holds, measured / formula ({strategy} on {world}; one device: "
             f"{one_device:,})", ["rank", "parameters", "gradients", "optimizer state", "total"],
             [[r] + [f"{h[k]:,} / {f[k]:,}" for k in KEYS]
              + [f"{sum(h.values()):,} / {sum(f.values()):,}"] for r, (h, f) in enumerate(everyone)])
    return {"per_rank_bytes": mine[0],
            "per_rank_bytes_all": [{"measured": h, "formula": f} for h, f in everyone]}
