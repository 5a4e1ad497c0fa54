"""Exercise 18: write the 1F1B schedule yourself, as a list of actions per rank.

Lesson 18 drew each schedule's timeline from the actions its ranks ran: (stage, "F" or "B",
micro-batch), in order. Below, `schedule(p, m)` returns GPipe's actions for p ranks (one stage
each, stage r on rank r) and m micro-batches: every forward, then every backward. It works, but
each stage holds the activations of all m micro-batches at once before its first backward.

Your task: change `schedule(p, m)` into 1F1B. Stage r first runs a few forwards (warm-up),
then alternates one forward and one backward, then finishes the backwards (cool-down), so it
never holds more than p - r micro-batches (and never more than m). The check runs your lists
through pipeline.timeline, as the lesson does: every forward and backward exactly
once, in an order that cannot wait forever, at most p - r micro-batches held on stage r, and
idle time equal to GPipe's (p-1)/(m+p-1): 1F1B saves memory, not time.
Hint: how many forwards must stage r run before the first backward can come back to it?
Lesson 18, Step 6 (the 1f1b timeline), and docs/18_pipeline_schedules.md.

Check it:  make check-18
"""


def schedule(p: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """{rank: [(stage, "F" or "B", micro-batch), ...]} in the order each rank runs them."""
    actions = {}
    for r in range(p):
        forwards = [(r, "F", i) for i in range(m)]
        backwards = [(r, "B", i) for i in range(m)]
        actions[r] = forwards + backwards  # TODO: interleave them, 1F1B
    return actions
