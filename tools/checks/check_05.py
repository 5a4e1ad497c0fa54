"""Check exercise 05: DistributedSampler's set_epoch.

The learner's epoch_orders(size, world, rank, epochs) gives each rank's order of the samples
in every epoch; on 3 ranks and 3 epochs the orders must change from epoch to epoch while the
ranks still split every epoch exactly, and the same call must give the same orders.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular).
# _orders runs in the answer's process (check_exercise.answer); check() compares, here.
STARTER = "exercises/05_set_epoch.py"


def _orders(module, size: int, world: int, epochs: int) -> dict:
    """In the answer's process: the learner's orders, as plain lists of ints."""
    def plain(orders):
        return [[int(i) for i in epoch] for epoch in orders]

    return {"per_rank": [plain(module.epoch_orders(size, world, r, epochs)) for r in range(world)],
            "again": [plain(module.epoch_orders(size, world, 0, 2)) for _ in range(2)]}


def check(path: Path) -> str:
    """Orders differ between epochs, and the ranks still split every epoch exactly."""
    from check_exercise import NotYet, answer

    size, world, epochs = 96, 3, 3
    got = answer(path, _orders, size, world, epochs)
    per_rank = got["per_rank"]
    for epoch in range(epochs):
        together = sorted(i for r in range(world) for i in per_rank[r][epoch])
        if together != list(range(size)):
            raise NotYet(f"in epoch {epoch} the {world} ranks together do not read every sample "
                         f"exactly once; each epoch must still be split between the ranks")
    for r in range(world):
        if per_rank[r][0] == per_rank[r][1] or per_rank[r][1] == per_rank[r][2]:
            raise NotYet(f"rank {r} reads the same order in two epochs: "
                         f"{per_rank[r][0][:6]}... both times. Where does the epoch enter the sampler?")
    if got["again"][0] != got["again"][1]:
        raise NotYet("two calls with the same seed give different orders; keep it deterministic")
    return f"every epoch has a new order on each of {world} ranks, and every epoch is split exactly"
