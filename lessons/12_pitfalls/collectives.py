"""Step 5 of lesson 12: collectives pair up by order, on every rank, or hang (or lie).

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/collectives.py
    .venv/bin/python lessons/12_pitfalls/collectives.py --break collective-missing
    .venv/bin/python lessons/12_pitfalls/collectives.py --break collective-order
or as part of the whole lesson: make lesson-12 ARGS="--break collective-missing".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 5.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks (Steps 1, 2, 10) and this step only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import recipe
from apparatus.ui import Timer
from kit import collective, gather

STEP = 5
NAMES = ['collective-missing', 'collective-order']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # A collective is a meeting: it completes only when every rank calls it, and ranks match
    # calls by their *order*, not by name. A call on some ranks only (inside `if rank == 0:`)
    # waits for partners who never come; calls in different orders pair up wrongly: they
    # hang, or worse, silently swap values when the shapes agree.
    model = recipe.make_model(args.seed)
    order = recipe.epoch_order(len(data.train), args.seed, 0)[:recipe.GLOBAL_BATCH]
    x, y = data.train[order[rank::world_size]]
    with torch.no_grad():
        loss_sum = F.cross_entropy(model(x), y, reduction="sum").view(1)
        one_process = F.cross_entropy(model(data.train[order][0]), data.train[order][1]).item()
    count = torch.tensor([float(len(y))])
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    ui.print(f"TORCH_DISTRIBUTED_DEBUG={'DETAIL' if detail else 'OFF'}; each rank holds the loss "
             f"sum and the count of its {len(y)} samples")

    if args.brk == "collective-missing":
        ui.print("broken: all_reduce(loss_sum) inside `if rank == 0:`; the others go on to barrier()")
        if rank == 0:
            collective(ui, "all_reduce(loss_sum) (only rank 0 calls it)",
                       lambda: dist.all_reduce(loss_sum))
        collective(ui, "barrier()", dist.barrier)
        return  # not reached: a timeout (or DETAIL) ends both ranks above

    if args.brk == "collective-order":
        # (a) Two all_reduces of the same shape, swapped on the other ranks: they pair up
        # rank 0's loss_sum with rank 1's count. No error, no warning, even under DETAIL.
        a, b = loss_sum.clone(), count.clone()
        first, second = (a, b) if rank == 0 else (b, a)
        collective(ui, "all_reduce (first)", lambda: dist.all_reduce(first))
        collective(ui, "all_reduce (second)", lambda: dist.all_reduce(second))
        rows = gather([a.item(), b.item()])
        ui.print("broken (a): rank 0 all_reduces loss_sum then count, the others count then loss_sum")
        for r, (s, n) in enumerate(rows):
            ui.print(f"  rank {r}: loss_sum {s:9.4f}  count {n:7.2f}  mean loss {s / n:8.4f}")
        ui.print(f"  right:  loss_sum {one_process * recipe.GLOBAL_BATCH:9.4f}  count "
                 f"{recipe.GLOBAL_BATCH:7.2f}  mean loss {one_process:8.4f}   (no error was raised)")
        # (b) Two different collectives in a different order: they cannot pair up at all.
        ui.print("broken (b): rank 0 calls all_reduce(loss_sum) then broadcast(weights), "
                 "the others broadcast first")
        weights = model.head.weight.detach().clone()
        if rank == 0:
            collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
            collective(ui, "broadcast(weights)", lambda: dist.broadcast(weights, src=0))
        else:
            collective(ui, "broadcast(weights)", lambda: dist.broadcast(weights, src=0))
            collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
        return  # not reached

    timer = Timer()
    collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
    collective(ui, "all_reduce(count)", lambda: dist.all_reduce(count))
    collective(ui, "barrier()", dist.barrier)
    mean = loss_sum.item() / count.item()
    ui.print(f"fixed: every rank calls all_reduce(loss_sum), all_reduce(count), barrier() in this "
             f"order; done in {timer.seconds * 1000:.0f} ms")
    ui.print(f"mean loss over the global batch of {count.item():g}: {mean:.6f}; one process: "
             f"{one_process:.6f} (|difference| {abs(mean - one_process):.1e})")
    evidence["collectives"] = {"mean_loss": mean, "one_process_loss": one_process,
                               "count": count.item()}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "collective-missing": (
        "Symptom: the job froze until the process-group timeout, then each rank failed in a "
        "different collective (gloo: Timed out waiting ... for recv). Cause: all_reduce was "
        "called inside `if rank == 0:`, so rank 0 waited for partners who had gone on to a "
        "barrier, which in turn waited for rank 0. Fix: call every collective on every rank; "
        "if only rank 0 needs the result, let every rank compute it and only rank 0 print it. "
        "Set a timeout so that a hang becomes an error, and use TORCH_DISTRIBUTED_DEBUG=DETAIL "
        "(--debug-detail) to have the mismatch named at once."),
    "collective-order": (
        "Symptom: two all_reduces of the same shape in a different order returned wrong sums "
        "with no error at all; then an all_reduce on one rank met a broadcast on the other and "
        "both hung until the timeout. Cause: ranks pair collectives by their position in the "
        "sequence, not by their name or variable; gloo cannot tell two same-shaped all_reduces "
        "apart. Fix: make every rank issue the same collectives in the same order (no "
        "rank-dependent branches or dict orders around them); TORCH_DISTRIBUTED_DEBUG=DETAIL "
        "catches mismatched types and shapes at once, but not two swapped calls that look alike."),
}

# Under TORCH_DISTRIBUTED_DEBUG=DETAIL (--debug-detail) the mismatched collectives fail
# at once ("gave up after 0.0s") instead of hanging: the paragraph says so.
EXPLAIN_DETAIL = {
    "collective-missing": (
        "Symptom: both ranks failed at once with 'Detected mismatch between collectives on "
        "ranks': TORCH_DISTRIBUTED_DEBUG=DETAIL compares every collective's type, shapes and "
        "sequence number across ranks before running it, and rank 0's all_reduce met the "
        "others' barrier. Without DETAIL the job freezes until the process-group timeout "
        "instead (run it without --debug-detail to see). Cause: all_reduce was called inside "
        "`if rank == 0:`, so rank 0 and the others reached different collectives. Fix: call "
        "every collective on every rank; if only rank 0 needs the result, let every rank "
        "compute it and only rank 0 print it."),
    "collective-order": (
        "Symptom: two all_reduces of the same shape in a different order returned wrong sums "
        "with no error at all, even under TORCH_DISTRIBUTED_DEBUG=DETAIL; then an all_reduce "
        "on one rank met a broadcast on the other, and DETAIL, which compares every "
        "collective's type and shapes across ranks before running it, failed both at once "
        "('Detected mismatch between collectives on ranks'). Without DETAIL those two hang "
        "until the timeout. Cause: ranks pair collectives by their position in the sequence, "
        "not by their name or variable. Fix: make every rank issue the same collectives in "
        "the same order (no rank-dependent branches or dict orders around them)."),
}
