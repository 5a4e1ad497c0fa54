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


def _parts(q, k, v, cuts):
    """[(out, lse) of q over each block of keys and values between the cuts], (out, lse) over all."""
    def attend(kk, vv):
        s = q @ kk.transpose(-2, -1)
        lse = s.logsumexp(-1, keepdim=True)
        return (s - lse).exp() @ vv, lse

    edges = [0, *cuts, k.shape[-2]]
    blocks = [attend(k[..., a:b, :], v[..., a:b, :]) for a, b in zip(edges, edges[1:])]
    return blocks, attend(k, v)


def _rank_21(rank: int, world: int, path: str) -> dict:
    from check_exercise import load

    import ring_attention
    import ring_measure
    from common import transformer as T

    class Quiet:
        def print(self, *args, **kwargs):
            pass

    ring_attention.merge = load(Path(path)).merge  # the ring calls merge() for every tile
    rings = {layout: ring_attention.Ring(layout, rank, world, T.SEQ) for layout in ("contiguous", "balanced")}
    return ring_measure.check_against_sdpa(rings, 0, "cpu", Quiet())["attention_diffs"]


def check(path: Path) -> str:
    """Partial attentions merged as one softmax, stable for large scores; inside lesson 21's ring."""
    from check_exercise import NotYet, load, run_world

    import torch

    merge = load(path).merge
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (5, 16, 16))  # 5 queries, 16 keys
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    for scale, cuts in ((1.0, [6]), (1.0, [3, 4, 11]), (100.0, [6]), (100.0, [3, 4, 11])):
        blocks, (whole, whole_lse) = _parts(q * scale, k, v, cuts)
        top = (q * scale @ k.transpose(-2, -1)).abs().max().item()
        out, lse = torch.zeros_like(whole), torch.full_like(whole_lse, float("-inf"))  # the ring's start
        try:
            for out_b, lse_b in blocks:
                out, lse = merge(out, lse, out_b, lse_b)
        except Exception as exc:
            raise NotYet(f"merge raised {type(exc).__name__}: {exc}") from None
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor) or out.shape != whole.shape \
                or lse.shape != whole_lse.shape:
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
    for world in (2, 4):
        ranks = run_world(world, _rank_21, (str(path),), path)
        worst = max(d[0] for r in ranks for d in r.values())
        if worst > 1e-5:
            raise NotYet(f"inside lesson 21's ring on {world} ranks, the attention output is {worst:.1e} "
                         f"away from F.scaled_dot_product_attention on the whole sequence")
    return ("blocks of keys merged one after another give softmax attention over all of them, large "
            "scores included; inside lesson 21's ring on 2 and 4 ranks, both layouts, the output is "
            "F.scaled_dot_product_attention's")
