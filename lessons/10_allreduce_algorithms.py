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

It opens its own topic (all-reduce by hand), so it names no parent lesson. What only checks
flags, prints or measures (the byte tables, the ring picture, the timing table, the timeout
message) is in lessons/10_allreduce_algorithms/allreduce.py.

Run:
    make lesson-10
    make lesson-10 ARGS="--world-size 3"
    .venv/bin/python lessons/10_allreduce_algorithms.py --world-size 4 --sizes 1000,1000000 --repeats 5
    .venv/bin/python lessons/10_allreduce_algorithms.py --skip-rank 1 --timeout 5   # a broken ring

Doc: docs/10_allreduce_algorithms.md
"""
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 10_allreduce_algorithms/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist

from common.cli import lesson_parser, nonnegative_int, positive_int, run
from common.distributed import choose_port, env_store, spawn, teardown
from apparatus.results import atomic_write, claim_out, out_dir, shown
from apparatus.ui import UI
from allreduce import (FLOAT_BYTES, check_args, draw_ring, explain_timeout, show_bytes,
                                 show_checks, show_totals, size_list, timing_table)

PICTURE_RANKS = 4    # the ring picture stays readable up to 4 ranks


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
    check_args(args)  # 2..8 ranks, a real --skip-rank, no --device cuda (lessons/10_allreduce_algorithms/allreduce.py)
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
        self.sent = self.received = 0  # bytes, counted on every call below

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
    claim_out(out_dir("10", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 10: all-reduce by hand on {args.world_size} processes (gloo)")

    # Step 1: Start N processes on gloo
    # Same start as lesson 05: the address of the rendezvous store goes in the environment,
    # spawn() starts one process per rank, as mp.spawn does (common/distributed.py forks
    # them from this process, so torch is imported once, not once per rank). gloo, because it moves CPU tensors, and every
    # tensor here lives on the CPU: bytes on the wire do not depend on the device.
    ui.step(1, "Start N processes on gloo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(choose_port(args.master_port))
    ui.print(f"spawn(worker, nprocs={args.world_size}), rendezvous at "
             f"127.0.0.1:{os.environ['MASTER_PORT']}, timeout {args.timeout:g}s per operation")
    spawn(worker, (args.world_size, args), args.world_size)


def worker(rank: int, world_size: int, args) -> None:
    ui = UI(rank, world_size, step_mode=args.step)  # --step: rank 0 asks, the others wait
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
    results["server_bytes"] = show_bytes(ui, "Parameter server", big, wire,
                                         lambda r: server_bytes(big, world_size, r))
    ui.print(f"max |server - dist.all_reduce| = {diff:.1e}; rank 0 moved {world_size - 1}x "
             f"what each other rank moved, in and out")

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
    results["ring_bytes"] = show_bytes(ui, "Ring all-reduce", big, wire,
                                       lambda r: ring_bytes(big, world_size, r))
    share = 2 * (world_size - 1) / world_size
    ui.print(f"max |ring - dist.all_reduce| = {diff:.1e}; 2(N-1)/N = {share:.2f}: each rank "
             f"moves {share:.2f} S each way, the server's rank 0 moved {world_size - 1} S")
    show_totals(ui, results["server_bytes"], results["ring_bytes"])  # the same total, 2(N-1)*S

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
                    worst[name] = max(worst[name], compare_with_all_reduce(got, x_small, groups[n]))
        worst_all = torch.tensor([worst["server"], worst["ring"]], dtype=torch.float64)
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)  # the largest on any rank
        checks.append({"n": n, "sizes": sizes, "server_max_diff": worst_all[0].item(),
                       "ring_max_diff": worst_all[1].item()})
    show_checks(ui, checks)
    results["checks"] = checks

    # Step 6: Time all three for several N and S
    # Each cell: one warm-up call, then --repeats timed calls. A call takes as long as its
    # slowest rank (MAX over ranks), and we keep the median call. "busiest rank" is the
    # largest number of bytes one rank sent, measured by Wire; dist.all_reduce does its
    # own sending inside gloo, where we cannot count it. The timing loop and the table are
    # measurement, not the idea: lessons/10_allreduce_algorithms/allreduce.py (time_cell, timing_table).
    ui.step(6, "Time all three for several N and S")
    algorithms = {"server": server_all_reduce, "ring": ring_all_reduce,
                  "dist.all_reduce": None}  # None: gloo's own, run as dist.all_reduce
    formulas = {"server": lambda size, n: server_bytes(size, n, 0)[0],  # rank 0: the busiest
                "ring": ring_formula, "dist.all_reduce": ring_formula}  # gloo's is a ring
    results["table"] = timing_table(ui, rank, groups, args.sizes, args.repeats, Wire, algorithms,
                                    formulas, lambda size, r: own_tensor(size, args.seed + 2, r))

    # Step 7: Save the results and leave the group
    # Rank 0 writes metrics.json (atomically, as every lesson does). No model holds the
    # process group here, but teardown() still collects garbage before destroying it.
    ui.step(7, "Save the results and leave the group")
    if rank == 0:
        results["wall_seconds"] = round(time.perf_counter() - started, 3)
        folder = out_dir("10", args.out)
        atomic_write(folder / "metrics.json",
                     lambda f: f.write((json.dumps(results, indent=2) + "\n").encode()))
        ui.print(f"wrote {shown(folder / 'metrics.json')}")
    dist.barrier()
    teardown()
    ui.print("done: every rank left the process group")


# ---------------------------------------------------------------------------------------
# Helpers of the steps above.
# ---------------------------------------------------------------------------------------

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


if __name__ == "__main__":
    run(main)
