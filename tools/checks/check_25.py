"""Check exercise 25: the collective and the bytes of a redistribution, predicted, against gloo.

Cases are drawn anew for every check (so no list of answers fits them all): every move between
"S(0)", "S(1)", "R" and "P(sum)" that redistribute accepts, once with a shape whose dimensions
the mesh divides and once with sizes it may not, on a 1-D mesh of 4 ranks or of 2. The learner's
cost(src, dst, shape, world) answers in its own process; then 4 gloo ranks of the check's own
run each move (distribute_tensor, then redistribute) and count what rank 0 sent with
apparatus/comm.py's CommLog, as lesson 25 does. The verdict compares the two here.
"""
from __future__ import annotations

import math
import random
import secrets
from pathlib import Path

STARTER = "exercises/25_redistribution_cost.py"
WORLD = 4
NAMES = ["S(0)", "S(1)", "R", "P(sum)"]
MOVES = [(a, b) for a in NAMES for b in NAMES if a != b and (a, b) != ("R", "P(sum)")]  # 11


def _cases(seed: int) -> list[tuple[str, str, tuple[int, int], int]]:
    """Every move twice: on an even shape (its sizes multiples of the ranks), then on sizes from
    1 to 11; the even ones first, so the first mistake shown is about the collective."""
    rng = random.Random(seed)
    even = [(a, b, (n * rng.randint(1, 3), n * rng.randint(1, 3)), n) for a, b in MOVES for n in [rng.choice((2, 4))]]
    rest = [(a, b, (rng.randint(1, 11), rng.randint(1, 11)), n) for a, b in MOVES for n in [rng.choice((2, 4))]]
    return even + rest


def _rank_25(rank: int, world: int, cases: list) -> list[tuple[str, float]]:
    """Each case on real ranks: what ran (CommLog's kinds) and the bytes this rank sent."""
    import logging

    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    from apparatus.comm import CommLog

    torch.set_num_threads(1)
    # the all-to-all's fallback warns once per rank, through torch's logging: not the verdict's line
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    placement = {"S(0)": Shard(0), "S(1)": Shard(1), "R": Replicate(), "P(sum)": Partial()}
    meshes = {WORLD: init_device_mesh("cpu", (WORLD,)),
              2: init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pair", "other"))["pair"]}
    out = []
    for src, dst, shape, n in cases:
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        d = distribute_tensor(x, meshes[n], [placement[src]])
        log = CommLog()
        with log.recording():
            moved = d.redistribute(meshes[n], [placement[dst]])
        assert torch.equal(moved.full_tensor(), x), f"{src} -> {dst} changed the values"
        out.append(("+".join(c.kind for c in log.calls) or "none", sum(c.sent_bytes for c in log.calls)))
    return out


def _answers(module, cases: list) -> list:
    """In the answer's process: cost(src, dst, shape, world) for every case, as plain data."""
    from check_exercise import NotYet

    if not hasattr(module, "cost"):
        raise NotYet(f"{module.__file__} has no function cost(src, dst, shape, world)")
    out = []
    for src, dst, shape, n in cases:
        try:
            got = module.cost(src, dst, tuple(shape), n)
        except Exception as exc:  # noqa: BLE001 - the learner's error, in one line
            raise NotYet(f"cost({src!r}, {dst!r}, {tuple(shape)}, {n}) raised {type(exc).__name__}: {exc}")
        ok = (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], str)
              and isinstance(got[1], (int, float)) and not isinstance(got[1], bool))
        out.append([got[0], float(got[1])] if ok else repr(got)[:200])
    return out


def _hint(src: str, dst: str, shape, n: int, want: tuple[str, float], got_kind: str) -> str:
    if want[0] != got_kind:
        if src.startswith("S") and dst.startswith("S"):
            return "on a CPU mesh DTensor plans an all-to-all but runs an all-gather and keeps its chunk (lesson 25, Step 3)"
        if want[0] == "none":
            return "Replicate -> Shard keeps this rank's chunk; Shard -> Partial puts its piece in zeros: nothing to send"
        return "Partial -> Replicate sums the summands everywhere; Partial -> Shard sums them and keeps one piece each"
    uneven = [d for d in (0, 1) if shape[d] % n]
    if uneven:
        return (f"dimension {uneven[0]} ({shape[uneven[0]]}) does not divide by {n}: every piece is padded to "
                f"ceil({shape[uneven[0]]}/{n}) first, and Shard -> Shard pads both dimensions")
    return "the ring shares: all-reduce 2(N-1)/N x S, all-gather and reduce-scatter (N-1)/N x S, S the whole tensor's bytes"


def check(path: Path) -> str:
    """cost() equals what 4 gloo ranks measure, for 22 moves drawn for this check."""
    from check_exercise import NotYet, answer, run_world

    cases = _cases(secrets.randbits(32))
    answers = answer(path, _answers, cases)
    truth = run_world(WORLD, _rank_25, (cases,), path)[0]  # rank 0's counts: the check's own ranks
    for (src, dst, shape, n), got, want in zip(cases, answers, truth, strict=True):
        said = f"cost({src!r}, {dst!r}, {tuple(shape)}, {n})"
        if isinstance(got, str):
            raise NotYet(f"{said} returned {got}; return (collective, bytes), e.g. ('all_gather', 96.0)")
        if got[0] == want[0] and abs(got[1] - want[1]) <= 1e-6 * max(1.0, want[1]):
            continue
        raise NotYet(f"{said}: on a mesh of {n} gloo ranks DTensor ran {want[0]} and rank 0 sent {want[1]:,.1f} bytes; you said "
                     f"{got[0]}, {got[1]:,.1f}. {_hint(src, dst, shape, n, want, got[0])}")
    return (f"all {len(cases)} moves right, collective and bytes, as 4 gloo ranks ran them "
            f"(even and uneven shapes, meshes of 2 and 4 ranks)")
