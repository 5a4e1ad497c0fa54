"""Lesson 25's companion: every rank's values, on real ranks and on N ranks simulated in one process.

    GlooView(world)            each rank's piece, gathered from the real ranks (all_gather_object)
    LocalView(world)           each rank's piece, read out of a LocalTensor (LocalTensorMode)
    Values(view)               what the program computed, by name: every rank's piece, the whole
                               tensor, and the same computation in one process without DTensor
    largest_gap(a, b)          the largest |difference| of every rank's every piece, two runs
    version_note()             the line each run prints about the private APIs used here

PRIVATE API, checked on torch 2.14.1 only: LocalTensorMode and LocalTensor live in
torch.distributed._local_tensor (a leading underscore: not torch's public API; "intended purely
for *debugging* purposes", says its docstring), and the fake process group it runs on comes from
torch.testing._internal.distributed.fake_pg (lesson 23). torch's own DTensor tests use the two
together in the same way (torch/testing/_internal/distributed/_tensor/common_dtensor.py,
LocalDTensorTestBase: init_process_group("fake", ...), then LocalTensorMode(world_size)).

How LocalTensorMode works (torch/distributed/_local_tensor/__init__.py): a tensor made inside the
mode by a factory (torch.arange, torch.randn) is a LocalTensor holding one tensor per simulated
rank; an op on it runs once per rank; a collective (a c10d or functional op, DTensor's
shard_dim_alltoall too) is done on the N local tensors at once (_c10d.py), and DeviceMesh's
get_coordinate answers per rank. A plain tensor made before the mode stays plain: an all-reduce
of it returns it unchanged (the fake group moves nothing), so the program makes its inputs inside.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

CHECKED_ON = "2.14.1"  # the torch version whose private modules this lesson was checked on


class GlooView:
    """Real ranks: a rank sees the others' pieces only by asking for them (a collective)."""

    def __init__(self, world: int):
        self.world = world

    def pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        out: list = [None] * self.world
        dist.all_gather_object(out, t.detach().cpu())
        return out

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu()


class LocalView:
    """One process holds every rank: a LocalTensor's _local_tensors are their pieces."""

    def __init__(self, world: int):
        self.world = world

    def pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        from torch.distributed._local_tensor import LocalTensor  # PRIVATE: see the docstring

        if isinstance(t, LocalTensor):
            return [t._local_tensors[r].detach().cpu() for r in range(self.world)]
        return [t.detach().cpu()] * self.world  # a plain tensor: the same on every rank

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        return self.pieces(t)[0]


class Values:
    """By name: every rank's piece (to_local), the whole (full_tensor) and the one-process value.
    mistake=True marks a result that is wrong on purpose (Step 5): it must differ."""

    def __init__(self, view):
        self.view = view
        self.pieces: dict[str, list[torch.Tensor]] = {}
        self.full: dict[str, torch.Tensor] = {}
        self.one_process: dict[str, torch.Tensor] = {}
        self.mistakes: set[str] = set()

    def add(self, name: str, d, one_process: torch.Tensor, mistake: bool = False) -> None:
        self.pieces[name] = self.view.pieces(d.to_local())
        self.full[name] = self.view.mine(d.full_tensor())  # a collective: outside any count
        self.one_process[name] = self.view.mine(one_process)
        if mistake:
            self.mistakes.add(name)

    def gap_to_one_process(self, mistakes: bool = False, relative: bool = False) -> dict[str, float]:
        """max |full - one process| per result: the right ones, or (mistakes=True) the wrong.
        relative=True: divided by the result's largest |value| (at least 1), so that one float32
        rounding step of a value near 90 (7.6e-6) reads as what it is, about 1e-7."""
        out = {}
        for name in self.full:
            if (name in self.mistakes) == mistakes:
                one = self.one_process[name].double()
                gap = (self.full[name].double() - one).abs().max().item()
                out[name] = gap / max(1.0, one.abs().max().item()) if relative else gap
        return out


def largest_gap(a: Values, b: Values) -> tuple[float, int, str]:
    """(largest |a - b| over every piece of every rank, how many pieces were compared, the
    result where it is largest)."""
    assert a.pieces.keys() == b.pieces.keys(), sorted(a.pieces.keys() ^ b.pieces.keys())
    gaps = [((x.double() - y.double()).abs().max().item() if x.numel() else 0.0, name)
            for name in a.pieces for x, y in zip(a.pieces[name], b.pieces[name], strict=True)]
    worst, where = max(gaps)
    return worst, len(gaps), where


def version_note() -> str:
    have = torch.__version__.split("+")[0]
    same = "the same version" if have == CHECKED_ON else "[yellow]NOT that version: it may differ here[/yellow]"
    return (f"PRIVATE API: LocalTensorMode (torch.distributed._local_tensor) and the fake process group "
            f"(torch.testing._internal.distributed.fake_pg), checked on torch {CHECKED_ON}; "
            f"this is torch {have}, {same}")
