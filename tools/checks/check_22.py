"""Check exercise 22: dispatch, the all-to-all that takes every row to the rank of its expert.

On 2 and then 4 gloo ranks (E = 2N experts, 2 per rank) every rank makes its own rows, a
different number on each rank, sorted by expert; rank 0 sends nothing to the last rank, so one
split is empty. Each row holds (source rank, its index, its expert), so the check can tell
where every row landed. The learner's dispatch(rows, expert, E) must deliver exactly the rows
for each rank's experts, rank 0's first, each rank's in the order sent, with the counts; its
collectives are counted by apparatus/comm.py's CommLog (the package's one counter).
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/22_dispatch.py"
WORLDS = (2, 4)  # numbers of ranks, each run in turn in one answer process


def _rows(rank: int, world: int):
    """Rank `rank`'s rows and experts, the same wherever they are made: (m, 3) and (m,)."""
    import torch

    experts = 2 * world
    g = torch.Generator().manual_seed(100 + rank)
    m = 9 + 5 * rank
    top = experts - 2 if rank == 0 else experts  # rank 0: nothing for the last rank's experts
    expert = torch.randint(0, top, (m,), generator=g).sort().values
    rows = torch.stack([torch.full((m,), rank), torch.arange(m), expert], 1).float()
    return rows, expert


def _rank_22(rank: int, world: int, path: str) -> dict:
    """In the answer's ranks: the learner's dispatch of this rank's rows; what arrived, the
    counts and the collectives come back (the rows each rank should get are worked out by the
    check, from _rows, in its own process)."""
    import torch

    from apparatus.comm import CommLog
    from check_exercise import NotYet, load

    module = load(Path(path))
    rows, expert = _rows(rank, world)
    log = CommLog()
    with log.recording():
        got = module.dispatch(rows.clone(), expert.clone(), 2 * world)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise NotYet("dispatch must return two things: (received rows, recv_counts)")
    received, counts = got
    return {"received": torch.as_tensor(received).detach().tolist(),
            "counts": torch.as_tensor(counts).tolist(),
            "calls": [(c.kind, c.data_bytes) for c in log.calls]}


def _expected(rank: int, world: int) -> tuple[list, list]:
    """(the rows rank `rank` must receive, its recv_counts): rank 0's rows for its two experts
    first, then rank 1's ..., each in the order sent."""
    import torch

    mine = (2 * rank, 2 * rank + 1)
    expected = torch.cat([r[(e == mine[0]) | (e == mine[1])] for r, e in (_rows(s, world) for s in range(world))])
    counts = [int((_rows(s, world)[1] == j).sum()) for s in range(world) for j in mine]
    return expected.tolist(), counts


def _on_ranks(module, worlds: list) -> dict:
    """In the answer's process: _rank_22 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_22, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """Every row reaches the rank of its expert, in order, after the counts; two all-to-alls."""
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    every = answer(path, _on_ranks, WORLDS, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        ranks = every[world]
        setup = f"with {world} ranks and {2 * world} experts"
        for rank, r in enumerate(ranks):
            expected, want_counts = _expected(rank, world)
            got = [tuple(int(v) for v in row) for row in r["received"]]
            want = [tuple(int(v) for v in row) for row in expected]
            if sorted(got) != sorted(want):
                strangers = sorted({s for s, _, _ in want if s != rank})
                if all(s == rank for s, _, _ in got) and strangers:
                    raise NotYet(f"{setup}, rank {rank} received {len(got)} rows, all its own; "
                                 f"{'rank' if len(strangers) == 1 else 'ranks'} {', '.join(map(str, strangers))} "
                                 f"had {len(want) - len(got)} more for its "
                                 f"experts. The rows never left their rank: send them with "
                                 f"dist.all_to_all_single, after telling each rank how many are coming")
                raise NotYet(f"{setup}, rank {rank} received {len(got)} rows, {len(want)} expected "
                             f"(rows for its experts {2 * rank} and {2 * rank + 1} from every rank): are "
                             f"the split sizes the counts per destination rank, input for what you send, "
                             f"output for what arrives?")
            if got != want:
                raise NotYet(f"{setup}, rank {rank} received the right rows in the wrong order: rank 0's "
                             f"first, then rank 1's, ..., each in the order it was sent (the split "
                             f"sizes are in rank order too)")
            if r["counts"] != want_counts:
                raise NotYet(f"{setup}, rank {rank}'s recv_counts are {r['counts']}, expected "
                             f"{want_counts}: entry s * E/N + j counts the rows rank s sent to our "
                             f"j-th expert, which is what the first all-to-all of the counts delivers")
        calls = [tuple(c) for c in ranks[0]["calls"]]
        kinds = [kind for kind, _ in calls]
        if kinds != ["all_to_all", "all_to_all"]:
            raise NotYet(f"{setup}, every row arrived, but rank 0 made these collectives: "
                         f"{', '.join(kinds) or 'none'}; two all-to-alls do it: the counts, then the rows")
        if calls[0][1] != 2 * world * 8:
            raise NotYet(f"{setup}, the first all-to-all carried {calls[0][1]} bytes; the counts are "
                         f"{2 * world} int64 values, {2 * world * 8} bytes: send the counts first, then the rows")
    return ("on 2 and 4 ranks, uneven and empty splits included, every row reached the rank of its "
            "expert in order, with two all-to-alls: the counts, then the rows")
