"""Check exercise 19: each rank's dp and tp groups on a 2-D mesh, against torch's own.

Four gloo ranks build init_device_mesh("cpu", (D, T), mesh_dim_names=("dp", "tp")) for every
way to factor 4, and read each dimension's process group's ranks; the learner's
groups(rank, D, T) must give the same lists.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/19_mesh_groups.py"
WORLD = 4
SHAPES = [(2, 2), (1, 4), (4, 1)]


def _rank_19(rank: int, world: int) -> dict:
    """This rank's (dp group, tp group) on each mesh shape, as torch builds them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for shape in SHAPES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        out[shape] = tuple(dist.get_process_group_ranks(mesh[d].get_group()) for d in ("dp", "tp"))
    # a rank may still be connecting its one-rank groups through rank 0's store: rank 0
    # (the store's host) must not leave before everyone has finished
    dist.barrier()
    return out


def _answers(module) -> dict:
    """In the answer's process: groups(rank, D, T) for every shape and rank, as lists of ints."""
    from check_exercise import NotYet

    if not hasattr(module, "groups"):
        raise NotYet(f"{module.__file__} has no function groups(rank, dp, tp)")
    out = {}
    for shape in SHAPES:
        for rank in range(WORLD):
            try:
                answer = module.groups(rank, *shape)
                out[(*shape, rank)] = [[int(r) for r in group] for group in answer]
            except Exception as exc:  # noqa: BLE001 - the learner's error, in one line
                raise NotYet(f"groups({rank}, {shape[0]}, {shape[1]}) raised {type(exc).__name__}: {exc}")
    return out


def check(path: Path) -> str:
    """Each rank's dp and tp groups on 2x2, 1x4 and 4x1 meshes, as torch's DeviceMesh makes them."""
    from check_exercise import NotYet, answer, run_world

    answers = answer(path, _answers)
    truth = run_world(WORLD, _rank_19, (), path)  # torch's DeviceMesh, in the check's own ranks
    for shape in SHAPES:
        for rank in range(WORLD):
            answer_ = answers[(*shape, rank)]
            want = truth[rank][shape]
            if tuple(map(list, answer_)) != tuple(map(list, want)):
                raise NotYet(f"on a {shape[0]} x {shape[1]} (dp x tp) mesh rank {rank}'s groups are "
                             f"dp {want[0]} and tp {want[1]}, but groups({rank}, {shape[0]}, {shape[1]}) "
                             f"answered {tuple(answer_)}. Which index varies fastest? (lesson 19, Step 3)")
    return (f"every rank's dp and tp groups match torch's DeviceMesh on {WORLD} ranks for "
            f"{', '.join(f'{d}x{t}' for d, t in SHAPES)}: a tp group is a row of neighbours")
