"""Check exercise 11: a synchronous step waits for every worker's gradient.

3 workers train the recipe's model for 6 steps, each on its share of every global batch of
96, and call the learner's synchronous_step(model, optimizer) after backward; worker 2 is
late by 0.15 s every step. The copies must stay identical and equal recipe.train_reference's
first 6 steps (one process), and the fast workers must have waited for the slow one.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/11_sync_step.py"


def _rank_11(rank: int, world: int, path: str, steps: int, slow_rank: int, delay: float) -> dict:
    """Train on this rank's share of each global batch and let the learner's step combine
    them; the slow rank sleeps before every step, and each rank times its step."""
    import time

    import torch
    import torch.nn.functional as F

    from check_exercise import load
    from common import recipe

    module = load(Path(path))
    x_all, y_all = recipe.synthetic_data()[0].tensors
    order = torch.tensor(recipe.epoch_order(len(y_all), recipe.SEED, 0))
    model = recipe.make_model(recipe.SEED)  # same seed on every rank: the same start
    optimizer = recipe.make_optimizer(model)
    waited = 0.0
    for k in range(steps):
        idx = order[k * recipe.GLOBAL_BATCH + rank:(k + 1) * recipe.GLOBAL_BATCH:world]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        if rank == slow_rank:
            time.sleep(delay)  # a slower device, or a bigger share of the work
        start = time.perf_counter()
        module.synchronous_step(model, optimizer)
        waited += time.perf_counter() - start
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "seconds_in_step": waited}


def _on_ranks(module, world: int, steps: int, slow: int, delay: float) -> list:
    """In the answer's process: _rank_11 on `world` ranks."""
    from check_exercise import run_world

    return run_world(world, _rank_11, (module.__file__, steps, slow, delay), Path(module.__file__))


def check(path: Path) -> str:
    """Every worker takes the global batch's step: copies identical, equal to one process."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer, max_diff
    from common import recipe

    world, steps, slow, delay = 3, 6, 2, 0.15
    ranks = answer(path, _on_ranks, world, steps, slow, delay, limit_s=WORLD_TIMEOUT_S + 30)
    reference = recipe.train_reference(epochs=1, steps=steps)  # one process, global batches of 96
    setup = f"{world} workers, {steps} steps of 96 samples ({96 // world} per worker)"
    spread = max(max_diff(r["weights"], ranks[0]["weights"]) for r in ranks)
    if spread > 1e-6:
        raise NotYet(f"{setup}: the copies of the model differ by up to {spread:.1e} at the end: "
                     f"each worker stepped with a gradient of its own. What must every worker "
                     f"have in .grad before optimizer.step()? (lesson 11, Step 2)")
    diff = max_diff(ranks[0]["weights"], reference)
    if diff > 1e-5:
        raise NotYet(f"{setup}: the copies agree, but they are {diff:.1e} away from one process "
                     f"training on each global batch of 96 (allowed: 1e-5). Is the gradient "
                     f"they step with the mean over all 96 samples? (lesson 11, Step 2)")
    fast = [r for rank, r in enumerate(ranks) if rank != slow]
    least = min(r["seconds_in_step"] for r in fast)
    if least < 0.25 * steps * delay:  # lenient: busy shared cores delay the fast ones too
        raise NotYet(f"{setup}: the right weights, yet a fast worker spent only {least:.2f}s in "
                     f"synchronous_step while worker {slow} was {steps * delay:.1f}s late in "
                     f"all: where did its gradient come from?")
    return (f"{world} workers stay identical and equal to one process (max diff {diff:.1e}); "
            f"the fast ones spent {least:.2f}s or more in the step, waiting for worker {slow} "
            f"({steps * delay:.1f}s late in all), as a synchronous step must")
