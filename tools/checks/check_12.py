"""Check exercise 12: distributed evaluation that counts every sample once.

The learner's distributed_accuracy(model, dataset) runs on 2 and on 3 ranks over 101
validation samples (which neither splits evenly), with the model recipe.train_reference
reaches after 4 steps; a forward pre-hook counts which samples each rank evaluated. Every
rank must return the single-process accuracy, each rank evaluating its own share.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/12_eval_accuracy.py"
WORLDS = (2, 3)  # numbers of ranks, each run in turn in one answer process

N_VAL = 101  # validation samples: neither 2 nor 3 ranks can split them evenly


def _rank_12(rank: int, world: int, path: str, weights: dict) -> dict:
    """The learner's evaluation on this rank; a hook on the model counts which validation
    samples this rank actually ran through it."""
    import torch
    from torch.utils.data import TensorDataset

    from check_exercise import load
    from common import recipe

    module = load(Path(path))
    model = recipe.make_model(recipe.SEED)
    model.load_state_dict(weights)
    model.eval()
    x, y = (t[:N_VAL] for t in recipe.synthetic_data()[1].tensors)
    row_of = {x[i].numpy().tobytes(): i for i in range(N_VAL)}  # every row is different
    seen = torch.zeros(N_VAL, dtype=torch.int64)

    def count(_module, inputs):
        for row in inputs[0].detach().reshape(len(inputs[0]), -1):
            i = row_of.get(row.contiguous().numpy().tobytes())
            if i is not None:
                seen[i] += 1
    model.register_forward_pre_hook(count)
    accuracy = module.distributed_accuracy(model, TensorDataset(x, y))
    return {"accuracy": float(accuracy), "seen": seen}


def _on_ranks(module, worlds: list, weights: dict) -> dict:
    """In the answer's process: _rank_12 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_12, (module.__file__, weights), Path(module.__file__))


def check(path: Path) -> str:
    """Distributed accuracy equals one process's, with each sample evaluated on one rank."""
    import torch

    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer, listed
    from common import recipe

    # a model part-way through training (one process, 4 steps): neither 0% nor 100%
    weights = recipe.train_reference(epochs=1, steps=4)
    model = recipe.make_model(recipe.SEED)
    model.load_state_dict(weights)
    x, y = (t[:N_VAL] for t in recipe.synthetic_data()[1].tensors)
    with torch.no_grad():
        right = int((model(x).argmax(1) == y).sum())
    truth = right / N_VAL
    every = answer(path, _on_ranks, WORLDS, weights, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        ranks = every[world]
        got = [r["accuracy"] for r in ranks]
        setup = f"{N_VAL} samples on {world} ranks"
        if max(got) - min(got) > 1e-12:
            raise NotYet(f"{setup}: the ranks returned different accuracies {got}; every rank "
                         f"should return the accuracy on the whole set")
        seen = torch.stack([r["seen"] for r in ranks])
        total = seen.sum(0)
        if abs(got[0] - truth) > 1e-6:
            twice = (total > 1).nonzero().flatten().tolist()
            never = (total == 0).nonzero().flatten().tolist()
            evidence = f"the ranks ran {int(total.sum())} predictions for {N_VAL} samples"
            if twice:
                evidence += f"; sample(s) {listed(twice)} more than once"
            if never:
                evidence += f"; sample(s) {listed(never)} never"
            raise NotYet(f"{setup}: every rank returned {got[0]:.4%}, one process measures "
                         f"{truth:.4%} ({right}/{N_VAL}); {evidence}. Which predictions should "
                         f"count, and how do per-rank numbers add up to one accuracy? "
                         f"(lesson 12, Step 8)")
        busiest = int(seen.sum(1).max())
        if busiest > -(-N_VAL // world) or (total == 0).any():
            raise NotYet(f"{setup}: the right accuracy, but one rank evaluated {busiest} of the "
                         f"{N_VAL} samples: split the work, so that each rank evaluates about "
                         f"1/{world} of them")
    return (f"{N_VAL} samples on 2 and on 3 ranks: every rank returns {truth:.4%}, exactly the "
            f"single-process accuracy, each rank evaluating its own share")
