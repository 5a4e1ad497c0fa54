"""Lesson 10: how gradients are combined: a parameter server and a ring all-reduce, by hand.

New since lesson 05: there DDP averaged the gradients with `dist.all_reduce`, and we took
the call on trust. Here we build all-reduce twice out of point-to-point messages
(`dist.isend` / `dist.irecv` on gloo) and count every byte each rank sends and receives:

* a parameter server: every rank sends its tensor to rank 0, rank 0 sums and sends the
  result back (the shape of `nn.DataParallel`, though on GPUs DP's sum and broadcast go
  through NCCL's pipelined reduce and broadcast, so its device 0 does not pay (N-1)*S);
* a ring all-reduce: reduce-scatter, then all-gather, N-1 + N-1 steps on 1/N-sized chunks.

Both are checked against `dist.all_reduce`, drawn step by step, and timed beside it for
several world sizes N and tensor sizes S. The bytes follow the formulas exactly: the
server's rank 0 moves (N-1)*S in and out, a ring rank 2(N-1)/N*S.

Run:
    make lesson-10
    make lesson-10 ARGS="--world-size 3"
    .venv/bin/python lessons/10_allreduce_algorithms.py --world-size 4 --sizes 1000,1000000 --repeats 5
    .venv/bin/python lessons/10_allreduce_algorithms.py --skip-rank 1 --timeout 5   # a broken ring

Doc: docs/10_allreduce_algorithms.md
"""
import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist

from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run
from common.distributed import choose_port, env_store, spawn, teardown
from common.results import atomic_write, out_dir, shown
from common.ui import UI

MAX_WORLD = 8        # 8 processes on a laptop already measure mostly waiting
PICTURE_RANKS = 4    # the ring picture stays readable up to 4 ranks
FLOAT_BYTES = 4      # every tensor here is float32


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


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=4)
    parser.add_argument("--sizes", type=size_list, default=[1000, 1_000_000],
                        help="tensor sizes S (float32 elements, comma-separated) for the "
                             "timing table; the largest is also used in steps 2 and 4")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed repetitions per table cell; the table shows their median")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed of every rank's random tensors (each rank its own generator)")
    parser.add_argument("--skip-rank", type=nonnegative_int, default=None,
                        help="a broken mode: this rank skips its part of the ring, and its "
                             "neighbours wait for it until --timeout ends the job")
    args = parser.parse_args()
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
    return args


# ---------------------------------------------------------------------------------------
# The two algorithms. They touch the network only through Wire, which counts the bytes.
# ---------------------------------------------------------------------------------------

class Wire:
    """dist.isend / dist.irecv inside one process group, counting every byte.

    `group_dst` / `group_src` are ranks *inside* `group` (0..n-1), so the same code runs on
    the whole world or on a subgroup made with dist.new_group.
    """

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.sent = 0
        self.received = 0

    def isend(self, tensor: torch.Tensor, to: int):
        self.sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, group=self.group, group_dst=to)

    def irecv(self, tensor: torch.Tensor, frm: int):
        self.received += tensor.numel() * tensor.element_size()
        return dist.irecv(tensor, group=self.group, group_src=frm)


def server_all_reduce(tensor: torch.Tensor, wire: Wire) -> None:
    """Sum `tensor` over all ranks, in place, through rank 0 (a parameter server).

    Rank 0 receives N-1 tensors, adds them to its own and sends the sum to N-1 ranks: its
    traffic grows with N. Every other rank sends S and receives S, whatever N is.
    """
    if wire.rank == 0:
        inbox = [torch.empty_like(tensor) for _ in range(wire.size - 1)]
        # irecv from everyone at once: the workers' messages can arrive in any order
        works = [wire.irecv(buf, frm) for frm, buf in enumerate(inbox, start=1)]
        for work in works:
            work.wait()
        for buf in inbox:
            tensor += buf
        works = [wire.isend(tensor, to) for to in range(1, wire.size)]
        for work in works:
            work.wait()
    else:
        wire.isend(tensor, 0).wait()
        wire.irecv(tensor, 0).wait()  # the sum overwrites our own tensor


def ring_all_reduce(tensor: torch.Tensor, wire: Wire, trace=None) -> None:
    """Sum `tensor` over all ranks, in place, around a ring: rank r talks to r-1 and r+1 only.

    The tensor is cut into N chunks (sizes differ by at most one element when N does not
    divide S). Reduce-scatter: at step k, rank r sends chunk r-k to its right neighbour and
    adds the chunk r-k-1 arriving from its left one; after N-1 steps rank r owns the full
    sum of chunk r+1. All-gather: N-1 more steps pass the finished chunks around the ring,
    the receiver overwriting instead of adding. `trace(phase, step, sent, received)` is
    called after every step (the picture in step 3 uses it).
    """
    n, me = wire.size, wire.rank
    right, left = (me + 1) % n, (me - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))  # views into `tensor`, no copies
    scratch = torch.empty_like(chunks[0])           # chunk 0 is never smaller than the others

    for step in range(n - 1):  # reduce-scatter
        send_c, recv_c = (me - step) % n, (me - step - 1) % n
        inbox = scratch[:chunks[recv_c].numel()]
        # send and receive at the same time: if every rank did a blocking send first, each
        # would wait for a receive that nobody has posted yet
        works = [wire.isend(chunks[send_c], right), wire.irecv(inbox, left)]
        for work in works:
            work.wait()
        chunks[recv_c] += inbox  # one more rank's numbers in this chunk
        if trace:
            trace("reduce-scatter", step, send_c, recv_c)

    for step in range(n - 1):  # all-gather
        send_c, recv_c = (me + 1 - step) % n, (me - step) % n
        works = [wire.isend(chunks[send_c], right), wire.irecv(chunks[recv_c], left)]
        for work in works:
            work.wait()  # the finished chunk lands straight in our tensor
        if trace:
            trace("all-gather", step, send_c, recv_c)


def server_bytes(size: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of one rank in server_all_reduce: the formula, exactly."""
    s = size * FLOAT_BYTES
    return ((n - 1) * s, (n - 1) * s) if rank == 0 else (s, s)


def ring_bytes(size: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of one rank in ring_all_reduce, exactly.

    Rank r sends every chunk but r+1 (reduce-scatter) and every chunk but r+2 (all-gather);
    it receives every chunk but r, then every chunk but r+1. When N divides S that is
    2(N-1)/N * S each way; otherwise the chunks differ by one element and so do the ranks.
    """
    c = [len(part) for part in torch.arange(size).tensor_split(n)]
    sent = 2 * size - c[(rank + 1) % n] - c[(rank + 2) % n]
    received = 2 * size - c[rank] - c[(rank + 1) % n]
    return sent * FLOAT_BYTES, received * FLOAT_BYTES


def ring_formula(size: int, n: int) -> float:
    """The textbook per-rank traffic of a ring, 2(N-1)/N * S, in bytes (each way)."""
    return 2 * (n - 1) / n * size * FLOAT_BYTES


# ---------------------------------------------------------------------------------------

def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 10: all-reduce by hand on {args.world_size} processes (gloo)")

    # Step 1: Start N processes on gloo
    # Same start as lesson 05: the address of the rendezvous store goes in the environment,
    # mp.spawn starts one process per rank. gloo, because it moves CPU tensors, and every
    # tensor here lives on the CPU: bytes on the wire do not depend on the device.
    ui.step(1, "Start N processes on gloo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(choose_port(args.master_port))
    ui.print(f"mp.spawn(worker, nprocs={args.world_size}), rendezvous at "
             f"127.0.0.1:{os.environ['MASTER_PORT']}, timeout {args.timeout:g}s per operation")
    if args.step:
        ui.print("[dim]--step: the ranks run without a terminal, so only this step pauses[/dim]")
        ui.pause()
    # mp.spawn logs one warning per rank it stops after a failure; the one-line error
    # from spawn() says the same, so keep the screen to that line.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    spawn(worker, (args.world_size, args), args.world_size)


def worker(rank: int, world_size: int, args) -> None:
    ui = UI(rank, world_size)
    torch.set_num_threads(1)  # N ranks share the cores; one thread each avoids a pile-up
    # env_store: the store env:// would make, but listening on 127.0.0.1 only (lesson 05)
    dist.init_process_group("gloo", store=env_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout))
    # Subgroups {0..n-1} for the smaller worlds of steps 5 and 6. Every rank must call
    # new_group for every group, members or not, in the same order.
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world_size)}
    groups[world_size] = dist.group.WORLD
    ui.print(f"{world_size} ranks joined; subgroups of ranks 0..n-1 made for n = "
             f"{', '.join(map(str, sorted(groups)))}")
    big = max(args.sizes)
    results: dict = {"lesson": "10", "world_size": world_size, "backend": "gloo",
                     "device": "cpu", "sizes": args.sizes}
    started = time.perf_counter()

    # Step 2: Reduce through a parameter server
    # Every rank holds its own "gradient" (random numbers from a generator seeded with its
    # rank). Rank 0 collects, sums and answers. We compare with dist.all_reduce on a copy,
    # then gather every rank's byte counts to rank 0 and put them beside the formula.
    ui.step(2, "Reduce through a parameter server")
    x = own_tensor(big, args.seed, rank)
    wire = Wire()
    got = x.clone()
    server_all_reduce(got, wire)
    diff = compare_with_all_reduce(got, x)
    rows, per_rank = byte_rows(wire, lambda r: server_bytes(big, world_size, r))
    ui.table(f"Parameter server, N={world_size}, S={big:,} floats ({human(big * FLOAT_BYTES)})",
             ["rank", "sent", "received", "formula (each way)", "matches"], rows)
    ui.print(f"max |server - dist.all_reduce| = {diff:.1e}; rank 0 moved {world_size - 1}x "
             f"what each other rank moved, in and out")
    results["server_bytes"] = per_rank

    # Step 3: Watch the ring, step by step
    # A tiny tensor with one element per chunk, and rank r starting with 10^r everywhere:
    # each digit of a sum then says whether that rank's number is in it. 1101 reads
    # "ranks 0, 2 and 3", shown as 0·23. Only the first few ranks take part, to fit a line.
    ui.step(3, "Watch the ring, step by step")
    n_pic = min(world_size, PICTURE_RANKS)
    if rank < n_pic:
        pic_wire = Wire(groups[n_pic])
        t = torch.full((n_pic,), 10.0 ** rank)
        frames = [("start", 0, None, None, t.tolist())]
        ring_all_reduce(t, pic_wire, trace=lambda phase, step, s, r: frames.append(
            (phase, step, s, r, t.tolist())))
        everyone = [None] * n_pic
        dist.all_gather_object(everyone, frames, group=groups[n_pic])
        if rank == 0:
            draw_ring(ui, everyone)
    dist.barrier()

    # Step 4: Check the ring and count its bytes
    # The same check and the same byte table as step 2. Every rank now moves the same
    # amount, 2(N-1)/N * S each way: just under 2 S, however many ranks there are.
    ui.step(4, "Check the ring and count its bytes")
    wire = Wire()
    got = x.clone()
    with explain_timeout(rank, args.timeout):
        if rank == args.skip_rank:
            ui.say_all(f"--skip-rank {rank}: skipping my part of the ring; my neighbours will "
                       f"wait for me until the {args.timeout:g}s timeout")
        else:
            ring_all_reduce(got, wire)
        diff = compare_with_all_reduce(got, x)
    rows, per_rank = byte_rows(wire, lambda r: ring_bytes(big, world_size, r))
    ui.table(f"Ring all-reduce, N={world_size}, S={big:,} floats ({human(big * FLOAT_BYTES)})",
             ["rank", "sent", "received", "formula (each way)", "matches"], rows)
    share = 2 * (world_size - 1) / world_size
    ui.print(f"max |ring - dist.all_reduce| = {diff:.1e}; 2(N-1)/N = {share:.2f}: each rank "
             f"moves {share:.2f} S each way, the server's rank 0 moved {world_size - 1} S")
    results["ring_bytes"] = per_rank
    total_server = sum(row["sent"] for row in results["server_bytes"])
    total_ring = sum(row["sent"] for row in per_rank)
    ui.print(f"all ranks together sent {human(total_server)} (server) and {human(total_ring)} "
             f"(ring): the same total, 2(N-1)*S; the ring spreads it evenly over every link")

    # Step 5: Check both for several N and S
    # Sizes that N does not divide (chunks of unequal length), sizes smaller than N (empty
    # chunks) and the odd world sizes: the places where a hand-written ring goes wrong.
    ui.step(5, "Check both for several N and S")
    checks = []
    for n in sorted(groups):
        sizes = sorted({1, n - 1, n, n + 1, 10, 1001, 4 * n + 3} - {0})
        worst = {"server": 0.0, "ring": 0.0}
        if rank < n:
            for size in sizes:
                x_small = own_tensor(size, args.seed + 1, rank)
                for name, algo in (("server", server_all_reduce), ("ring", ring_all_reduce)):
                    got = x_small.clone()
                    algo(got, Wire(groups[n]))
                    worst[name] = max(worst[name],
                                      compare_with_all_reduce(got, x_small, groups[n]))
        worst_all = torch.tensor([worst["server"], worst["ring"]], dtype=torch.float64)
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)  # the largest on any rank
        checks.append({"n": n, "sizes": sizes, "server_max_diff": worst_all[0].item(),
                       "ring_max_diff": worst_all[1].item()})
    ui.table("Largest |ours - dist.all_reduce| (torch.testing.assert_close passed for each)",
             ["N", "sizes S tried", "server", "ring"],
             [[c["n"], ", ".join(map(str, c["sizes"])), f"{c['server_max_diff']:.1e}",
               f"{c['ring_max_diff']:.1e}"] for c in checks])
    results["checks"] = checks

    # Step 6: Time all three for several N and S
    # Each cell: one warm-up call, then --repeats timed calls. A call takes as long as its
    # slowest rank (MAX over ranks), and we keep the median call. "busiest rank" is the
    # largest number of bytes one rank sent, measured by Wire; dist.all_reduce does its
    # own sending inside gloo, where we cannot count it.
    ui.step(6, "Time all three for several N and S")
    table = []
    with ui.progress(len(groups) * len(args.sizes) * 3, "timing") as bar:
        for n in sorted(groups):
            for size in args.sizes:
                for name in ("server", "ring", "dist.all_reduce"):
                    cell = None
                    if rank < n:
                        cell = time_cell(name, size, groups[n], args)
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
        for name in ("server", "ring"):
            path = [human(c["busiest_sent"]) for c in table
                    if c["algorithm"] == name and c["size"] == big]
            ui.print(f"{name:>6}, S={big:,}: busiest rank sends {' -> '.join(path)} "
                     f"for N = {', '.join(map(str, sorted(groups)))}")
        ui.print("formula: server (N-1)*S, ring 2(N-1)/N*S; gloo's dist.all_reduce is a ring "
                 "too (the doc shows where).\nMany ranks on few cores: the bytes are exact, "
                 "the milliseconds are noisy.")
    results["table"] = table

    # Step 7: Save the results and leave the group
    # Rank 0 writes metrics.json (atomically, as every lesson does). No model holds the
    # process group here, but teardown() still collects garbage before destroying it.
    ui.step(7, "Save the results and leave the group")
    if rank == 0:
        results["wall_seconds"] = round(time.perf_counter() - started, 3)
        folder = out_dir("10", args.out)
        text = json.dumps(results, indent=2) + "\n"
        atomic_write(folder / "metrics.json", lambda f: f.write(text.encode()))
        ui.print(f"wrote {shown(folder / 'metrics.json')}")
    dist.barrier()
    teardown()
    ui.print("done: every rank left the process group")


# ---------------------------------------------------------------------------------------
# Helpers of the steps above.
# ---------------------------------------------------------------------------------------

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


def own_tensor(size: int, seed: int, rank: int) -> torch.Tensor:
    """This rank's "gradient": per-rank randomness from a private generator, never global."""
    # seed above 32 bits of rank: distinct for every (seed, rank); seed * 1000 + rank would
    # give seed 0, rank 1000 the numbers of seed 1, rank 0
    g = torch.Generator().manual_seed(seed * 2**32 + rank)
    return torch.randn(size, generator=g)


def compare_with_all_reduce(got: torch.Tensor, x: torch.Tensor, group=None) -> float:
    """assert_close(ours, dist.all_reduce of the same input); returns max |difference|.

    The sums are added in another order than gloo adds them, so they may differ in the
    last bits (float addition is not associative): equal within float tolerance.
    """
    expected = x.clone()
    dist.all_reduce(expected, group=group)
    torch.testing.assert_close(got, expected)
    return (got - expected).abs().max().item() if got.numel() else 0.0


def byte_rows(wire: Wire, formula) -> tuple[list[list], list[dict]]:
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


def time_cell(name: str, size: int, group, args) -> dict:
    """Median wall time of one all-reduce of `size` floats on `group`, and its bytes."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    x = own_tensor(size, args.seed + 2, rank)
    buf = torch.empty_like(x)
    times, wire = [], None
    for i in range(args.repeats + 1):  # i == 0 is the warm-up
        buf.copy_(x)
        wire = Wire(group)
        dist.barrier(group=group)  # everyone starts together
        t0 = time.perf_counter()
        if name == "server":
            server_all_reduce(buf, wire)
        elif name == "ring":
            ring_all_reduce(buf, wire)
        else:
            dist.all_reduce(buf, group=group)
        if i:
            times.append(time.perf_counter() - t0)
    # a call is finished when its slowest rank is: MAX over ranks, per repetition
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    sent = torch.tensor([wire.sent], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=group)
    median = statistics.median(slowest.tolist())
    theory = (n - 1) * size * FLOAT_BYTES if name == "server" else ring_formula(size, n)
    return {"median_ms": round(median * 1e3, 3),
            "busiest_sent": None if name == "dist.all_reduce" else int(sent.item()),
            "theory_bytes": round(theory),
            "algbw_mbs": round(size * FLOAT_BYTES / median / 1e6, 1),
            "repeats": args.repeats}


def human(nbytes: float) -> str:
    """Decimal units (1 MB = 10^6 bytes), so 1,000,000 floats are exactly 4.00 MB."""
    return f"{nbytes / 1e3:.1f} KB" if nbytes < 1e6 else f"{nbytes / 1e6:.2f} MB"


def rate(mbs: float) -> str:
    return f"{mbs:,.0f}" if mbs >= 100 else f"{mbs:.1f}"


def who(value: float, n: int) -> str:
    """1101.0 on 4 ranks -> '0·23': which ranks' numbers (10^r) are summed in this value."""
    digits = f"{int(round(value)):0{n}d}"[::-1]  # digit r (from the right) belongs to rank r
    return "".join(str(r) if d == "1" else "·" if d == "0" else "!" for r, d in enumerate(digits))


def draw_ring(ui: UI, everyone: list) -> None:
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


if __name__ == "__main__":
    run(main)
