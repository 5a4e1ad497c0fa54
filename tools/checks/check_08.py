"""Check exercise 08: gradient accumulation with one all-reduce per optimizer step.

The learner's accumulate(ddp_model, optimizer, micro_batches, accum) trains lesson 08's DDP
model on 2 ranks, 6 global batches of the recipe, split into 4 and then 2 micro-batches per
rank and step. DDP's all-reduces in each of the learner's backward passes are counted by
apparatus/comm.py (counted_ddp + CommLog, the package's one counter, as lesson 08 counts
them), and the weights compared with recipe.train_reference's first 6 steps: one process,
each global batch of 96 at once.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/08_accumulate.py"


def _rank_08(rank: int, world: int, path: str, accums: tuple, steps: int) -> list:
    """Build lesson 08's DDP model with its all-reduces counted and let the learner's loop
    train it, once for each number of micro-batches per step in `accums`."""
    import torch

    from accumulation import syncs
    from apparatus.comm import CommLog, counted_ddp
    from check_exercise import load
    from common import recipe

    module = load(Path(path))
    x_all, y_all = recipe.synthetic_data()[0].tensors
    order = torch.tensor(recipe.epoch_order(len(y_all), recipe.SEED, 0))
    per_rank = recipe.GLOBAL_BATCH // world
    runs = []
    for accum in accums:
        micro = per_rank // accum
        batches = []
        for k in range(steps):  # rank r's share of global batch k, as DistributedSampler deals it
            mine = order[k * recipe.GLOBAL_BATCH + rank:(k + 1) * recipe.GLOBAL_BATCH:world]
            batches += [(x_all[mine[m * micro:(m + 1) * micro]],
                         y_all[mine[m * micro:(m + 1) * micro]]) for m in range(accum)]
        model = recipe.make_model(recipe.SEED)
        ddp_model = counted_ddp(model)  # lesson 08's DDP; CommLog sees its buckets
        optimizer = recipe.make_optimizer(ddp_model)
        stepped = [0]
        optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
        log = CommLog()
        # only DDP's calls inside the learner's backward passes count; the head's bias gets
        # the first gradient of every backward
        with log.recording(), log.backwards(model.head.bias):
            module.accumulate(ddp_model, optimizer, batches, accum)
        del ddp_model, optimizer
        synced = syncs(log)  # per backward that all-reduced: its bucket calls
        runs.append({"calls": sum(map(len, synced)), "syncs": len(synced), "steps": stepped[0],
                     "micro_batches": len(batches),
                     "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return runs


def _on_ranks(module, world: int, accums: tuple, steps: int) -> list:
    """In the answer's process: _rank_08 on `world` ranks; their results, by rank."""
    from check_exercise import run_world

    return run_world(world, _rank_08, (module.__file__, accums, steps), Path(module.__file__))


def check(path: Path) -> str:
    """One all-reduce per optimizer step, and the weights of training without accumulation."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer, max_diff
    from common import recipe

    world, steps, accums = 2, 6, (4, 2)
    # the learner's loop runs in the answer's ranks; the reference is trained here
    ranks = answer(path, _on_ranks, world, accums, steps, limit_s=WORLD_TIMEOUT_S + 30)
    reference = recipe.train_reference(epochs=1, steps=steps)  # one process, no accumulation
    for i, accum in enumerate(accums):
        runs = [r[i] for r in ranks]
        setup = (f"{world} ranks, {steps} global batches of 96, {accum} micro-batches of "
                 f"{96 // world // accum} per rank and step")
        r0 = runs[0]
        if r0["steps"] != steps:
            raise NotYet(f"{setup}: the optimizer stepped {r0['steps']} times for "
                         f"{r0['micro_batches']} micro-batches; it should step once every "
                         f"{accum} of them, {steps} times in all")
        spread = max(max_diff(r["weights"], r0["weights"]) for r in runs)
        if spread > 0:
            raise NotYet(f"{setup}: the ranks' weights differ by up to {spread:.1e}: some step "
                         f"used a gradient that was never all-reduced")
        if r0["syncs"] != steps:
            raise NotYet(f"{setup}: DDP all-reduced the gradients {r0['syncs']} times "
                         f"({r0['calls']} bucket calls) for {steps} optimizer steps; it should be "
                         f"once per step. Which backward passes should sync, and where does "
                         f"DDP decide that? (lesson 08, Steps 5 and 6)")
        diff = max_diff(r0["weights"], reference)
        if diff > 1e-5:
            raise NotYet(f"{setup}: one all-reduce per step, but the weights are {diff:.1e} away "
                         f"from one process training on each global batch of 96 at once (allowed: "
                         f"1e-5). Compare the accumulated gradient with the big batch's: what "
                         f"does each micro-batch's loss average over? (lesson 08, Step 6)")
    return (f"{world} ranks, 4 and 2 micro-batches per step: one all-reduce per optimizer step, "
            f"and the weights of training without accumulation (max diff {diff:.1e})")
