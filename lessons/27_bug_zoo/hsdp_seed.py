"""Zoo bug hsdp-seed: each rank initializes its weights from its own seed, and HSDP keeps them.

allenai/OLMo-core#319, "fix initialization (again)". An earlier pull request (#307, "ensure
sharded parameters initialized different on different ranks") had made the init seed
`self.init_seed + get_rank()`: right for the pieces of one sharded weight, which must differ.
But "unlike DDP, PyTorch's fully_shard() (FSDP) wrapper doesn't synchronize to make sure
parameters are consistent across the process group", so under HSDP (shards within a replica,
copies across replicas) "replica 1 has completely different parameters than replica 2". A
restart of the bad run helped, "because now the replicas all ended up with the same parameters
(the params from the first replica, because that's what was saved to the checkpoint)". The fix
initializes DTensors so that the full tensors are the same "regardless of world size"; torch's
own test for HSDP (pytorch/pytorch#125431) shows the other cure, a broadcast across replicas.

Re-created on 2 ranks as HSDP with 2 replicas of 1 shard (4 ranks: 2 replicas of 2 shards):
each rank builds lesson 13's model from seed + rank, then fully_shard on a 2-D mesh. The
gradients are averaged across replicas (all-reduce) and each replica steps its own weights with
them: two models, trained as one. The fix: every rank builds the model from the same seed
before fully_shard (Part 2's rule), and each keeps its slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import parity_layouts
from zoo_kit import Outcome, lesson_13_model, replica_gap, train_layout, whole_state

NAME = "hsdp-seed"
UPSTREAM = "allenai/OLMo-core#319"
TITLE = "fix initialization (again)"
LAYOUT = "HSDP (fully_shard on a 2-D mesh: 2 replicas x N/2 shards), each rank 1/N of the rows"
MISTAKE = "init seed = seed + rank: right for the pieces of a weight, wrong across replicas"
FIX = "the same seed on every rank before fully_shard: the same full tensors whatever the world size"
CAUGHT_BY = "oracle"
SIGNS = ("lesson 26's oracle names step 1's very first entry, tok_emb's forward (the rows another replica "
         "computed), and the replicas' weights differ")
RECORDS = ("forward", "backward")


def train(rank, world, mode, *, steps, seed, device, dtype=torch.float32, record=()):
    """Lesson 13's recipe under HSDP; mode "bug" seeds each rank's init with seed + rank,
    "fix" with the seed alone."""
    mesh = dist.init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    init_seed = seed + rank if mode == "bug" else seed  # OLMo-core #307: self.init_seed + get_rank()
    model = lesson_13_model(init_seed, dtype, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # a 2-D mesh: HSDP, no broadcast of the weights
    fully_shard(model, mesh=mesh)
    run = parity_layouts.Layout("hsdp", model, model, parity_layouts.data_rows(rank, world, parity_layouts.Bug()))
    losses, recording = train_layout(run, model, steps=steps, seed=seed, device=device, record=record)
    # each rank's piece against the same piece in the first replica: 0 when the replicas agree
    evidence = {"replica_gap": replica_gap(model, mesh.get_group("replicate"))}
    state = whole_state(model, {})  # rank 0's: the first replica's, what a checkpoint holds
    return Outcome(state, losses, recording, evidence) if rank == 0 else None


def evidence_lines(evidence: dict) -> list[str]:
    gap = evidence["replica_gap"]
    if gap == 0:
        return ["the replicas hold the same weights, to the bit"]
    return [f"the replicas' weights differ by up to {gap:.1e}: HSDP averages their gradients, never their weights"]
