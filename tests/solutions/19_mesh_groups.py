"""Reference solution of exercises/19_mesh_groups.py (used by the tests)."""


def groups(rank: int, dp: int, tp: int) -> tuple[list[int], list[int]]:
    """(dp group, tp group) of `rank` on a (dp, tp) mesh of dp * tp ranks."""
    row, col = divmod(rank, tp)  # rank = dp_index * tp + tp_index
    return [d * tp + col for d in range(dp)], [row * tp + t for t in range(tp)]
