"""Exercise 25: what a redistribution sends, worked out before any rank runs it.

Lesson 25, Step 3, ran every redistribution of one 8 x 8 tensor on a 1-D mesh and counted what
ran and what rank 0 sent. Predict the same for any float32 tensor of two dimensions on a 1-D
mesh of `world` ranks, run on gloo as the lesson ran it:

    src, dst  placements, as DTensor prints them: "S(0)", "S(1)", "R" (Replicate()) or "P(sum)"
              (Partial(): each rank holds a summand); never "R" -> "P(sum)" (redistribute refuses)
    shape     (rows, cols) of the whole tensor: any sizes, also ones `world` does not divide
    world     2 or 4 ranks
    returns   (collective, bytes): the collective that ran ("all_gather", "all_reduce",
              "reduce_scatter", "all_to_all", or "none" when each rank works alone) and the bytes
              one rank sends, counted as lesson 10 counts a ring (apparatus/comm.py's SHARE):
              all-reduce 2(N-1)/N x S; all-gather, reduce-scatter and all-to-all (N-1)/N x S, with
              S the gathered output, the tensor before it is scattered, this rank's input

Three things the lesson measured that the textbook table does not say:
  1. On a CPU mesh, DTensor plans an all-to-all for Shard(i) -> Shard(j) but runs an all-gather
     and keeps its chunk (torch's shard_dim_alltoall): that all-gather is what ran.
  2. A dimension that `world` does not divide is split as torch.chunk splits it (7 rows on 4
     ranks: 2, 2, 2, 1), and every piece is padded to the largest, ceil(rows / world) rows,
     before it is gathered or scattered: the padded bytes are what travel.
  3. Shard -> Shard pads both dimensions: the one it was split along and the one it will be.

Below, the starter knows the all-gather of an even Shard -> Replicate and nothing else.
Hint: lesson 25, Step 3 (the table, the all-to-all line, the 7 rows), docs/25_dtensor.md.

Check it:  make check-25   (4 gloo ranks run each of your cases for real, on meshes of 4 and 2
                            ranks, and count what ran with apparatus/comm.py's CommLog)
"""
import math


def cost(src: str, dst: str, shape: tuple[int, int], world: int) -> tuple[str, float]:
    """(the collective that runs, the bytes one rank sends) for src -> dst on `world` ranks."""
    whole = 4 * math.prod(shape)  # float32: 4 bytes an element
    if src == dst:
        return ("none", 0.0)
    if src.startswith("S") and dst == "R":
        return ("all_gather", (world - 1) / world * whole)
    # TODO: Partial -> Replicate, Partial -> Shard, Shard -> Shard on gloo, the moves that send
    # nothing, and the padding when `world` does not divide the split dimension
    return ("all_gather", (world - 1) / world * whole)
