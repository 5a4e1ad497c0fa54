"""Check exercise 10: a ring all-reduce from point-to-point messages.

The learner's ring_all_reduce(tensor) runs on 2, 3 and 4 ranks on tensors of several sizes,
some that the number of ranks does not divide, and is compared with dist.all_reduce's sums;
every send is counted (elements and destination), and dist's collectives are refused, so
the answer must be a ring: each rank sends to one neighbour, at most 2(N-1)/N of the tensor.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular).
# _rank_10 runs in the answer's ranks (check_exercise.answer); check() compares, here.
STARTER = "exercises/10_ring_all_reduce.py"
WORLDS = (2, 3, 4)  # numbers of ranks, each run in turn in one answer process

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "broadcast", "all_to_all",
               "all_to_all_single", "gather", "scatter")


def _sizes(world: int) -> list:
    return sorted({1, world - 1, world, world + 1, 10, 1001} - {0})


def _input(size: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * size + rank)  # every rank its own numbers
    return torch.randn(size, generator=g)


def _rank_10(rank: int, world: int, path: str) -> list:
    """The learner's ring on tensors of several sizes: what it left in each tensor, and every
    point-to-point send counted (elements and destination) on the way. The sums it should
    have made are computed by the check, in its own process."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from check_exercise import NotYet, load

    sent = {"elements": 0, "to": set()}

    def counted(send):
        def wrapper(tensor, *args, **kwargs):
            peer = kwargs.get("dst", args[0] if args else None)
            sent["to"].add(kwargs.get("group_dst") if peer is None else peer)
            sent["elements"] += tensor.numel()
            return send(tensor, *args, **kwargs)
        return wrapper

    def forbidden(name):
        def refuse(*args, **kwargs):
            raise NotYet(f"ring_all_reduce called dist.{name}: build it from point-to-point "
                         f"messages (dist.isend / dist.irecv) only, as the lesson does")
        return refuse

    # before the learner's file is loaded, so `from torch.distributed import isend` counts too
    for name in ("isend", "send"):
        wrapped = counted(getattr(dist, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)  # batch_isend_irecv's P2POp checks against these
    for name in COLLECTIVES:
        setattr(dist, name, forbidden(name))
    module = load(Path(path))
    out = []
    for size in _sizes(world):
        got = _input(size, rank)
        before = sent["elements"]
        module.ring_all_reduce(got)
        out.append({"size": size, "got": got.detach().clone(), "sent": sent["elements"] - before})
    return [out, sorted(int(t) for t in sent["to"] if t is not None)]


def _on_ranks(module, worlds: list) -> dict:
    """In the answer's process: _rank_10 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_10, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """The ring matches dist.all_reduce for 2, 3 and 4 ranks and sizes N does not divide."""
    import torch

    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    every = answer(path, _on_ranks, WORLDS, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        ranks = every[world]
        for rank, (results, peers) in enumerate(ranks):
            for r in results:
                # what dist.all_reduce gives: the sum of every rank's tensor, made here
                expected = sum(_input(r["size"], q) for q in range(world))
                got = r["got"]
                if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                    raise NotYet(f"with {world} ranks and a tensor of {r['size']} floats, rank {rank}'s "
                                 f"tensor changed shape: ring_all_reduce works in place, on the tensor given")
                wrong = ~torch.isclose(got, expected, rtol=1.3e-6, atol=1e-5)  # assert_close's float32
                if wrong.any():
                    before = "; with 2 ranks every size was right" if world > 2 else ""
                    raise NotYet(f"with {world} ranks and a tensor of {r['size']} floats, rank "
                                 f"{rank}'s result differs from dist.all_reduce's (from element "
                                 f"{int(wrong.nonzero()[0, 0])} on; max |difference| "
                                 f"{(got - expected).abs().max().item():.3g})"
                                 f"{before}. At step k of each phase, which chunk does rank r "
                                 f"send, and which one arrives? (lesson 10, Step 3 draws it)")
        for rank, (results, peers) in enumerate(ranks):
            neighbours = {(rank + 1) % world, (rank - 1) % world}
            if len(peers) > 1 or not set(peers) <= neighbours:
                raise NotYet(f"with {world} ranks, rank {rank} sent to ranks {peers}: in a ring "
                             f"every rank sends to one neighbour only")
            for r in results:
                most = 2 * (r["size"] - r["size"] // world)
                if r["sent"] > most:
                    raise NotYet(f"with {world} ranks and a tensor of {r['size']} floats, rank "
                                 f"{rank} sent {r['sent']} floats: the right sums, but a ring "
                                 f"sends at most 2(N-1)/N of the tensor ({most} here). Does "
                                 f"something send more than one chunk per step?")
    return ("the ring matches dist.all_reduce on 2, 3 and 4 ranks for every size tried, and "
            "each rank sends at most 2(N-1)/N of the tensor, to one neighbour")
