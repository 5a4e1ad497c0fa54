"""Zoo bug tp-same-seed: every tensor-parallel rank draws its own shards from the same seed.

The SmolLM3 run (Hugging Face, "The Smol Training Playbook", Mystery #4, "Unsatisfactory
performance"; the fix in huggingface/nanotron's trainer.py). Around 1T tokens the team's
evaluations of intermediate checkpoints showed the 3B model doing worse than SmolLM2 (1.7B) at
the same point; the loss still fell, but too slowly. SmolLM2 trained without tensor parallelism,
SmolLM3 with TP=2: a 1.7B model trained with and without TP "consistently had a higher loss" with
it. "Comparing weights from TP and non-TP runs", they found "we were using identical random
seeds across all TP ranks, when each rank should have been initialized with a different seed",
which "caused correlated weight initialization across shards". The fix: set_random_seed(seed +
tp_rank). They restarted the run.

Re-created on lesson 26's tensor + sequence parallel layout (lesson 17's f and g): replicated
weights (embeddings, norms, head, row-parallel biases) come from lesson 13's model; each rank then
draws its own pieces of the split layers with nn.Linear's own rule (uniform in +-1/sqrt(fan_in))
from one generator seeded with the seed. Every rank draws the same numbers: rank 1's heads and
MLP units are copies of rank 0's, and (the model being symmetric between the copies) they stay
copies forever: half the heads and units, each counted twice. nanotron's fix (seed + tp_rank)
makes the pieces differ but gives another model than one process; here the fix keeps what
lessons 17 and 26 do, which also makes the run comparable: every rank builds the whole model from
the same seed and keeps its slice.
"""
from __future__ import annotations

import math

import torch

import parity_layouts
from common import transformer as T
from zoo_kit import Outcome, lesson_13_model, replica_gap, shapes_of_lesson_13, train_layout, whole_state

NAME = "tp-same-seed"
UPSTREAM = "Smol Training Playbook (SmolLM3)"  # huggingface.co/spaces/HuggingFaceTB/smol-training-playbook
TITLE = "Mystery #4 – Unsatisfactory performance"
LAYOUT = "tensor + sequence parallel by hand (lesson 26's tp), each rank 1/N of the heads and MLP units"
MISTAKE = "every TP rank draws its own shards from the same seed: all ranks hold the same pieces"
FIX = "the whole weight from the same seed on every rank, each keeping its slice"
CAUGHT_BY = "oracle"
SIGNS = ("lesson 26's oracle names step 1's forward of the first split layer, blocks.0.attn.q, and after "
         "training every rank still holds the same pieces of the split layers")
RECORDS = ("forward", "backward")


def split_layers(block):
    """(layer, fan_in of the whole layer, column-parallel?) for a block's split layers."""
    return [(block.attn.q, T.DIM, True), (block.attn.k, T.DIM, True), (block.attn.v, T.DIM, True),
            (block.mlp.fc, T.DIM, True), (block.attn.proj, T.DIM, False), (block.mlp.proj, T.MLP_DIM, False)]


def draw_own_shards(model, seed: int) -> None:
    """Each rank initializes its own pieces, as nn.Linear does (uniform in +-1/sqrt(fan_in)),
    from a generator seeded with `seed`. Drawn in float32 and cast, so that a float64 twin has
    the same weights exactly."""
    generator = torch.Generator().manual_seed(seed)  # the bug: the same seed on every TP rank
    with torch.no_grad():
        for block in model.blocks:
            for layer, fan_in, column in split_layers(block):
                bound = 1 / math.sqrt(fan_in)
                pieces = [layer.weight] + ([layer.bias] if column else [])  # a row-parallel bias is whole
                for p in pieces:
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=()):
    """Lesson 13's recipe under tensor + sequence parallel; mode "bug" has every rank draw its own
    pieces from the same seed, "fix" keeps each rank's slice of the whole model (lesson 17)."""
    model = lesson_13_model(seed, dtype, device)  # the whole model, from the same seed everywhere
    run = parity_layouts.build("tp", model, rank, world, parity_layouts.Bug(), device)  # keeps our slice
    if mode == "bug":
        draw_own_shards(model, seed)
    losses, recording = train_layout(run, model, steps=steps, seed=seed, device=device, record=record)
    # 0 where every rank holds the same numbers: right for the whole weights, wrong for the pieces
    evidence = {"shards_alike": replica_gap(model) == 0.0}
    state = whole_state(model, shapes_of_lesson_13())
    return Outcome(state, losses, recording, evidence) if rank == 0 else None


def evidence_lines(evidence: dict) -> list[str]:
    if evidence["shards_alike"]:
        return ["after the last step every rank still holds the same pieces of every split layer, to the "
                "bit: half the heads and MLP units, each counted twice"]
    return ["the ranks' pieces of the split layers differ, as slices of one weight do"]
