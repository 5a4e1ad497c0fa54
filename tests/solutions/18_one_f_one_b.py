"""Exercise 18, a solution: 1F1B as a list of actions per rank."""


def schedule(p: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """{rank: [(stage, "F" or "B", micro-batch), ...]} in the order each rank runs them."""
    actions = {}
    for r in range(p):
        warm = min(p - 1 - r, m)  # forwards in flight before the first backward comes back
        acts = [(r, "F", i) for i in range(warm)]
        for i in range(m - warm):  # steady state: one forward, one backward
            acts += [(r, "F", warm + i), (r, "B", i)]
        actions[r] = acts + [(r, "B", i) for i in range(m - warm, m)]  # cool-down
    return actions
