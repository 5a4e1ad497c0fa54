"""Exercise 23: the bytes rank 0 holds, worked out before any rank exists.

Lesson 23 measured them on rank 0 of a fake process group. Work them out from the shapes
alone, as lesson 19's planner does when it is given them:

    shapes   {name: shape} of the whole model's parameters, e.g. "blocks.0.attn.q.weight": (64, 64)
    dp, tp   the mesh: dp ranks across the data (FSDP2), tp across each block (tensor parallel)
    returns  the fp32 bytes of the parameters rank 0 holds (an int)

What happens to each parameter, in lesson 19's order:
  1. tensor parallel: ColwiseParallel splits dim 0 of attn.q, attn.k, attn.v and mlp.fc (weight
     and bias) into tp parts; RowwiseParallel splits dim 1 of attn.proj.weight and
     mlp.proj.weight; every other parameter (embeddings, norms, the head, the two proj biases)
     stays whole on every tp rank.
  2. FSDP2 splits dim 0 of what a rank then holds into dp chunks, as torch.chunk does: rank 0
     gets ceil(rows / dp) rows (a tensor of 3 rows on 4 ranks: one row each for ranks 0-2).

Below, every parameter divided evenly over all dp x tp ranks (parameters x 4 / 1,024 for the 1b
model on 1,024 ranks): half of what rank 0 holds there, since tensor parallel leaves the
embeddings and the head whole (step 1), and wrong for the tiny model too. Make it right.
Hint: lesson 23, Step 6 (its last lines), and docs/23_cluster_on_a_laptop.md, Steps 3 and 6.

Check it:  make check-23   (the tiny model on a 2 x 2 mesh and on a 256 x 4 one, against lesson
                            23's own measurement under the fake process group)
"""
import math


COLWISE = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc.")  # weight and bias: dim 0 split across tp
ROWWISE = ("attn.proj.weight", "mlp.proj.weight")    # dim 1 split across tp


def rank0_bytes(shapes: dict[str, tuple[int, ...]], dp: int, tp: int) -> int:
    total = 0
    for name, shape in shapes.items():
        rows, cols = shape[0], math.prod(shape[1:])  # a bias: cols is 1
        if any(part in name for part in COLWISE):
            rows //= tp
        elif any(part in name for part in ROWWISE):
            cols //= tp
        total += math.ceil(rows / dp) * cols  # FSDP2: rank 0's chunk of dim 0
    return 4 * total
