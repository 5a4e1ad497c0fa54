"""Lesson 25: DTensor by itself: placements, redistribute, and what each one sends.

Parent: lesson 17 (lessons/17_tensor_parallel.py)

New since lesson 17 (Part 4, "When it goes wrong"): no model and no plan. Lesson 17's
parallelize_module chose the placements; here you choose them. distribute_tensor puts one tensor
on a 1-D and a 2-D device mesh as Shard(0), Shard(1), Replicate() and Partial() (a pending sum),
and every rank shows what it holds. Every redistribution between them runs with its collectives
counted (torch's CommDebugMode and apparatus/comm.py's CommLog) beside torch's plan and its bytes
formula; gloo runs an all-gather where torch plans an all-to-all, measured. Then which placement
an op's output gets (x @ w, sum, softmax) and when DTensor redistributes by itself; the Partial
pitfalls (a max or a norm of the pieces is wrong, clip_grad_norm_ on DTensors is right); and
LocalTensorMode: the N ranks' values again in one process, checked equal to the gloo ranks'.
Every whole result is checked against the same computation in one process without DTensor.

PRIVATE API: LocalTensorMode (torch.distributed._local_tensor) and the fake process group
(torch.testing._internal.distributed.fake_pg) are not torch's public API; checked on torch
2.14.1 only (lessons/25_dtensor/local_ranks.py says where each piece comes from).

Run:
    make lesson-25
    make lesson-25 ARGS="--world-size 8"
    .venv/bin/python lessons/25_dtensor.py --world-size 2 --device cpu

Doc: docs/25_dtensor.md
"""
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 25_dtensor/
sys.path.insert(1, str(Path(__file__).resolve().parent / "23_cluster_on_a_laptop"))  # lesson 23's fake group, fake_cluster.py

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode  # PRIVATE API: see the docstring
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

import fake_cluster
import local_ranks
import partial_pitfalls
import redistribution
from common.cli import lesson_parser, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()  # Partial(): each rank holds a summand
# The layouts: Step 2 lays X out in each; Step 3 moves it from one to another, on each mesh
LAYOUTS = {"1-D": [(S0,), (S1,), (R,), (P,)], "2-D": [(S0, S1), (R, S1), (P, S0)]}
MOVES = {"1-D": [((S0,), (R,)), ((P,), (R,)), ((P,), (S0,)), ((S0,), (S1,)), ((R,), (S0,)), ((S0,), (P,)), ((R,), (P,))],
         "2-D": [((S0, S1), (R, R)), ((P, P), (S0, S1)), ((S0, S1), (S1, S0))]}
# The ops of Step 4: (what, the op, placements of its inputs); x is 8 x 32, w is 32 x 16
OPS = [("x @ w", lambda x, w: x @ w, (S0, R)),        # x's rows: the output's rows
       ("x @ w", lambda x, w: x @ w, (R, S1)),        # w's columns: lesson 17's column-parallel
       ("x @ w", lambda x, w: x @ w, (S1, S0)),       # the inner dimension split: row-parallel
       ("x @ w", lambda x, w: x @ w, (S0, S0)),       # no rule takes these as they are
       ("x.sum()", lambda x: x.sum(), (S0,)),
       ("softmax(x, -1)", lambda x: F.softmax(x, -1), (S0,)),
       ("softmax(x, -1)", lambda x: F.softmax(x, -1), (S1,)),  # along the split dimension
       ("softmax(x, -1)", lambda x: F.softmax(x, -1), (P,)),
       ("x + 1", lambda x: x + 1, (P,)),              # 1 added to each summand: N in the sum
       ("2 * x", lambda x: 2 * x, (P,))]              # scaling each summand scales the sum


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True)
    parser.add_argument("--world-size", type=int, choices=[1, 2, 4, 8], default=4,
                        help="how many processes (ranks): the 2-D mesh (2 x N/2) needs 4 or 8")
    parser.add_argument("--seed", type=seed_number, default=0, help="seed for the random x, w and gradients")
    return parser.parse_args()


def make_meshes(device_type: str, world: int) -> dict:
    """Every rank in a row (1-D), and with 4 ranks or more a grid of 2 x world/2 (2-D)."""
    meshes = {"1-D": init_device_mesh(device_type, (world,), mesh_dim_names=("a",))}
    if world >= 4:
        meshes["2-D"] = init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("a", "b"))
    return meshes


def main() -> None:
    args = parse_args()
    claim_out(out_dir("25", args.out))  # checked now, not after the work; ours alone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, *plan_device(args.device, args.world_size)), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 25: DTensor by itself, on {world} processes" + (f" ({note})" if note else ""))

    # Step 1: Choose this rank's device and join the process group
    # Lesson 17's Step 1, then two meshes of the same ranks: a row, and a grid of 2 rows.
    ui.step(1, "Choose this rank's device and join the process group")
    device = rank_device(kind, rank)  # one GPU per rank (cuda:<rank>), or the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun would set them
    init_from_env(backend_for(device), args.timeout, device)  # lesson 05's init_process_group
    meshes = make_meshes(device.type, world)
    ui.print(f"device: [bold]{device}[/bold]; " + "; ".join(
        f"{name} mesh {m.mesh.tolist()} (dims {m.mesh_dim_names})" for name, m in meshes.items())
        + ("" if "2-D" in meshes else "; no 2-D mesh (it needs 4 or 8 ranks)"))
    timer = Timer()
    real, report = program(meshes, device, args.seed, ui, local_ranks.GlooView(world))  # Steps 2-5
    real_seconds = timer.seconds
    teardown()  # nothing below talks to the other ranks
    if rank == 0:
        finish(ui, args, world, device, real, report, real_seconds)


def program(meshes: dict, device, seed: int, ui: UI, view) -> tuple:
    """Steps 2-5, the same on real ranks and under LocalTensorMode. view: how this process sees
    every rank's piece (real ranks: a gather; LocalTensorMode: it holds them all)."""
    values, report, world = local_ranks.Values(view), {}, view.world

    # Step 2: Distribute one tensor four ways, on a 1-D and a 2-D mesh
    # X holds 0, 1, ..., 63, so every value names its cell: a rank's piece says where it came from.
    # distribute_tensor takes rank 0's X as the truth (src_data_rank=0) and sends it out.
    ui.step(2, "Distribute one tensor four ways, on a 1-D and a 2-D mesh")
    X = torch.arange(64.0, device=device).reshape(8, 8)  # the same on every rank
    report["layouts"] = {}
    for name, mesh in meshes.items():
        columns, shapes, sent_by = [], [], []
        for placements in LAYOUTS[name]:
            with redistribution.counted() as sent:
                d = distribute_tensor(X, mesh, placements)
            what = f"X as {redistribution.short(placements)} on {name}"
            values.add(what, d, X)
            parts = math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_partial())  # X / parts each
            said = [redistribution.held(piece, view.mine(X), parts) for piece in values.pieces[what]]
            report["layouts"][f"{redistribution.short(placements)} on {name}"] = said
            columns.append(said)
            shapes.append(tuple(d.to_local().shape))
            sent_by.append(", ".join(op.rstrip("_") + (f" x{n}" if n > 1 else "") for op, n in sent.torch.items()) or "none")
        ui.table(f"X (8 x 8) on the {name} mesh: each rank's piece (to_local)",
                 ["rank", *(redistribution.short(p) for p in LAYOUTS[name])],
                 [[r, *(said[r] for said in columns)] for r in range(world)]
                 + [["shape", *shapes], ["sent by distribute_tensor", *sent_by]])
    ui.print(f"full_tensor() gives X back from every layout: "
             f"{all(torch.equal(values.full[n], view.mine(X)) for n in values.full)}")

    # Step 3: Redistribute between placements, counting every collective
    # Each move runs under two counters: CommLog (kind, group, bytes) and torch's CommDebugMode.
    ui.step(3, "Redistribute between placements, counting every collective")
    report["redistributions"], rows = [], []
    for name, mesh in meshes.items():
        for src, dst in MOVES[name]:
            d, refused = distribute_tensor(X, mesh, src), None
            try:
                with redistribution.counted() as ran:
                    moved = d.redistribute(mesh, dst)
                values.add(f"X {redistribution.short(src)} -> {redistribution.short(dst)} on {name}", moved, X)
            except RuntimeError as exc:  # Replicate -> Partial: redistribute says no
                refused = str(exc).split("!")[0]
            row = redistribution.move_row(src, dst, tuple(mesh.shape), tuple(X.shape), ran, mesh.device_type, refused)
            report["redistributions"].append(row)
            rows.append(redistribution.table_row(row))
    ui.table(f"Redistributions of X ({X.numel() * 4} bytes), what rank 0 sends", redistribution.MOVE_COLUMNS, rows)
    for row in filter(lambda row: row["refused"], report["redistributions"]):
        ui.print(f"{row['from']} -> {row['to']} refused: {row['refused']}")
    report["torch_counts_equal_commlog"] = all(
        sum(r["comm_debug_mode"].values()) == len(r["group_sizes"]) for r in report["redistributions"])
    ui.print(f"CommDebugMode counted as many collectives as CommLog in every row: {report['torch_counts_equal_commlog']}")
    for line in redistribution.lowered(report["redistributions"]):
        ui.print(line)  # what gloo runs instead of an all-to-all
    report["uneven"] = redistribution.uneven(X[:7], meshes["1-D"], view, values, ui)  # 7 rows: padding

    # Step 4: Propagate placements through x @ w, sum and softmax
    # DTensor looks up each op's sharding rules for its inputs' placements; where none takes them
    # as they are, it redistributes an input first, by itself: traffic no line of yours asked for.
    ui.step(4, "Propagate placements through x @ w, sum and softmax")
    torch.manual_seed(seed)  # the same x and w on every rank; in [0, 1), as after a ReLU (Step 5)
    x, w = torch.rand(8, 32, device=device), torch.rand(32, 16, device=device)  # 1 KiB, 2 KiB
    mesh, rows, report["propagation"] = meshes["1-D"], [], []
    for what, op, placements in OPS:
        inputs = [distribute_tensor(t, mesh, [p]) for t, p in zip((x, w), placements)]
        with redistribution.counted() as ran:
            out = op(*inputs)
        values.add(f"{what} with {redistribution.short(placements)}", out, op(x, w) if len(inputs) == 2 else op(x))
        by_itself = ", ".join(f"{c.kind} of {c.data_bytes:,} bytes" for c in ran.calls) or "none"
        gap = values.gap_to_one_process()[f"{what} with {redistribution.short(placements)}"]
        report["propagation"].append({"op": what, "inputs": [str(p) for p in placements],
                                      "output": redistribution.short(out.placements), "redistributed": by_itself, "gap": gap})
        rows.append([what, redistribution.short(placements), redistribution.short(out.placements), by_itself, f"{gap:.1e}"])
    ui.table("What each op's output becomes", ["op", "inputs (x, w)", "output", "DTensor ran by itself",
                                               "|full - one process|"], rows)

    # Step 5: The Partial pitfalls: a max or a norm of the pieces, and clipping
    # y = x @ w with the inner dimension split is Partial: rank r holds a summand y_r, not y.
    # x and w are not negative, so the summands agree in sign, as data-parallel gradients mostly do.
    ui.step(5, "The Partial pitfalls: a max or a norm of the pieces, and clipping")
    y = distribute_tensor(x, mesh, [S1]) @ distribute_tensor(w, mesh, [S0])
    rows, report["pitfalls"] = partial_pitfalls.max_and_norm(y, x @ w, mesh, view, values)
    ui.table("The max and the norm of y = x @ w (from the pieces: max of the pieces' maxes, root of "
             "the sum of their squared norms)", ["y as", "of y", "one process", "DTensor", "from the pieces"], rows)
    ui.print("DTensor ran by itself: " + "; ".join(f"{what}: {ran}, its result {report['pitfalls']['dtensor_result'][what]}"
                                                  for what, ran in report["pitfalls"]["dtensor_ran"].items()))
    rows, report["clipping"] = partial_pitfalls.clipping(mesh, device, seed, view, values)
    grads = report["clipping"]["gradient_placements"]
    ui.table(f"clip_grad_norm_(max_norm={partial_pitfalls.MAX_NORM}) of a (its gradient {grads[0]}) and b "
             f"(its gradient {grads[1]})", ["how", "total norm (each rank's)", "max |clipped - one process|"], rows)
    ui.print(f"clip_grad_norm_ on the DTensors ran: {report['clipping']['dtensor_ran']}")
    return values, report


def finish(ui: UI, args, world: int, device, real, report: dict, real_seconds: float) -> None:
    """Rank 0, after the ranks are gone: the same program in one process, then the results."""

    # Step 6: Compute every rank's values again in one process (LocalTensorMode)
    # No processes: a fake group of N ranks (lesson 23) whose collectives move nothing, and a
    # mode in which every tensor holds N ranks' values. The same program(), silent this time.
    ui.step(6, "Compute every rank's values again in one process (LocalTensorMode)")
    ui.print(local_ranks.version_note())
    timer = Timer()
    fake_cluster.join_fake_group(world)  # lesson 23's fake process group, N ranks in this process
    cpu_meshes = make_meshes("cpu", world)  # built before the mode, as torch's own tests do
    with LocalTensorMode(world):
        simulated, simulated_report = program(cpu_meshes, torch.device("cpu"), args.seed, UI(rank=-1),
                                              local_ranks.LocalView(world))
    dist.destroy_process_group()
    gap, compared, where = local_ranks.largest_gap(real, simulated)
    ui.print(f"{compared} pieces (every to_local() of Steps 2-5, on each of {world} ranks) in one process in "
             f"{timer.seconds:.1f}s (on the real ranks: {real_seconds:.1f}s); "
             f"max |LocalTensorMode - real ranks| = [bold]{gap:.1e}[/bold]"
             + (f" (largest at {where}: sums in another order)" if gap else " (every value equal)"))
    for ours, theirs in zip(report["redistributions"], simulated_report["redistributions"]):
        if ours["collective"] != theirs["collective"]:  # the all-to-all gloo does not run
            ui.print(f"{ours['from']} -> {ours['to']} ({len(ours['mesh'])}-D mesh): "
                     f"under LocalTensorMode {theirs['collective']}, {theirs['bytes']:,.0f} bytes sent, "
                     f"as planned; on {backend_for(device)} {ours['collective']}, {ours['bytes']:,.0f}")

    # Step 7: Compare with one process, save the results
    # Every whole result (full_tensor) beside the same computation on the whole tensors, with no
    # DTensor and no ranks: equal up to rounding, except Step 5's mistake, which must differ.
    ui.step(7, "Compare with one process, save the results")
    right, wrong = real.gap_to_one_process(), real.gap_to_one_process(mistakes=True)
    worst, relative = max(right.values()), max(real.gap_to_one_process(relative=True).values())
    why = "rounding: products and sums done in pieces, in another order" if worst else "equal"
    ui.print(f"{len(right)} results against one process: max |full_tensor() - one process| = "
             f"[bold]{worst:.1e}[/bold], {relative:.1e} of the result's largest value ({why}; allowed 1e-6)")
    ui.print(f"Step 5's mistake (each rank clips its pieces): off by {max(wrong.values()):.4f}, "
             + ("as it must be" if world > 1 else "none with one rank: its pieces are the whole gradients"))
    folder = out_dir("25", args.out)
    state = {f"full/{name}": t for name, t in real.full.items()}
    state |= {f"piece/{name}/{r}": t for name, ts in real.pieces.items() for r, t in enumerate(ts)}
    save_results(folder, state, make_metrics(
        lesson="25", world_size=world, backend=backend_for(device), device=str(device), losses=[],
        final_accuracy=None, wall_seconds=real_seconds, samples=0, seed=args.seed, **report,
        local_tensor_max_abs_diff_vs_gloo=gap, local_tensor_pieces_compared=compared,
        local_tensor_redistributions=simulated_report["redistributions"],
        max_abs_diff_vs_one_process=worst, max_relative_diff_vs_one_process=relative,
        one_process_gaps=right, mistake_gaps=wrong,
        torch_version=torch.__version__, checked_on=local_ranks.CHECKED_ON))
    ui.print(f"wrote {shown(folder / 'final.pt')} (every result, whole and each rank's piece) and "
             f"{shown(folder / 'metrics.json')}")


if __name__ == "__main__":
    run(main)
