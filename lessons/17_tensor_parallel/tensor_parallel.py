"""Lesson 17's companion: the plain collectives it passes through its autograd functions, and
the instruments that count what tensor and sequence parallel cost and prove.

The collectives (plain torch.distributed calls; autograd never sees inside them):

    all_reduce(x)       the sum over the ranks, in a new tensor (x may be saved by autograd)
    all_gather(x)       each rank's (B, T/N, D) slice -> the whole (B, T, D), in rank order
    reduce_scatter(x)   each rank's (B, T, D) partial sum -> this rank's (B, T/N, D) of the sum
    split(x)            this rank's (B, T/N, D) slice of a (B, T, D) tensor: no communication

all_gather and reduce_scatter work on dim 1, the sequence; torch's all_gather_single and
reduce_scatter_single join and cut along dim 0, so we move the sequence there and back.

The instruments:

    count_step(split_model, rank, world, args, device, ui)   one training step, counted
    sequence_parallel_mistake(parallelize_by_hand, ...)       LayerNorm gradients, unsummed
    full_state_dict(model)      the whole weights under lesson 13's names, gathered from shards
    split_param_bytes(model)    (bytes this rank holds, bytes of the whole) of the split tensors
    compare_with_13(state, ...) max |w - w_13| beside the floor, printed

How count_step sees the collectives: a TorchDispatchMode sees every op that reaches the
dispatcher, so it sees both kinds the lesson makes: `dist.all_reduce(...)` and friends (the
ops c10d.allreduce_, c10d._allgather_base_, c10d._reduce_scatter_base_), which the by-hand
implementation calls, and the functional collectives DTensor issues
(_c10d_functional.all_reduce, all_gather_into_tensor, reduce_scatter_tensor), which
apparatus/comm.py's CommLog cannot see. torch's own CommDebugMode
(torch.distributed.tensor.debug) counts the same ops but records no bytes.
torch.distributed._tools.mod_tracker.ModTracker says which module is running, in forward and
in backward, so each collective is put in the block that called it.

Bytes: S, the data of a collective (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the input before scattering), and what this rank sends by the ring formulas
of apparatus/comm.py (all-reduce 2(N-1)/N * S, all-gather and reduce-scatter (N-1)/N * S).
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode

from apparatus.comm import RING
from common import transformer as T
from common.cli import fail


# --- the collectives ---------------------------------------------------------------------

def all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(0, 1).contiguous()  # (T/N, B, D): the sequence first
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    dist.all_gather_single(out, x)
    return out.transpose(0, 1)


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(0, 1).contiguous()  # (T, B, D)
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_single(out, x)
    return out.transpose(0, 1)


def split(x: torch.Tensor) -> torch.Tensor:
    return x.chunk(dist.get_world_size(), 1)[dist.get_rank()].contiguous()  # not a view of all of x


# --- small helpers the lesson calls ---------------------------------------------------------

def check_world_size(world: int) -> None:
    """Each rank takes N_HEADS / world heads and SEQ / world tokens: world must divide both."""
    if T.N_HEADS % world or T.SEQ % world:
        fail(f"--world-size {world} does not divide the {T.N_HEADS} attention heads and the "
             f"{T.SEQ} tokens of a sequence: use 1, 2 or 4")


def variant(args) -> str:
    sp = " + sequence parallel" if args.sequence_parallel else ""
    return ("by hand" if args.impl == "manual" else "DTensor") + sp


def _is_sequence_parallel(p) -> bool:
    return getattr(p, "sequence_parallel", False)


def _sync_sequence_parallel(model) -> None:
    """The lesson's Step 4 fix, for the instruments below: sum what each rank's tokens gave."""
    for p in filter(_is_sequence_parallel, model.parameters()):
        dist.all_reduce(p.grad)


def _split_dim(local: torch.Tensor, whole: torch.Tensor) -> int | None:
    """The dim along which `local` is 1/N of `whole` (a by-hand shard), or None (whole)."""
    dims = [d for d in range(whole.dim()) if local.shape[d] != whole.shape[d]]
    return dims[0] if dims else None


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Lesson 13's parameter names and whole tensors, on the CPU, on every rank. A DTensor
    gives its whole tensor with full_tensor() (an all-gather); a by-hand shard is gathered
    with dist.all_gather and joined along the dim it was cut on (found from the shapes)."""
    shapes = {k: v for k, v in T.make_model().state_dict().items()}  # whole shapes
    state = {}
    for name, p in model.named_parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        elif (dim := _split_dim(p, shapes[name])) is not None:
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.contiguous())
            p = torch.cat(parts, dim)
        state[name] = p.cpu().clone()
    return state


def split_param_bytes(model) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole tensors), over the parameters split across
    the ranks: DTensors with a Shard placement, and by-hand shards (smaller than lesson 13's)."""
    shapes = {k: v for k, v in T.make_model().state_dict().items()}
    local = full = 0
    for name, p in model.named_parameters():
        if hasattr(p, "to_local"):
            if any(pl.is_shard() for pl in p.placements):
                local += p.to_local().numel() * p.element_size()
                full += p.numel() * p.element_size()
        elif _split_dim(p, shapes[name]) is not None:
            local += p.numel() * p.element_size()
            full += shapes[name].numel() * p.element_size()
    return local, full


def compare_with_13(state, seed: int, steps: int, world: int, ui) -> tuple[float, float]:
    """max |w - w_13| and the floor (lesson 13 summing its batch in `world` chunks), printed."""
    from apparatus.results import max_abs_diff
    reference, chunked = (T.train_reference(seed, steps, chunks=c)["state"] for c in (1, world))
    diff, floor = max_abs_diff(state, reference), max_abs_diff(chunked, reference)
    ui.print(f"max |w - w_13| = [bold]{diff:.1e}[/bold] (floor {floor:.1e})")
    return diff, floor


def metrics(counts: dict, mistake: dict, diff: float, floor: float) -> dict:
    return {"collectives_per_step": counts["per_step"], "collectives": counts,
            "sequence_parallel_mistake": mistake, "max_abs_diff_floor": floor,
            "max_abs_diff_vs_single_device": diff}


# --- counting ------------------------------------------------------------------------------

# dispatcher op name -> (kind, how to read S from the op's arguments)
OPS = {
    "c10d.allreduce_": ("all_reduce", lambda a: a[0][0]),
    "c10d._allgather_base_": ("all_gather", lambda a: a[0]),
    "c10d._reduce_scatter_base_": ("reduce_scatter", lambda a: a[1]),
    "_c10d_functional.all_reduce": ("all_reduce", lambda a: a[0]),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", lambda a: a[0]),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", lambda a: a[0]),
}
SHARE = {"all_reduce": RING["all_reduce"][1], "all_gather": RING["all_gather_into_tensor"][1],
         "reduce_scatter": RING["reduce_scatter_tensor"][1]}
BLOCK = re.compile(r"\.blocks\.(\d+)$")


class CountCollectives(TorchDispatchMode):
    """Inside: every collective, as (phase, block index or None, kind, data bytes S)."""

    def __init__(self, tracker: ModTracker, group_size: int, phase: str | None = None):
        super().__init__()
        self.tracker, self.n, self.phase, self.calls = tracker, group_size, phase, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func._overloadpacket)
        if name in OPS:
            kind, data = OPS[name]
            t = data(args)
            size = t.numel() * t.element_size()
            if kind == "all_gather" and name.startswith("_c10d"):
                size *= self.n  # the functional op is given the input; S is the output
            blocks = [int(m[1]) for p in self.tracker.parents if (m := BLOCK.search(p))]
            phase = self.phase or ("backward" if self.tracker.is_bw else "forward")
            self.calls.append((phase, max(blocks) if blocks else None, kind, size))
        return out


def count_step(split_model, rank: int, world: int, args, device, ui) -> dict:
    """One training step (forward, backward, the by-hand sequence-parallel gradient sum) of a
    fresh model split by `split_model`, on batch 0, every collective recorded. Prints and
    returns, per block (the last block: the first one also holds the way into the sequence
    split) and per phase, the calls by kind and the bytes; per step, all calls by kind."""
    model = split_model(T.make_model(args.seed).to(device), rank, world, args.sequence_parallel)
    x, y = (t.to(device) for t in T.batch(0, args.seed))
    with ModTracker() as tracker, CountCollectives(tracker, world) as counter:
        T.loss_fn(model(x), y).backward()
    with ModTracker() as tracker, CountCollectives(tracker, world, "after backward") as later:
        _sync_sequence_parallel(model)
    calls = counter.calls + later.calls
    last = len(model.blocks) - 1
    out: dict = {"per_block": {}, "data_bytes_per_block": {}, "sent_bytes_per_block": {}}
    for phase in ("forward", "backward"):
        mine = [(k, s) for p, b, k, s in calls if p == phase and b == last]
        out["per_block"][phase] = dict(sorted(_count(k for k, _ in mine).items()))
        out["data_bytes_per_block"][phase] = sum(s for _, s in mine)
        out["sent_bytes_per_block"][phase] = sum(SHARE[k](world) * s for k, s in mine)
    out["per_step"] = dict(sorted(_count(k for _, _, k, _ in calls).items()))
    out["per_step_by_phase"] = {p: dict(_count(k for q, _, k, _ in calls if q == p))
                                for p in ("forward", "backward", "after backward")}
    out["split_param_bytes"] = split_param_bytes(model)
    for phase in ("forward", "backward"):
        kinds = ", ".join(f"{n} {k}" for k, n in out["per_block"][phase].items()) or "none"
        ui.print(f"per block, {phase:<8}: {kinds}; {out['data_bytes_per_block'][phase]:,} bytes "
                 f"of data, {out['sent_bytes_per_block'][phase]:,.0f} sent by this rank")
    ui.print("per step, all blocks and the rest: " + "; ".join(
        f"{p}: " + (", ".join(f"{n} {k}" for k, n in sorted(v.items())) or "none")
        for p, v in out["per_step_by_phase"].items()))
    local, full = out["split_param_bytes"]
    ui.print(f"the split weights: {local:,} bytes on this rank of {full:,} (1/{full // local}); "
             f"embeddings, norms, head and row-parallel biases are whole on every rank" if local else
             "one rank: nothing is split, every weight is whole (the collectives still run, on one rank)")
    return out


def _count(kinds) -> dict:
    total: dict = defaultdict(int)
    for kind in kinds:
        total[kind] += 1
    return total


def sequence_parallel_mistake(parallelize_by_hand, rank: int, world: int, args, device, ui) -> dict:
    """Sequence parallel by hand, one backward on batch 0, with and without summing over the
    ranks the gradients of the parameters that are whole on every rank inside the
    sequence-parallel region (LayerNorms, row-parallel biases). For block 0's norm1.weight:
    |g| / |g_one_process| and max |g - g_one_process| on this rank, both ways; printed."""
    x, y = (t.to(device) for t in T.batch(0, args.seed))
    reference = T.make_model(args.seed).to(device)
    T.loss_fn(reference(x), y).backward()
    truth = reference.blocks[0].norm1.weight.grad
    result = {}
    for fixed in (False, True):
        model = parallelize_by_hand(T.make_model(args.seed).to(device), rank, world, True)
        T.loss_fn(model(x), y).backward()
        if fixed:
            _sync_sequence_parallel(model)
        g = model.blocks[0].norm1.weight.grad
        result["fixed" if fixed else "mistake"] = {
            "ratio": (g.norm() / truth.norm()).item(), "max_abs_diff": (g - truth).abs().max().item()}
    # The same mistake in its other form: each rank's loss on its own tokens only (the sum
    # over the ranks is kept): unless each loss is divided by N, the gradients are N times too big
    mine = slice(rank * T.SEQ // world, (rank + 1) * T.SEQ // world)
    for scaled in (False, True):
        model = parallelize_by_hand(T.make_model(args.seed).to(device), rank, world, True)
        loss = T.loss_fn(model(x)[:, mine], y[:, mine])
        (loss / world if scaled else loss).backward()
        _sync_sequence_parallel(model)
        g = model.blocks[0].norm1.weight.grad
        result["local_loss_scaled" if scaled else "local_loss_unscaled"] = {
            "ratio": (g.norm() / truth.norm()).item(), "max_abs_diff": (g - truth).abs().max().item()}
    ratios = [None] * world
    dist.all_gather_object(ratios, result["mistake"]["ratio"])
    result["mistake_ratio_by_rank"] = ratios
    m, f = result["mistake"], result["fixed"]
    ui.print(f"blocks.0.norm1.weight.grad vs one process, by rank: "
             f"{', '.join(f'{r:.3f}x' for r in ratios)} without the sum over the ranks "
             f"(max |diff| {m['max_abs_diff']:.1e} on rank 0); {f['ratio']:.3f}x with it "
             f"(max |diff| {f['max_abs_diff']:.1e})")
    ui.print(f"each rank's loss on its own {T.SEQ // world} tokens, summed over the ranks: "
             f"{result['local_loss_unscaled']['ratio']:.3f}x (world size {world}); each loss "
             f"divided by {world}: {result['local_loss_scaled']['ratio']:.3f}x")
    return result
