"""Exercise 19: who talks to whom on a 2-D mesh.

Lesson 19 lays its ranks out as init_device_mesh(device, (D, T), mesh_dim_names=("dp",
"tp")) does: row-major, the last dimension fastest, so rank = dp_index * T + tp_index.
A rank talks to two groups:

    its tp group: the T ranks of its row, which split every block (tensor parallel) and
                  read the same rows of the batch;
    its dp group: the D ranks of its column, which hold the same tensor-parallel shard and
                  shard it further with FSDP2 (reduce-scatter, all-gather).

Write groups(rank, dp, tp): (the global ranks of its dp group, of its tp group), each in
increasing order. The starter below returns the whole world for both: wrong as soon as
both dimensions are larger than 1. Why does it matter? Lesson 19, Step 3: the tp group
must be neighbours (one node's GPUs), or every block's all-reduces cross the slow network.
Hint: lesson 19, Step 3 ("Who talks to whom"), and docs/19_two_d_mesh.md.

Check it:  make check-19   (4 gloo ranks build real meshes of shape 2x2, 1x4 and 4x1
                            and compare each rank's groups with your answer)
"""


def groups(rank: int, dp: int, tp: int) -> tuple[list[int], list[int]]:
    """(dp group, tp group) of `rank` on a (dp, tp) mesh of dp * tp ranks."""
    everyone = list(range(dp * tp))
    return everyone, everyone  # TODO: only the rank's column (dp) and its row (tp)
