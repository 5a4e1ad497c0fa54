"""Exercise 25: what a redistribution sends, worked out before any rank runs it.

Predict, for a float32 tensor of shape (rows, cols) on a 1-D mesh of `world` ranks, on gloo,
the collective DTensor runs for src -> dst and the bytes one rank sends (lesson 10's ring
shares). Lesson 25, Step 3; the reasons are in docs/25_dtensor.md.

Check it:  make check-25
"""
import math

SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n}


def cost(src: str, dst: str, shape: tuple[int, int], world: int) -> tuple[str, float]:
    """(the collective that runs, the bytes one rank sends) for src -> dst on `world` ranks."""
    if src == dst or world == 1 or src == "R" or dst == "P(sum)":
        return ("none", 0.0)  # R -> S: keep our chunk; S -> P: our piece in zeros
    padded = list(shape)

    def pad(dim: int) -> None:  # torch.chunk's pieces, each padded to the first one's size
        padded[dim] = math.ceil(shape[dim] / world) * world

    if src == "P(sum)" and dst == "R":
        kind = "all_reduce"  # the whole tensor, nothing split: no padding
    elif src == "P(sum)":
        kind = "reduce_scatter"  # S: the padded tensor before it is scattered
        pad(int(dst[2]))
    else:
        kind = "all_gather"  # S: the padded gathered tensor
        pad(int(src[2]))
        if dst != "R":  # Shard -> Shard on gloo: all-gather, keep our chunk; both dims padded
            pad(int(dst[2]))
    return (kind, SHARE[kind](world) * 4 * math.prod(padded))
