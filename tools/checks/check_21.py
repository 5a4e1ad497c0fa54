"""Check exercise 21: merge, the online-softmax rule that joins ring attention's partial results.

First in this process: random queries against 16 keys cut into blocks (2 blocks, then 4 of
uneven sizes merged one after another from the ring's start, out = 0 and lse = -inf); the
merged output and lse are compared with softmax attention over all the keys, then again with
scores near 1000, where exp() alone overflows. Then the learner's merge replaces lesson 21's
own inside its ring attention (lessons/21_context_parallel/ring_attention.py) on 2 and 4 gloo
ranks, both layouts, against F.scaled_dot_product_attention on the whole sequence.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/21_online_softmax.py"
WORLDS = (2, 4)  # numbers of ranks, each run in turn in one answer process


CASES = ((1.0, [6]), (1.0, [3, 4, 11]), (100.0, [6]), (100.0, [3, 4, 11]))  # (score scale, cuts)


def _qkv():
    import torch

    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, n, 8, generator=g) for n in (5, 16, 16))  # 5 queries, 16 keys


def _attend(q, k, v):
    s = q @ k.transpose(-2, -1)
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp() @ v, lse


def _merged(module) -> list:
    """In the answer's process: the learner's merge over each case's blocks of keys, from the
    ring's start (out = 0, lse = -inf). Attention over all the keys is computed by the check."""
    import torch

    from check_exercise import NotYet

    merge = module.merge
    q, k, v = _qkv()
    out_all = []
    for scale, cuts in CASES:
        edges = [0, *cuts, k.shape[-2]]
        blocks = [_attend(q * scale, k[..., a:b, :], v[..., a:b, :]) for a, b in zip(edges, edges[1:])]
        out = torch.zeros_like(blocks[0][0])
        lse = torch.full_like(blocks[0][1], float("-inf"))  # the ring's start
        try:
            for out_b, lse_b in blocks:
                out, lse = merge(out, lse, out_b, lse_b)
        except Exception as exc:
            raise NotYet(f"merge raised {type(exc).__name__}: {exc}") from None
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise NotYet("merge must return (out, lse), two tensors shaped as the ones it was given")
        out_all.append((out.detach().clone(), lse.detach().clone()))
    return out_all


def _rank_21(rank: int, world: int, path: str) -> dict:
    """In the answer's ranks: lesson 21's ring with the learner's merge, both layouts; each
    rank's output gathered back into place (the check computes SDPA on the whole sequence)."""
    from check_exercise import load

    import ring_attention
    import ring_measure
    from common import transformer as T

    ring_attention.merge = load(Path(path)).merge  # the ring calls merge() for every tile
    q, k, v = _ring_inputs()
    out = {}
    for layout in ("contiguous", "balanced"):
        ring = ring_attention.Ring(layout, rank, world, T.SEQ)
        mine = [t[:, :, ring.mine] for t in (q, k, v)]
        out[layout] = ring_measure.gather(ring_attention.RingAttention.apply(*mine, ring).detach(), ring)
    return out


def _ring_inputs(batch: int = 4):
    """The same random q, k, v on every rank (one seed), each (batch, heads, SEQ, HEAD_DIM)."""
    import torch

    from common import transformer as T

    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, T.N_HEADS, T.SEQ, T.HEAD_DIM, generator=g) for _ in range(3)]


def _on_ranks(module, worlds: list) -> dict:
    """In the answer's process: _rank_21 on each number of ranks in `worlds`, one run after the
    other (one process for all of them, which forks their ranks): {world: results by rank}."""
    from check_exercise import run_worlds

    return run_worlds(worlds, _rank_21, (module.__file__,), Path(module.__file__))


def check(path: Path) -> str:
    """Partial attentions merged as one softmax, stable for large scores; inside lesson 21's ring."""
    import torch
    import torch.nn.functional as F

    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer

    q, k, v = _qkv()
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    for (scale, cuts), (out, lse) in zip(CASES, answer(path, _merged), strict=True):
        whole, whole_lse = _attend(q * scale, k, v)  # softmax attention over all the keys, here
        top = (q * scale @ k.transpose(-2, -1)).abs().max().item()
        if out.shape != whole.shape or lse.shape != whole_lse.shape:
            raise NotYet("merge must return (out, lse), two tensors shaped as the ones it was given")
        keys = f"{len(cuts) + 1} blocks of the 16 keys (sizes {', '.join(str(b - a) for a, b in zip([0, *cuts], [*cuts, 16]))})"
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            raise NotYet(f"with scores up to {top:.0f}, merging {keys} gives inf or nan: exp() of "
                         f"anything above about 88.7 overflows float32. The weights only need the "
                         f"differences of the lse values: subtract the larger lse before exp()" if scale > 1 else
                         f"merging {keys} from the ring's start (out = 0, lse = -inf: no keys yet) gives inf "
                         f"or nan: with lse = -inf, the first part's weight must come out 0, not nan")
        if rel(out, whole) > 1e-5:
            raise NotYet(f"merging {keys} from the ring's start (out = 0, lse = -inf) gives an output "
                         f"{rel(out, whole):.1e} (relative) away from softmax attention over all the keys"
                         + (": a plain average weighs every block alike, but each block counts as its "
                            "share of the softmax's mass, exp(lse) of it, out of the total" if len(cuts) == 1 else
                            ": right for one merge, wrong after several? The lse you return is the next "
                            "merge's input: it must be log(sum(exp(scores))) over every key merged so far"))
        lse_off = ((lse - whole_lse).abs() / whole_lse.abs().clamp(min=1)).max().item()  # relative
        if lse_off > 1e-5:
            raise NotYet(f"merging {keys}, the output is right but the lse is "
                         f"{lse_off:.1e} (relative) away from log(sum(exp(scores))) over "
                         f"all the keys: the next block would be weighed wrongly")
    expected = F.scaled_dot_product_attention(*_ring_inputs(), is_causal=True)  # one process
    every = answer(path, _on_ranks, WORLDS, limit_s=len(WORLDS) * WORLD_TIMEOUT_S + 30)
    for world in WORLDS:
        ranks = every[world]
        worst = max((out - expected).abs().max().item() for r in ranks for out in r.values())
        if worst > 1e-5:
            raise NotYet(f"inside lesson 21's ring on {world} ranks, the attention output is {worst:.1e} "
                         f"away from F.scaled_dot_product_attention on the whole sequence")
    return ("blocks of keys merged one after another give softmax attention over all of them, large "
            "scores included; inside lesson 21's ring on 2 and 4 ranks, both layouts, the output is "
            "F.scaled_dot_product_attention's")
