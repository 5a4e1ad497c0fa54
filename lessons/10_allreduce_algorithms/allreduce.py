"""Measure lesson 10's hand-written all-reduces: flags, byte tables, the ring picture, timing.

Lesson 10 (lessons/10_allreduce_algorithms.py) tells the idea: a parameter server and a ring
built from `dist.isend` / `dist.irecv`, each checked against `dist.all_reduce`, their bytes
counted by `Wire`. What only *shows* or *measures* those algorithms lives here, so the lesson
reads top to bottom:

* check_args: the flag rules beyond a flag's type (how many ranks, which rank may skip);
* explain_timeout: gloo's "Timed out waiting ... for recv" said in the lesson's words;
* byte_rows: every rank's counted bytes beside the formula (the tables of steps 2 and 4);
* draw_ring: the step-by-step picture of step 3;
* show_checks: the table of step 5;
* timing_table / time_cell: step 6, timed honestly (slowest rank, warm-up, median).

The algorithms themselves are passed in, never copied: this module does not import the lesson.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from common.cli import fail

MAX_WORLD = 8        # 8 processes on a laptop already measure mostly waiting
FLOAT_BYTES = 4      # every tensor in lesson 10 is float32


def size_list(text: str) -> list[int]:
    """--sizes 1000,1000000 -> [1000, 1000000] (numbers of float32 elements)."""
    try:
        sizes = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes of 1 element or more, got {text!r}")
    return sizes


def check_args(args) -> None:
    """Lesson 10's flag rules, each broken one a single `error:` line."""
    n = args.world_size
    if n < 2:
        fail(f"--world-size {n} leaves nobody to exchange tensors with; an all-reduce needs "
             f"at least 2 ranks: use --world-size 2 or more (the default is 4)")
    if n > MAX_WORLD:
        fail(f"--world-size {n} is more processes than this lesson measures usefully on one "
             f"machine; use {MAX_WORLD} or fewer")
    if args.skip_rank is not None and args.skip_rank >= n:
        fail(f"--skip-rank {args.skip_rank} does not exist in a world of {n} (ranks 0..{n - 1})")
    if args.device == "cuda":
        fail("this lesson runs its hand-written all-reduce on CPU tensors over gloo on purpose "
             "(it counts bytes, which do not depend on the device); leave out --device")


@contextmanager
def explain_timeout(rank: int, timeout: float):
    """Turn gloo's "Timed out waiting 5000ms for recv operation" into what it means here.

    Which rank's error reaches the screen is a race: the first rank to time out exits,
    and a rank still waiting on it then sees "Connection closed by peer" instead. Both
    mean the same here, so both get the same explanation.
    """
    why = (f"a rank that leaves the ring blocks its neighbours, and the {timeout:g}s timeout "
           f"(--timeout) is what ends the wait")
    try:
        yield
    except RuntimeError as exc:
        if "Timed out" in str(exc):
            raise RuntimeError(f"rank {rank} gave up waiting for a message: {why}") from None
        if "Connection closed by peer" in str(exc):
            raise RuntimeError(f"rank {rank} lost a peer that had given up waiting: {why}") \
                from None
        raise


def human(nbytes: float) -> str:
    """Decimal units (1 MB = 10^6 bytes), so 1,000,000 floats are exactly 4.00 MB."""
    return f"{nbytes / 1e3:.1f} KB" if nbytes < 1e6 else f"{nbytes / 1e6:.2f} MB"


def rate(mbs: float) -> str:
    return f"{mbs:,.0f}" if mbs >= 100 else f"{mbs:.1f}"


def byte_rows(wire, formula) -> tuple[list[list], list[dict]]:
    """Every rank's measured (sent, received), gathered to all, beside the formula."""
    counts = [None] * wire.size
    dist.all_gather_object(counts, (wire.sent, wire.received))
    rows, per_rank = [], []
    for r, (sent, received) in enumerate(counts):
        want_sent, want_received = formula(r)
        ok = sent == want_sent and received == want_received
        want = {human(want_sent), human(want_received)}  # differ only when N does not divide S
        rows.append([r, human(sent), human(received), " / ".join(sorted(want)),
                     "yes" if ok else "NO"])
        per_rank.append({"rank": r, "sent": sent, "received": received,
                         "formula_sent": want_sent, "formula_received": want_received})
    return rows, per_rank


def show_bytes(ui, name: str, size: int, wire, formula) -> list[dict]:
    """Print the byte table of one algorithm (steps 2 and 4); return its metrics rows."""
    rows, per_rank = byte_rows(wire, formula)
    ui.table(f"{name}, N={wire.size}, S={size:,} floats ({human(size * FLOAT_BYTES)})",
             ["rank", "sent", "received", "formula (each way)", "matches"], rows)
    return per_rank


def show_totals(ui, server_rows: list[dict], ring_rows: list[dict]) -> None:
    """Step 4's last line: what all ranks together sent, in each algorithm."""
    total_server = sum(row["sent"] for row in server_rows)
    total_ring = sum(row["sent"] for row in ring_rows)
    ui.print(f"all ranks together sent {human(total_server)} (server) and {human(total_ring)} "
             f"(ring): the same total, 2(N-1)*S; the ring spreads it evenly over every link")


def who(value: float, n: int) -> str:
    """1101.0 on 4 ranks -> '0·23': which ranks' numbers (10^r) are summed in this value."""
    digits = f"{int(round(value)):0{n}d}"[::-1]  # digit r (from the right) belongs to rank r
    return "".join(str(r) if d == "1" else "·" if d == "0" else "!" for r, d in enumerate(digits))


def draw_ring(ui, everyone: list) -> None:
    """Print the frames of all ranks side by side: one line per step, chunks as rank sets."""
    n = len(everyone)
    width = n * n + (n - 1) + 2
    ui.print(f"{n} ranks, {n} chunks of one element; rank r starts with 10^r, so a chunk "
             f"shown as 01·3 holds the sum of ranks 0, 1 and 3")
    ui.print(" " * 7 + "".join(f"{'rank ' + str(r):<{width}}" for r in range(n)))
    for i in range(len(everyone[0])):
        phase, step, _, _, _ = everyone[0][i]
        if phase != "start":
            moves = "   ".join(f"{r}->{(r + 1) % n}: chunk {everyone[r][i][2]}" for r in range(n))
            verb = "adds" if phase == "reduce-scatter" else "overwrites"
            ui.print(f"[dim]{phase} {step + 1}/{n - 1}:  {moves}  (receiver {verb})[/dim]")
        label = {"start": "start", "reduce-scatter": f"RS {step + 1}",
                 "all-gather": f"AG {step + 1}"}[phase]
        cells = [" ".join(who(v, n) for v in everyone[r][i][4]) for r in range(n)]
        ui.print(f"{label:<7}" + "".join(f"{cell:<{width}}" for cell in cells))
    ui.print(f"after reduce-scatter rank r holds the finished chunk r+1; after all-gather every "
             f"rank holds {who(sum(10.0 ** r for r in range(n)), n)} in every chunk: the sum")


def show_checks(ui, checks: list[dict]) -> None:
    """The table of step 5: the largest difference from dist.all_reduce per N."""
    ui.table("Largest |ours - dist.all_reduce| (torch.testing.assert_close passed for each)",
             ["N", "sizes S tried", "server", "ring"],
             [[c["n"], ", ".join(map(str, c["sizes"])), f"{c['server_max_diff']:.1e}",
               f"{c['ring_max_diff']:.1e}"] for c in checks])


def time_cell(Wire, algorithm, group, repeats: int, x: torch.Tensor) -> tuple[float, int]:
    """Median wall time of one `algorithm(buf, Wire(group))` on every rank of `group`, and the
    bytes sent by its busiest rank; `algorithm` None runs dist.all_reduce (sent: 0, since
    gloo sends its bytes where Wire cannot count them).

    Three rules: a call is finished when its slowest rank is (MAX over ranks, per
    repetition); the first call pays set-up costs (a warm-up, thrown away); one descheduled
    process can double a single time (the median of several).
    """
    buf = torch.empty_like(x)
    times, wire = [], None
    for i in range(repeats + 1):  # i == 0 is the warm-up
        buf.copy_(x)
        dist.barrier(group=group)  # everyone starts together
        t0 = time.perf_counter()
        if algorithm is None:
            dist.all_reduce(buf, group=group)
        else:
            wire = Wire(group)  # counts the bytes of this one call
            algorithm(buf, wire)
        if i:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    sent = torch.tensor([wire.sent if wire else 0], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist()), int(sent.item())


def timing_table(ui, rank: int, groups: dict, sizes: list[int], repeats: int, Wire,
                 algorithms: dict, formulas: dict, make_tensor) -> list[dict]:
    """Step 6: time every algorithm for every N in `groups` and S in `sizes`.

    `algorithms[name](tensor, wire)` is a hand-written all-reduce, None for dist.all_reduce;
    `formulas[name](size, n)` is the busiest rank's bytes in theory; `make_tensor(size,
    rank)` a rank's input. Rank 0 prints the table and returns its rows; the others [].
    """
    table = []
    with ui.progress(len(groups) * len(sizes) * len(algorithms), "timing") as bar:
        for n in sorted(groups):
            for size in sizes:
                for name, algorithm in algorithms.items():
                    cell = None
                    if rank < n:
                        x = make_tensor(size, dist.get_rank(groups[n]))
                        median, sent = time_cell(Wire, algorithm, groups[n], repeats, x)
                        cell = {"median_ms": round(median * 1e3, 3),
                                "busiest_sent": None if algorithm is None else sent,
                                "theory_bytes": round(formulas[name](size, n)),
                                "algbw_mbs": round(size * FLOAT_BYTES / median / 1e6, 1),
                                "repeats": repeats}
                    dist.barrier()
                    bar.advance()
                    if rank == 0:
                        table.append({"n": n, "size": size, "algorithm": name, **cell})
    rows = [[c["n"], f"{c['size']:,}", c["algorithm"], f"{c['median_ms']:.2f}",
             "-" if c["busiest_sent"] is None else human(c["busiest_sent"]),
             human(c["theory_bytes"]), rate(c["algbw_mbs"])] for c in table]
    ui.table("Median time of one call; bytes sent by the busiest rank; algbw = S / time",
             ["N", "S (floats)", "algorithm", "ms", "busiest rank sent", "formula",
              "algbw MB/s"], rows)
    if rank == 0:
        big = max(sizes)
        for name in ("server", "ring"):
            path = [human(c["busiest_sent"]) for c in table
                    if c["algorithm"] == name and c["size"] == big]
            ui.print(f"{name:>6}, S={big:,}: busiest rank sends {' -> '.join(path)} "
                     f"for N = {', '.join(map(str, sorted(groups)))}")
        ui.print("formula: server (N-1)*S, ring 2(N-1)/N*S; gloo's dist.all_reduce is a ring "
                 "too (the doc shows where).\nMany ranks on few cores: the bytes are exact, "
                 "the milliseconds are noisy.")
    return table
