"""Check exercise 07: resume mid-epoch without training a sample twice.

The learner's still_to_do(global_step, world, rank, ...) says which samples each rank still
trains in the epoch a snapshot was taken in. Six resumes (mid-epoch, at an epoch boundary,
on another number of ranks, another seed and batch) are compared with DistributedSampler's
own order: every sample of the epoch trained exactly once, in the uninterrupted run's order.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular).
# _answers runs in the answer's process (check_exercise.answer); check() compares, here.
STARTER = "exercises/07_resume_mid_epoch.py"


# (global step of the snapshot, world size on resume, seed, data set size, global batch)
CASES = [(40, 2, 0, 3072, 96), (40, 3, 0, 3072, 96), (32, 4, 0, 3072, 96),
         (5, 1, 0, 3072, 96), (77, 6, 7, 3072, 96), (27, 2, 3, 960, 48)]


def _setup(step: int, world: int, seed: int, size: int, batch: int) -> str:
    per_epoch = size // batch
    epoch, done = divmod(step, per_epoch)
    return (f"resuming after global step {step} (epoch {epoch + 1}, {done} of its "
            f"{per_epoch} steps done; global batch {batch}, {size} samples, seed {seed}) "
            f"on {world} rank(s)")


def _answers(module) -> list:
    """In the answer's process: still_to_do for every case and rank, as lists of ints."""
    from check_exercise import NotYet, where

    out = []
    for step, world, seed, size, batch in CASES:
        answers = []
        for rank in range(world):
            try:
                answers.append([int(i) for i in module.still_to_do(
                    step, world, rank, seed=seed, dataset_size=size, global_batch=batch)])
            except Exception as exc:
                raise NotYet(f"{_setup(step, world, seed, size, batch)}: still_to_do(..., rank={rank}) "
                             f"raised {type(exc).__name__}: {exc}{where(exc, module.__file__)}")
        out.append(answers)
    return out


def check(path: Path) -> str:
    """Resuming after a snapshot trains exactly the rest of the epoch, in the sampler's order."""
    from collections import Counter

    from torch.utils.data import DistributedSampler

    from check_exercise import NotYet, answer, listed

    every = answer(path, _answers)  # the learner's code runs there; the truth is made here
    for (step, world, seed, size, batch), answers in zip(CASES, every, strict=True):
        per_epoch = size // batch
        epoch, done = divmod(step, per_epoch)
        setup = _setup(step, world, seed, size, batch)
        truth = []
        for rank in range(world):
            sampler = DistributedSampler(range(size), num_replicas=world, rank=rank,
                                         shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            truth.append(list(sampler)[done * (batch // world):])
        if len(answers) != world:
            raise NotYet(f"{setup}: the check got answers for {len(answers)} ranks")
        sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        trained = set(list(sampler)[:done * batch])  # the epoch's first `done` global batches
        count = Counter(i for answer_ in answers for i in answer_)
        again = [i for i in count if i in trained]
        if again:
            raise NotYet(f"{setup}: the ranks would train {len(again)} samples again that the "
                         f"snapshot's {done} steps of this epoch already trained (ids "
                         f"{listed(again)}). How many of this epoch's samples does the "
                         f"snapshot hold, and how many of them were this rank's?")
        twice = [i for i, c in count.items() if c > 1]
        if twice:
            raise NotYet(f"{setup}: {len(twice)} samples would be trained twice by the ranks "
                         f"together (ids {listed(twice)}); each rank must keep to its own share")
        missing = sorted(set(range(size)) - trained - set(count))
        if missing:
            raise NotYet(f"{setup}: {len(missing)} samples of the epoch would be skipped: no "
                         f"step has trained them yet, and no rank would train them now (ids "
                         f"{listed(missing)})")
        strange = sorted(set(count) - set(range(size)))
        if strange:
            raise NotYet(f"{setup}: ids outside the data set: {listed(strange)}")
        for rank in range(world):
            if answers[rank] != truth[rank]:
                at = next((k for k, (a, b) in enumerate(zip(answers[rank], truth[rank])) if a != b),
                          min(len(answers[rank]), len(truth[rank])))
                raise NotYet(f"{setup}: rank {rank} gets the right samples, but not in the order "
                             f"the uninterrupted run would train them (from position {at} on), so "
                             f"the resumed batches, and the weights, would differ. Keep "
                             f"DistributedSampler's order for the epoch")
    return (f"{len(CASES)} resumes (mid-epoch, at an epoch boundary, with another world size) "
            f"train the rest of the epoch exactly once, in the sampler's order")
