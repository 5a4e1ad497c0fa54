"""Lesson 23's companion: the model sizes, the fake process group, and what one rank measures.

    SIZES, Size                 tiny (the Part 2 recipe's shape) ... 7b: width, heads, blocks,
                                vocabulary, sequence length
    make_model(size)            the Part 2 transformer (common/transformer.py) with those sizes:
                                the same classes' layout and parameter names, so lesson 19's
                                tensor-parallel plan applies unchanged
    join_fake_group(world)      this process becomes rank 0 of `world` ranks: the "fake" backend
    held_bytes(model, opt)      bytes this rank holds, by kind, from its local shards
    whole_across_tp(model)      the parameters tensor parallel leaves whole, and what rank 0 holds of them
    Trackers(model, opt, ...)   torch's FSDPMemTracker (the peak) and CommDebugMode (Step 7)

PRIVATE API, checked on torch 2.14.1 only: FakeStore and the "fake" backend live in
torch.testing._internal.distributed.fake_pg, torch's own test helpers, not its public API. They
may move or change in any release; every run prints the version it runs on beside CHECKED_ON
(version_note). FakeTensorMode (torch._subclasses) and FSDPMemTracker
(torch.distributed._tools) are private too (a leading underscore), used by torch's own tools.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CHECKED_ON = "2.14.1"  # the torch version whose private modules this lesson was checked on


@dataclass(frozen=True)
class Size:
    dim: int      # model width h
    heads: int
    blocks: int
    vocab: int
    seq: int      # tokens per sequence s (one sequence per micro-batch on each dp rank)


SIZES = {
    "tiny": Size(64, 4, 2, 8, 32),           # the Part 2 recipe's shape (common/transformer.py)
    "1b": Size(2048, 16, 16, 32000, 2048),   # about 0.94 billion parameters
    "3b": Size(3072, 24, 24, 32000, 2048),   # about 2.9 billion
    "7b": Size(4096, 32, 32, 32000, 4096),   # about 6.7 billion: lesson 19's --plan default shape
}


class Attention(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(s.dim, s.dim) for _ in range(4))
        self.head_dim = s.dim // s.heads

    def forward(self, x):
        B, T, _ = x.shape  # -1 heads: under tensor parallelism each rank holds heads / tp
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.fc, self.proj = nn.Linear(s.dim, 4 * s.dim), nn.Linear(4 * s.dim, s.dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(s.dim), Attention(s)
        self.norm2, self.mlp = nn.LayerNorm(s.dim), MLP(s)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(s.vocab, s.dim), nn.Embedding(s.seq, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.blocks))
        self.norm, self.head = nn.LayerNorm(s.dim), nn.Linear(s.dim, s.vocab)

    def forward(self, x):
        x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(size: Size) -> Transformer:
    return Transformer(size)


def count_parameters(size: Size) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in make_model(size).parameters())


def join_fake_group(world: int) -> None:
    """init_process_group with the "fake" backend: every collective returns at once, moving no
    data. Rank 0 of `world`: the ranks we are not exist only as numbers in the group's size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # PRIVATE: see the docstring

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def version_note() -> str:
    """The line each run prints about the private APIs it leans on."""
    have = torch.__version__.split("+")[0]
    same = "the same version" if have == CHECKED_ON else "[yellow]NOT that version: they may differ here[/yellow]"
    return (f"PRIVATE API: the fake process group (torch.testing._internal.distributed.fake_pg), "
            f"FakeTensorMode and FSDPMemTracker, checked on torch {CHECKED_ON}; this is torch {have}, {same}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, padding included. As
    apparatus/sharding.py's storage_bytes, but storages are told apart by their C++ object,
    not by data_ptr(): a fake tensor has no data, so every data_ptr() is the same."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def held_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state"} this rank holds (AdamW's one-number step
    counters left out, as lesson 19 counts)."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": storage_bytes(state)}


def whole_across_tp(model: nn.Module) -> dict[str, int]:
    """The parameters tensor parallel left whole on every tp rank (not Shard on the mesh's "tp"
    dimension: lesson 19's plan splits only the blocks' linear layers), how many elements they
    have in all, and the bytes of them this rank holds (FSDP2 still divides them by dp)."""
    def split(p) -> bool:
        names = p.device_mesh.mesh_dim_names or ()
        return "tp" in names and p.device_mesh.size(names.index("tp")) > 1 and p.placements[names.index("tp")].is_shard()

    whole = [p for p in model.parameters() if not split(p)]
    return {"tensors": len(whole), "parameters": sum(p.numel() for p in whole),
            "held_bytes": storage_bytes(whole)}


class Trackers:
    """torch's FSDPMemTracker (memory=True) and CommDebugMode (comm=True), entered together.

    FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker; torchtitan's memory estimator,
    scripts/estimate/estimation.py, runs it under the fake process group as we do) records every
    storage created while it is entered, by kind (sharded and unsharded parameters, gradients,
    activations, all-gather and reduce-scatter buffers, optimizer state, temporaries), and the
    peak of their sum. Under FakeTensorMode it holds while the step computes on plain tensors
    (FSDP2 alone: it gathers each block's weights into plain tensors), not on DTensors (tensor
    parallel): DTensor works out each new op's output shape by running it on fake tensors of
    the whole, unsharded shape, in the fake mode already active (`detect_fake_mode() or
    FakeTensorMode()` in torch/distributed/tensor/_sharding_prop.py), and the tracker counts
    what that mode makes as this rank's memory (in a real run that mode is a separate one, and
    the tracker skips it). Step 7 measures both against real ranks. CommDebugMode
    (torch.distributed.tensor.debug) is torch's own collective counter: Step 7 shows it counts
    what CommLog counts, FSDP2's collectives included."""

    def __init__(self, model, optimizer, memory: bool, comm: bool):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # PRIVATE: see the docstring
        from torch.distributed.tensor.debug import CommDebugMode

        self.memory = FSDPMemTracker(model, optimizer) if memory else None
        self.comm = CommDebugMode() if comm else None

    def __enter__(self):
        for tool in (self.memory, self.comm):
            if tool is not None:
                tool.__enter__()
        return self

    def __exit__(self, *exc):
        for tool in (self.comm, self.memory):
            if tool is not None:
                tool.__exit__(*exc)

    def peak(self) -> dict[str, int]:
        """FSDPMemTracker's peak in bytes, by kind ("sharded_param", "activation", ...) and
        "total" (the CPU is our one device); {} when it did not run."""
        if self.memory is None:
            return {}
        by_kind = next(iter(self.memory.get_tracker_snapshot("peak").values()), {})
        return {str(getattr(k, "value", k)).lower().replace(" ", "_"): int(v)
                for k, v in by_kind.items() if v or k == "Total"}

    def counts(self) -> dict[str, int]:
        """CommDebugMode's collectives by kind, named as CommLog names them (apparatus/comm.py)."""
        from apparatus.comm import OPS
        out: dict[str, int] = {}
        for op, n in self.comm.get_comm_counts().items() if self.comm is not None else ():
            name = str(op)  # CommDebugMode names DTensor's all-reduce c10d_functional.all_reduce
            kind = (OPS.get(name) or OPS.get("_" + name) or (name,))[0]
            out[kind] = out.get(kind, 0) + n
        return out


def tokens(size: Size, dp_rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of this dp rank's tokens and its targets; a tp group shares them. Random:
    the lesson counts bytes, not learning."""
    g = torch.Generator().manual_seed(seed * 100_003 + dp_rank)
    x = torch.randint(0, size.vocab, (1, size.seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]
