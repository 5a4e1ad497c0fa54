"""Zoo bug pipeline-clip: each pipeline stage clips its gradients by its own norm.

pytorch/torchtitan#596, "Gradient norm clipping with pipeline parallelism (PP)" (labels: bug,
release_blocking). zijian-hu read torchtitan's train.py and asked: "since the model is manually
sharded, calling torch.nn.utils.clip_grad_norm_ will only compute the grad norm based on the
modules of the current PP stage", while clipping "requires computing the norm over the entire
model (across all PP stages)". awgu agreed: the parameters' DTensors carry FSDP and TP
placements, not PP, so clip_grad_norm_ cannot see the other stages. The fix (torchtitan#649,
by the reporter): each stage's norm, raised to the p-th power, all-reduced over the pipeline
ranks, then the p-th root (with the infinity norm handled apart). Splitting clip_grad_norm_ so
that the total can be reduced in between was asked for in pytorch/pytorch#139467; torch 2.14.1
has both halves, get_total_norm and clip_grads_with_norm_.

Re-created on a pipeline by hand (one micro-batch, lesson 18's cut: the embeddings, each block,
then the final norm with the head, spread over the stages; activations sent forward, their
gradients back), with lesson 13's recipe plus clipping at max_norm 1.0 (torchtitan's default).
Each stage's norm is smaller than the model's, so each stage clips less than it should, and by
a different factor: at step 1 the model's norm is 1.03.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

import parity_layouts
from common import transformer as T
from zoo_kit import MAX_NORM, Outcome, gathered_recording, lesson_13_model, recorder_for

NAME = "pipeline-clip"
UPSTREAM = "pytorch/torchtitan#596"
TITLE = "Gradient norm clipping with pipeline parallelism (PP)"
LAYOUT = "pipeline parallel by hand, one stage per rank, one micro-batch; gradients clipped at 1.0"
MISTAKE = "clip_grad_norm_ on each stage's parameters: each stage clips by its own norm, not the model's"
FIX = "get_total_norm per stage, its square all-reduced over the stages, then clip_grads_with_norm_"
CAUGHT_BY = "oracle"
SIGNS = ("lesson 26's oracle names step 1's first gradient, head.bias, with |B| / |A| a little above 1, and "
         "the symptom prints the stages' gradient norms beside the model's")
RECORDS = ("forward", "backward")
CLIP = MAX_NORM  # the baseline clips too


def pieces_of(stage: int, stages: int) -> list[int]:
    """Lesson 18's cut: pieces 0 (embeddings), 1..N_BLOCKS (the blocks), N_BLOCKS + 1 (the final
    norm and the head), spread evenly over the stages."""
    pieces = T.N_BLOCKS + 2
    return [i for i in range(pieces) if round(i * (stages - 1) / (pieces - 1)) == stage]


def stage_forward(model, mine: list[int], h):
    """This stage's share of lesson 13's forward: h is the tokens on the first stage, the
    activations received from the stage before on the others."""
    if 0 in mine:
        h = model.tok_emb(h) + model.pos_emb(torch.arange(h.shape[1], device=h.device))
    for i in range(T.N_BLOCKS):
        if i + 1 in mine:
            h = model.blocks[i](h)
    if T.N_BLOCKS + 1 in mine:
        h = model.head(model.norm(h))
    return h


def stage_modules(model, mine: list[int]) -> torch.nn.ModuleList:
    """This stage's pieces of lesson 13's model: all its optimizer and its clipping see."""
    parts = ([model.tok_emb, model.pos_emb] if 0 in mine else []) + \
        [model.blocks[i - 1] for i in mine if 1 <= i <= T.N_BLOCKS] + \
        ([model.norm, model.head] if T.N_BLOCKS + 1 in mine else [])
    return torch.nn.ModuleList(parts)


def pipeline_step(model, mine, rank, world, x, y, dtype):
    """One forward and backward through the stages (GPipe with one micro-batch, by hand).
    Returns the loss on the last stage, None on the others."""
    first, last = rank == 0, rank == world - 1
    if first:
        h = x
    else:
        h = torch.empty(x.shape[0], T.SEQ, T.DIM, dtype=dtype, device=x.device)
        dist.recv(h, rank - 1)
        h.requires_grad_()
    out = stage_forward(model, mine, h)
    loss = None
    if last:
        loss = parity_layouts.loss_fn(out, y)
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, rank + 1)
        out.backward(grad)
    if not first:
        dist.send(h.grad.contiguous(), rank - 1)
    return loss


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=()):
    """Lesson 13's recipe, clipped at CLIP, on a pipeline of `world` stages; mode "bug" clips
    each stage by its own norm (torchtitan before #649), "fix" by the model's (#649)."""
    model = lesson_13_model(seed, dtype, device)  # every stage builds the whole, trains its pieces
    mine = pieces_of(rank, world)
    stage = stage_modules(model, mine)
    params = list(stage.parameters())
    optimizer = T.make_optimizer(stage)
    recorder = recorder_for(model) if record else None
    if recorder is not None:
        recorder.keep = True  # every stage keeps its own entries; gathered_recording joins them
    losses, stage_norms = [], []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in T.batch(step - 1, seed))
        optimizer.zero_grad(set_to_none=True)
        with recorder.forward(step) if step in record else nullcontext():
            loss = pipeline_step(model, mine, rank, world, x, y, dtype)
        if step == 1:  # before clipping: this stage's norm, for the evidence
            stage_norms = gathered(torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        if mode == "bug":  # torchtitan's train.py before #649: this stage's norm only
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        else:  # torchtitan#649: the model's norm, from every stage's
            squares = torch.nn.utils.get_total_norm([p.grad for p in params]).double() ** 2
            dist.all_reduce(squares)  # the stages' sums of squares, added
            torch.nn.utils.clip_grads_with_norm_(params, CLIP, squares.sqrt().to(dtype))
        if step in record:
            recorder.gradients(step)  # after clipping: what the optimizer reads
            recorder.collect()  # this stage's entries, kept on this rank
        optimizer.step()
        total = torch.tensor([loss.item() if loss is not None else 0.0], dtype=torch.float64)
        dist.broadcast(total, src=world - 1)  # the last stage has the loss
        losses.append(total.item())
    recording = gathered_recording(recorder.recording) if recorder else None
    ours = {id(p) for p in params}
    pieces = gathered({name: p.detach().cpu().clone() for name, p in model.named_parameters() if id(p) in ours})
    if rank != 0:
        return None
    state = {name: piece[name] for piece in pieces for name in piece}
    model_norm = sum(n * n for n in stage_norms) ** 0.5
    used = stage_norms if mode == "bug" else [model_norm] * world  # the norm each stage clipped by
    evidence = {"stage_norms": stage_norms, "model_norm": model_norm,
                "factors": [min(1.0, CLIP / (n + 1e-6)) for n in used]}  # clip_grad_norm_'s coefficient, clamped
    return Outcome({name: state[name] for name, _ in model.named_parameters()}, losses, recording, evidence)


def gathered(value) -> list:
    """Every stage's `value`, in rank order, on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def evidence_lines(evidence: dict) -> list[str]:
    norms = ", ".join(f"{n:.3f}" for n in evidence["stage_norms"])
    factors = ", ".join(f"{f:.3f}" for f in evidence["factors"])
    return [f"step 1's gradient norm by stage: {norms}; the model's: {evidence['model_norm']:.3f} (max_norm "
            f"{CLIP:g}); the stages scaled their gradients by {factors}, where the model's norm asks for "
            f"{min(1.0, CLIP / (evidence['model_norm'] + 1e-6)):.3f}"]
