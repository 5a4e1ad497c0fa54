"""Check exercise 16: where each piece of a tensor lies in a DCP checkpoint.

Three gloo ranks shard a small model with fully_shard (10 and 4 rows over 3 ranks: uneven
pieces) and save it with dcp.save; each rank reports the rows of each tensor it holds. The
learner's shards_of(folder, key), reading only the checkpoint, must name the same pieces.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/16_where_are_my_shards.py"
WORLD = 3


def _rank_16(rank: int, world: int, folder: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    fully_shard(model, mesh=dist.init_device_mesh("cpu", (world,)))
    state = get_model_state_dict(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder)
    mine = {}
    for key, t in state.items():
        rows, local = t.shape[0], t.to_local().shape
        start = rank * -(-rows // world)  # torch.chunk: ceil(rows / N) rows each, in rank order
        mine[key] = (f"__{rank}_0.distcp", (start, *[0] * (len(local) - 1)), tuple(local))
    return mine


def _pieces(module, folder: str, keys: list) -> dict:
    """In the answer's process: {key: the learner's shards_of(folder, key), as plain tuples}."""
    from check_exercise import NotYet

    out = {}
    for key in keys:
        try:
            out[key] = [(str(f), tuple(int(o) for o in off), tuple(int(s) for s in size))
                        for f, off, size in module.shards_of(Path(folder), key) if all(size)]
        except Exception as exc:
            raise NotYet(f"shards_of(folder, {key!r}) failed: {type(exc).__name__}: {exc}")
    return out


def check(path: Path) -> str:
    """Name, for each tensor, the file, offsets and shape of every piece the ranks saved."""
    from check_exercise import NotYet, answer, run_world

    with tempfile.TemporaryDirectory() as folder:
        ranks = run_world(WORLD, _rank_16, (folder,), path)  # the check's own ranks save it
        answers = answer(path, _pieces, folder, list(ranks[0]))  # the learner's code reads it
    for key in ranks[0]:
        want = sorted((r[key] for r in ranks if all(r[key][2])), key=lambda p: p[1])
        got = [tuple(piece) for piece in answers[key]]
        if got != want:
            raise NotYet(f"{WORLD} ranks saved {key} in {len(want)} pieces {want}; your "
                         f"shards_of says {got}. Each chunk in .metadata's "
                         f"state_dict_metadata[key].chunks is one piece; storage_data says "
                         f"in which file it lies")
    return (f"on {WORLD} ranks every tensor's pieces are where you said: e.g. {key} in "
            f"{', '.join(f'{f} rows {o[0]}-{o[0] + s[0] - 1}' for f, o, s in want)}")
