"""Lesson 17's companion: the plain collectives it passes through its autograd functions, and
the instruments that show what tensor and sequence parallel cost and prove.

The collectives (plain torch.distributed calls; autograd never sees inside them):

    all_reduce(x)       the sum over the ranks, in a new tensor (x may be saved by autograd)
    all_gather(x)       each rank's (B, T/N, D) slice -> the whole (B, T, D), in rank order
    reduce_scatter(x)   each rank's (B, T, D) partial sum -> this rank's (B, T/N, D) of the sum
    split(x)            this rank's (B, T/N, D) slice of a (B, T, D) tensor: no communication

all_gather and reduce_scatter work on dim 1, the sequence; torch's all_gather_single and
reduce_scatter_single join and cut along dim 0, so we move the sequence there and back, and
return contiguous tensors: given a strided view, q, k and v each saved a contiguous copy of it
for backward (measured on 2 ranks: 8.94 MiB saved per rank instead of 7.44).

The instruments:

    recorded(steps, log, logged)    Step 4's steps, those in `logged` inside log.recording()
    report(log, steps, model, ui)   the collectives Step 4 recorded, per training step: by phase
                                    (forward, backward, between backward and step, the optimizer
                                    step) and in one block (apparatus/comm.py counted them);
                                    the bytes of the split weights on this rank
    saved_activations(...)          what one rank saves for backward: one process, tensor
                                    parallel, and tensor + sequence parallel
    sequence_parallel_mistake(...)  LayerNorm gradients, unsummed
    full_state_dict(model)          the whole weights under lesson 13's names, gathered from shards
    show_split(model, ui)           (bytes this rank holds, bytes of the whole) of the split tensors
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from apparatus.comm import SHARE
from apparatus.memory import SavedTensors, mib
from common import transformer as T


# --- the collectives ---------------------------------------------------------------------

def all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(0, 1).contiguous()  # (T/N, B, D): the sequence first
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    dist.all_gather_single(out, x)
    return out.transpose(0, 1).contiguous()


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(0, 1).contiguous()  # (T, B, D)
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_single(out, x)
    return out.transpose(0, 1).contiguous()


def split(x: torch.Tensor) -> torch.Tensor:
    return x.chunk(dist.get_world_size(), 1)[dist.get_rank()].contiguous()  # not a view of all of x


# --- small helpers the lesson calls ---------------------------------------------------------

def variant(args) -> str:
    sp = " + sequence parallel" if args.sequence_parallel else ""
    local = ", use_local_output=True (the mistake)" if getattr(args, "use_local_output", False) else ""
    return ("by hand" if args.impl == "manual" else "DTensor") + sp + local


def recorded(steps, log, logged):
    """Each step of `steps`; those in `logged` run inside log.recording(). CommLog passes every
    op through Python, which slows training (about 1.7x when it records them all); every step
    sends the same, so the steps whose numbers are printed are enough (as in lesson 22)."""
    for step in steps:
        with log.recording() if step in logged else nullcontext():
            yield step


def _is_sequence_parallel(p) -> bool:
    return getattr(p, "sequence_parallel", False)


def _summed_outside(p) -> bool:
    """A gradient summed over the ranks outside forward and backward: by hand, after backward
    (Step 4); DTensor's, left Partial by backward, in AdamW's step (each time it reads it)."""
    return _is_sequence_parallel(p) or any(pl.is_partial() for pl in getattr(p.grad, "placements", ()))


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


def show_split(model, ui) -> tuple[int, int]:
    """split_param_bytes, printed."""
    local, full = split_param_bytes(model)
    ui.print(f"the split weights: {local:,} bytes on this rank of {full:,} (1/{full // local}); "
             f"embeddings, norms, head and row-parallel biases are whole on every rank" if local else
             "one rank: nothing is split, every weight is whole (the collectives still run, on one rank)")
    return local, full


def metrics(counts: dict, saved: dict, mistake: dict) -> dict:
    return {"collectives_per_step": counts["per_step"], "collectives": counts,
            "activations_bytes": saved, "sequence_parallel_mistake": mistake}


# --- counting ------------------------------------------------------------------------------

PHASES = {"forward": "forward", "backward": "backward", "between": "after backward",
          "optimizer": "optimizer step"}  # CommLog's phase -> the row's name


def _block_share(phases: dict, in_block: dict, model) -> None:
    """Add to `in_block` the last block's share of the sums after backward and in AdamW's step:
    they run outside every module, one per summed parameter (or three: AdamW reads a Partial
    gradient three times), each of the same DIM floats; the block's share is its parameters'."""
    summed = [n for n, p in model.named_parameters() if _summed_outside(p)]
    mine = sum(n.startswith(f"blocks.{T.N_BLOCKS - 1}.") for n in summed)
    for p in ("between", "optimizer"):
        if phases.get(p) and summed:
            in_block[p] = {k: v * mine / len(summed) for k, v in phases[p].items()}


def report(log, steps: int, model, ui) -> dict:
    """The collectives a CommLog(modules=True) recorded over `steps` training steps, per step:
    by phase (a table), and those of the last block (the first block also holds the way into
    the sequence split): what its modules issued in forward and backward, and its share of the
    sums after backward and in AdamW's step; printed; then show_split(model). Returns the
    numbers for metrics.json: everything a step sends, DTensor's own collectives included, and
    the last block's calls of one step in order (phase, kind, module, bytes sent: block_collective_pictures.py)."""
    last = f".blocks.{T.N_BLOCKS - 1}"
    block = [c for c in log.calls if any(m.endswith(last) for m in c.modules)]
    phases, in_block = log.tally(lambda c: c.phase, steps), log.tally(lambda c: c.phase, steps, block)
    _block_share(phases, in_block, model)
    step = log.tally(lambda c: "step", steps).get("step", {"data_bytes": 0, "sent_bytes": 0.0})
    kinds = lambda d: {k: v for k, v in d.items() if k in SHARE}  # noqa: E731  {"all_reduce": 2, ...}
    seen = [k for k in SHARE if k in step] or ["all_reduce"]
    rows = [[name, *(f"{phases.get(p, {}).get(k, 0):g}" for k in seen),
             f"{phases.get(p, {}).get('sent_bytes', 0):,.0f}"] for p, name in PHASES.items()]
    rows.append(["the whole step", *(f"{step.get(k, 0):g}" for k in seen), f"{step['sent_bytes']:,.0f}"])
    ui.table(f"Collectives per training step on this rank ({steps} steps recorded)",
             ["phase", *seen, "bytes sent"], rows)
    ui.print(f"of these, blocks.{T.N_BLOCKS - 1} alone: " + "; ".join(
        f"{PHASES[p]}: " + (", ".join(f"{n:g} {k}" for k, n in kinds(in_block.get(p, {})).items()) or "none")
        + f", {in_block.get(p, {}).get('sent_bytes', 0):,.0f} bytes sent" for p in PHASES if p in in_block))
    return {"per_step": kinds(step), "sent_bytes_per_step": step["sent_bytes"],
            "data_bytes_per_step": step["data_bytes"],
            "per_step_by_phase": {p: kinds(phases.get(p, {})) for p in PHASES},
            "sent_bytes_by_phase": {p: phases.get(p, {}).get("sent_bytes", 0.0) for p in PHASES},
            "per_block": {p: kinds(in_block.get(p, {})) for p in PHASES},
            "data_bytes_per_block": {p: in_block.get(p, {}).get("data_bytes", 0) for p in PHASES},
            "sent_bytes_per_block": {p: in_block.get(p, {}).get("sent_bytes", 0.0) for p in PHASES},
            "block_sequence": [[c.phase, c.kind, max(c.modules, key=len).removeprefix("Transformer."), c.sent_bytes]
                            for c in block[:len(block) // steps]],  # one step's, in order: the picture
            "split_param_bytes": show_split(model, ui)}


def saved_activations(split_model, impl: str, rank: int, world: int, args, device, ui) -> dict:
    """Bytes autograd saves for backward on this rank, for one forward of batch 0: lesson 13's
    whole model in one process, then split by `split_model` without and with sequence parallel."""
    x, y = (t.to(device) for t in T.batch(0, args.seed))
    saved = {}
    for name, sp in (("one_process", None), ("tensor_parallel", False), ("sequence_parallel", True)):
        model = T.make_model(args.seed).to(device)
        model = model if sp is None else split_model(model, rank, world, sp)
        with SavedTensors(model) as s:
            T.loss_fn(model(x), y)
        saved[name] = s.bytes
    one, tp, sp = saved.values()
    ui.print(f"saved for backward on this rank, one batch: {mib(one)} in one process (lesson 13); "
             f"{mib(tp)} with tensor parallel ({impl}, {tp / one:.0%}); {mib(sp)} with sequence "
             f"parallel too ({sp / one:.0%})")
    return saved


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
