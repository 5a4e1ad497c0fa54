"""Check exercise 24: outer_step, DiLoCo's outer step (average the pseudo-gradients, step Nesterov).

On 2 and then 3 gloo ranks every rank starts from the same small model and the same outer
weights, with torch's SGD(lr 0.7, momentum 0.9, nesterov=True) over them. Two rounds: each rank
moves its model by its own noise (its "inner steps", different on every rank), then calls the
learner's outer_step. The weights after each round are compared with the formula computed here,
and with the usual mistakes (no all-reduce, a sum without the division, the sign turned round);
the collectives are counted by apparatus/comm.py's CommLog (the package's one counter).
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/24_outer_step.py"
WORLDS = (2, 3)  # numbers of ranks, each run in turn in one answer process
ROUNDS = 2  # two outer steps: the second one uses the momentum of the first


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _noise(rank: int, rnd: int, shapes) -> list:
    """What rank `rank`'s inner steps did to its weights in round `rnd`: the same wherever made."""
    import torch

    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return [torch.randn(s, generator=g) * 0.1 for s in shapes]


def _optimizer(outer):
    import torch

    return torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)


def _rank_24(rank: int, world: int, path: str) -> dict:
    import torch

    from apparatus.comm import CommLog
    from check_exercise import load

    module = load(Path(path))  # in the answer's ranks: what they return is compared in check()
    model = _model()
    outer = [p.detach().clone() for p in model.parameters()]
    optimizer, log, rounds = _optimizer(outer), CommLog(), []
    for rnd in range(ROUNDS):
        with torch.no_grad():
            for p, n in zip(model.parameters(), _noise(rank, rnd, [p.shape for p in model.parameters()])):
                p.add_(n)
        calls = len(log.calls)
        with log.recording():
            module.outer_step(model, outer, optimizer)
        rounds.append({"model": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                       "outer": torch.cat([o.detach().flatten() for o in outer]).tolist(),
                       "calls": [(c.kind, c.data_bytes) for c in log.calls[calls:]]})
    return {"rounds": rounds}


def _expected(world: int, how: str, rank: int = 0) -> list:
    """The outer weights after each round when the average is taken `how`: right (the mean),
    own (this rank's pseudo-gradient only), sum (no division), flipped (theta_end - theta_start)."""
    import torch

    outer = [p.detach().clone() for p in _model().parameters()]
    optimizer, out = _optimizer(outer), []
    for rnd in range(ROUNDS):
        shapes = [o.shape for o in outer]
        pseudo = {r: [-n for n in _noise(r, rnd, shapes)] for r in range(world)}  # start - (start + noise)
        for i, o in enumerate(outer):
            total = sum(pseudo[r][i] for r in range(world))
            o.grad = {"right": total / world, "own": pseudo[rank][i], "sum": total, "flipped": -total / world}[how]
        optimizer.step()
        out.append(torch.cat([o.detach().flatten() for o in outer]))
    return out


def _on_ranks(module, worlds: list) -> dict:
    """In the answer's process: _rank_24 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_24, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """The pseudo-gradients averaged over every rank, then one Nesterov step, on every replica."""
    import torch

    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    every = answer(path, _on_ranks, WORLDS, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        # the learner's outer_step runs in the answer's ranks; the formula is computed here
        ranks = every[world]
        if not (isinstance(ranks, list) and len(ranks) == world and all(
                isinstance(r, dict) and len(r.get("rounds", ())) == ROUNDS for r in ranks)):
            raise NotYet(f"with {world} ranks, the ranks did not return their {ROUNDS} rounds")
        setup = f"with {world} ranks"
        n_params = len(ranks[0]["rounds"][0]["outer"])
        for rnd in range(ROUNDS):
            for rank, r in enumerate(ranks):
                got = torch.tensor(r["rounds"][rnd]["outer"])
                model = torch.tensor(r["rounds"][rnd]["model"])
                if (got - model).abs().max() > 1e-6:
                    raise NotYet(f"{setup}, after outer step {rnd + 1} rank {rank}'s model is not at the outer "
                                 f"weights: copy the new outer weights into the model, so that every replica "
                                 f"starts the next round from them")
                close = lambda how: (got - _expected(world, how, rank)[rnd]).abs().max().item() < 1e-5  # noqa: E731
                if close("right"):
                    continue
                if close("own"):
                    spread = max((torch.tensor(q["rounds"][rnd]["outer"]) - got).abs().max().item() for q in ranks)
                    raise NotYet(f"{setup}, rank {rank} stepped with its own pseudo-gradient: after outer step "
                                 f"{rnd + 1} the replicas' weights are {spread:.2g} apart. Average it over the "
                                 f"ranks first: dist.all_reduce (a sum), then divide by the world size")
                if close("sum"):
                    raise NotYet(f"{setup}, the outer step used the SUM of the {world} pseudo-gradients: "
                                 f"dist.all_reduce adds them up; divide by the world size for the average")
                if close("flipped"):
                    raise NotYet(f"{setup}, the weights moved the wrong way: the pseudo-gradient is "
                                 f"theta_start - theta_end (outer minus model), like a gradient it points "
                                 f"uphill, and the optimizer subtracts it")
                want = _expected(world, "right", rank)[rnd]
                raise NotYet(f"{setup}, after outer step {rnd + 1} rank {rank}'s outer weights are "
                             f"{(got - want).abs().max().item():.3g} away from the formula: o.grad = the "
                             f"average of theta_start - theta_end, then outer_optimizer.step(), once per call")
        for rnd in range(ROUNDS):
            calls = ranks[0]["rounds"][rnd]["calls"]
            kinds = {kind for kind, _ in calls}
            sent = sum(size for _, size in calls)
            if kinds != {"all_reduce"} or sent != 4 * n_params:
                raise NotYet(f"{setup}, the weights are right, but outer step {rnd + 1} made these collectives: "
                             f"{', '.join(f'{k} of {b} bytes' for k, b in calls)}; one all-reduce of the "
                             f"{n_params} float32 pseudo-gradient values ({4 * n_params} bytes) does it")
    return ("on 2 and 3 ranks, two outer steps: the pseudo-gradients averaged by all-reduce, one Nesterov "
            "step, every replica at the same new weights")
