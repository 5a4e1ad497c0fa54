"""Lesson 21's instruments: what the ring computes, does and costs, printed beside formulas.

    show_layouts(rings, world, ui)              Step 2: the chunks, and the positions each rank holds
    check_against_sdpa(rings, seed, device, ui) Step 3: ring attention and its gradients
                                                against F.scaled_dot_product_attention on the
                                                whole sequence in one process (max abs diff)
    show_work(rings, world, ui)                 Step 4: tiles of scores each rank computed
    show_bytes(ring, sent, steps, world, ui)    Step 8: bytes sent per layer and step beside
                                                the formulas
    saved_activation_bytes(model, forward, x, y)  what one training forward saves for backward
    show_activations(model, forward, ring, ...) Step 8: those bytes on every rank against lesson
                                                13's whole batch in one process; the scores
    each_rank(value)                            [value of rank 0, of rank 1, ...] on every rank
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apparatus.memory import SavedTensors
from common import transformer as T
from ring_attention import RingAttention, spans


def each_rank(value) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def gather(t: torch.Tensor, ring) -> torch.Tensor:
    """Every rank's tokens of t (dim 2) put back in their places: the whole sequence, on every
    rank (a check, not part of the ring: dist.all_gather, then each part to its positions)."""
    parts = [torch.empty_like(t) for _ in range(ring.world)]
    dist.all_gather(parts, t.contiguous())
    whole = t.new_empty((*t.shape[:2], sum(len(p) for p in ring.positions), *t.shape[3:]))
    for part, pos in zip(parts, ring.positions):
        whole[:, :, pos.to(t.device)] = part
    return whole


def show_layouts(rings: dict, world: int, ui) -> None:
    size = T.SEQ // (2 * world)
    ui.print(f"{2 * world} chunks of {size} tokens per sequence: each rank holds {T.GLOBAL_BATCH} rows "
             f"x {2 * size} tokens of the inputs and of the targets")
    ui.table("Positions in the sequence each rank holds", ["rank", *rings],
             [[r, *(spans(ring.positions[r]) for ring in rings.values())] for r in range(world)])


def check_against_sdpa(rings: dict, seed: int, device, ui, batch: int = 4) -> dict:
    """metrics.json's attention_max_abs_diff (the output) and attention_grad_max_abs_diff (dq,
    dk, dv), the worst of both layouts, and attention_diffs: {layout: [max |out - sdpa|,
    max |dq - sdpa's|, max |dk - ...|, max |dv - ...|]}.

    The same random q, k, v and output gradient on every rank (one seed), each of shape
    (batch, heads, SEQ, HEAD_DIM); one process's answer is F.scaled_dot_product_attention on
    the whole sequence, is_causal=True. Each rank keeps its tokens, runs the ring forward and
    backward; the pieces, gathered back into place, are compared with that answer."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, T.N_HEADS, T.SEQ, T.HEAD_DIM, generator=g).to(device)
                     for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected.backward(dout)
    expected = [expected.detach()] + [t.grad for t in whole]
    diffs = {}
    for layout, ring in rings.items():
        mine = [t[:, :, ring.mine].clone().requires_grad_() for t in (q, k, v)]
        out = RingAttention.apply(*mine, ring)
        out.backward(dout[:, :, ring.mine])
        got = [gather(t, ring) for t in (out.detach(), *(t.grad for t in mine))]
        diffs[layout] = [(a - b).abs().max().item() for a, b in zip(got, expected)]
        ui.print(f"{layout:>10}: max |out - sdpa| = {diffs[layout][0]:.1e}; max |grad - sdpa's| "
                 f"for q, k, v = {', '.join(f'{d:.1e}' for d in diffs[layout][1:])}")
    return {"attention_max_abs_diff": max(d[0] for d in diffs.values()),
            "attention_grad_max_abs_diff": max(max(d[1:]) for d in diffs.values()), "attention_diffs": diffs}


def show_work(rings: dict, world: int, ui) -> dict:
    """{layout: [tiles rank 0 computed, rank 1, ...]} in the forward of check_against_sdpa,
    a table beside the formulas, and each layout's busiest rank against its idlest."""
    work = {layout: each_rank(ring.tiles) for layout, ring in rings.items()}
    ui.table("Tiles of scores each rank computed in one forward",
             ["rank", "contiguous", "formula 4r+3", "balanced", "formula 2N+1"],
             [[r, work["contiguous"][r], 4 * r + 3, work["balanced"][r], 2 * world + 1]
              for r in range(world)])
    for layout, tiles in work.items():
        ui.print(f"{layout:>10}: {sum(tiles)} tiles in all; the busiest rank computes "
                 f"{max(tiles) / min(tiles):.2f}x as many as the idlest")
    return work


def show_bytes(ring, sent: dict, steps: int, world: int, ui) -> dict:
    """What one rank sent per layer and training step (measured: the ring's own count of
    every isend), beside the formulas. Returns the numbers for metrics.json."""
    block = T.GLOBAL_BATCH * (T.SEQ // world) * T.DIM * 4  # our keys (or values), all heads
    formula = {"forward": (world - 1) * 2 * block,
               "backward": (world - 1) * 2 * block + (world - 1) * 2 * block}
    per_layer = {phase: each_rank(b / (steps * T.N_BLOCKS)) for phase, b in sent.items()}
    what = {"forward": "(N-1) x (K + V)", "backward": "(N-1) x (K + V + dK + dV)"}
    shown = lambda b: f"{b[0]:,.0f} on every rank" if len(set(b)) == 1 else ", ".join(f"{x:,.0f}" for x in b)  # noqa: E731
    ui.table(f"Bytes each rank sends per layer and step (K or V of our tokens: {block:,} bytes)",
             ["pass", "measured", "formula", "what travels, per rank"],
             [[phase, shown(per_layer[phase]), f"{formula[phase]:,}", what[phase]] for phase in formula])
    return {"bytes_sent_per_step": {p: [b * T.N_BLOCKS for b in per_layer[p]] for p in formula},
            "bytes_sent_per_step_formula": {p: b * T.N_BLOCKS for p, b in formula.items()},
            "bytes_sent_per_layer": per_layer, "bytes_sent_per_layer_formula": formula}


def saved_activation_bytes(model, forward, x, y) -> int:
    """The bytes autograd keeps for backward in one training forward of `forward` (loss
    included), measured as lesson 13's Step 7 measures them: apparatus/memory.py's
    SavedTensors, each storage once, the weights left out."""
    with SavedTensors(model) as saved:
        T.loss_fn(forward(x), y)
    return saved.bytes


def show_activations(model, forward, ring, seed: int, device, ui) -> dict:
    """What context parallel buys: each rank saves for backward only its tokens' activations,
    in every layer (its K and V among them). Batch 0 through the ring on every rank (a
    collective: every rank calls it), against lesson 13's model on the whole batch in one
    process; then the scores, which tiling already keeps small in one process."""
    x, y = T.batch(0, seed)
    mine = saved_activation_bytes(model, forward, x[:, ring.mine].to(device), y[:, ring.mine].to(device))
    lesson_13 = T.make_model(seed).to(device)  # SDPA, the whole sequence, one process
    whole = saved_activation_bytes(lesson_13, lesson_13, x.to(device), y.to(device))
    every = each_rank(mine)
    ui.table("Saved for backward by one training forward (batch 0; SavedTensors, as lesson 13's Step 7)",
             ["who", "bytes", "of lesson 13's"],
             [["lesson 13, one process", f"{whole:,}", "1"]]
             + [[f"rank {r}", f"{b:,}", f"{b / whole:.3f} (1/N = {1 / ring.world:.3f})"] for r, b in enumerate(every)])
    block = T.GLOBAL_BATCH * (T.SEQ // ring.world) * T.DIM * 4
    ui.print(f"each rank saves 1/N of every layer's activations, its K and V among them "
             f"({2 * T.N_BLOCKS} x {block:,} bytes; lesson 13: {2 * T.N_BLOCKS} x {block * ring.world:,}): "
             f"for a sequence N times as long, a rank saves what one process saves for this one")
    scores = T.GLOBAL_BATCH * T.N_HEADS * T.SEQ * T.SEQ * 4
    ui.print(f"scores: one tile at a time ({ring.score_bytes:,} bytes, 1/{scores / ring.score_bytes:.0f} "
             f"= 1/(2N)^2 of the whole sequence's {scores:,}) and none saved; lesson 13's SDPA saves "
             f"none either (flash attention tiles in one process too): not what N ranks buy")
    return {"saved_activation_bytes_per_rank": every, "saved_activation_bytes_lesson_13": whole,
            "score_bytes_per_rank": ring.score_bytes, "score_bytes_whole_sequence": scores}
