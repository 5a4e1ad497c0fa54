"""Lesson 26: the parity oracle, rounding or a bug, and where it starts.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13 (Part 4, "When it goes wrong", opens here): lesson 13's recipe runs in one
process and, beside it, under a parallel layout (--layout ddp|fsdp|tp|cp: lessons 14, 15, 17
and 21). At each of the first --record-steps steps both runs record every module's forward
output and every parameter's gradient, the ranks' pieces put back together. Each run has a
float64 twin, and how far float32 rounding carried each entry from its twin is measured: that
is the floor. Compared in the order they happened, the entries are "within rounding
everywhere", or the first (step, module, forward|backward) whose difference leaves its floor
is named. --bug injects a mistake learners make. Training on shows why a tolerance on the final
weights cannot tell rounding from a bug: AdamW grows rounding, while a bug starts big.

Run:
    make lesson-26
    make lesson-26 ARGS="--layout tp --bug tp-bias"
    .venv/bin/python lessons/26_parity_oracle.py --layout fsdp --world-size 4 --bug data-shift
    .venv/bin/python tools/parity.py runs/lesson-26/reference.pt runs/lesson-26/parallel.pt

Doc: docs/26_parity_oracle.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 26_parity_oracle/
sys.path.insert(1, str(Path(__file__).resolve().parent / "17_tensor_parallel"))  # lesson 17's collectives, tensor_parallel.py
sys.path.insert(1, str(Path(__file__).resolve().parent / "21_context_parallel"))  # lesson 21's ring, ring_attention.py

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch

import parity_layouts
import parity_oracle
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer

TWINS = (torch.float32, torch.float64)  # each run, and the same run with every op in float64
SHOWN_STEPS = (1, 2, 3, 5, 10, 20, 50, 100)  # Step 5's rows (and the last step)


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps; the first --record-steps are recorded, all of them show the growth")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--layout", choices=parity_layouts.LAYOUTS, default=None,
                        help="how the ranks split the work (default: ddp, or the first layout --bug applies to)")
    parser.add_argument("--bug", choices=sorted(parity_layouts.BUGS), default=None,
                        help="inject a mistake learners make (see docs/26_parity_oracle.md)")
    parser.add_argument("--record-steps", type=positive_int, default=3,
                        help="how many first steps to record and compare, entry by entry")
    return parity_layouts.check_flags(parser, parser.parse_args())  # bug and layout agree; the world size fits


def main() -> None:
    args = parse_args()
    claim_out(out_dir("26", args.out))  # checked now, not after training; ours alone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, *plan_device(args.device, args.world_size)), args.world_size)


def whole_weights(run, shapes) -> dict:
    """Every parameter of a run, whole, on the CPU (on N ranks: every rank calls it, it gathers)."""
    return {name: parity_oracle.whole(p.detach(), shapes[f"backward/{name}"]).cpu()
            for name, p in run.model.named_parameters()}


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    bug = parity_layouts.Bug(args.bug)
    ui.title(f"Lesson 26: the parity oracle, {args.layout} on {world} processes"
             + (f", with the bug {args.bug}" if args.bug else "") + (f" ({note})" if note else ""))

    # Step 1: Choose this rank's device and join the process group
    # One thread on the CPU: bitwise reproducible, and the ranks share the cores anyway.
    ui.step(1, "Choose this rank's device and join the process group")
    device = rank_device(kind, rank)  # one GPU per rank (cuda:<rank>), or the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun would set them
    init_from_env(backend_for(device), args.timeout, device)  # lesson 05's init_process_group
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Build both runs, each beside its float64 twin
    # Lesson 13's model from the same seed in all four; a twin's weights are the float32 ones,
    # cast exactly. The one-process run lives on rank 0. The whole shapes come from one
    # forward on the meta device: they say where each rank's piece belongs.
    ui.step(2, "Build both runs, each beside its float64 twin")
    with torch.device("meta"):
        shapes = parity_oracle.whole_shapes(T.Transformer(), torch.zeros(T.GLOBAL_BATCH, T.SEQ, dtype=torch.long))
    runs = {}
    for dtype in TWINS:
        split = parity_layouts.build(args.layout, T.make_model(args.seed).to(device, dtype), rank, world, bug, device)
        runs["parallel", dtype] = (split, T.make_optimizer(split.model),
                                   parity_oracle.Recorder(split.model, shapes, f"{split.about}; {dtype}"))
        if rank == 0:
            one = parity_layouts.one_process(T.make_model(args.seed).to(device, dtype))
            runs["one process", dtype] = (one, T.make_optimizer(one.model),
                                          parity_oracle.Recorder(one.model, {}, f"lesson 13, {one.about}; {dtype}"))
    if rank == 0:  # for Step 4: lessons 14-24's floor, lesson 13 summing each batch in N chunks
        model_13 = T.make_model(args.seed).to(device)
        chunked = (model_13, T.make_optimizer(model_13), parity_oracle.Recorder(model_13, {}, f"lesson 13 in {world} chunks"))
    ui.print(f"{args.layout} on {world} ranks: {runs['parallel', torch.float32][0].about}")
    ui.print(f"recorded: {len(shapes) - sum(k.startswith('backward/') for k in shapes)} module outputs "
             f"and {sum(k.startswith('backward/') for k in shapes)} gradients per step, for {args.record_steps} steps")
    if bug.name:
        ui.print(f"[bold red]bug injected[/bold red], {args.bug}: {parity_layouts.BUGS[args.bug][1]}")

    # Step 3: Train, recording the first steps of all four runs
    # Lesson 13's loop in each run. At a recorded step the pieces are made whole (collectives)
    # and rank 0 compares at once: each entry's difference against its floor, the rounding
    # both float32 runs carry, measured against their twins (parity_oracle.py explains why).
    ui.step(3, "Train, recording the first steps of all four runs")
    rows, losses, gaps = [], {"parallel": [], "one process": []}, {}
    timer = Timer()
    with ui.progress(args.steps, "training") as bar:
        for step in range(1, args.steps + 1):
            recording = step <= args.record_steps
            if step == args.record_steps + 1:  # the one-process twin has served: recording is over
                runs.pop(("one process", torch.float64), None)
            x, y = (t.to(device) for t in T.batch(step - 1, args.seed))
            for (side, dtype), (side_run, optimizer, recorder) in runs.items():
                loss = parity_layouts.train_step(side_run, optimizer, x, y, recorder if recording else None, step)
                if recording:
                    recorder.collect()  # the pieces, whole, on rank 0
                if dtype == torch.float32:
                    losses[side].append(loss)
            if recording and rank == 0:
                parity_layouts.chunked_step(*chunked[:2], x, y, world, chunked[2], step)
                chunked[2].collect()
                reference, parallel = (runs[side, torch.float32][2].recording for side in ("one process", "parallel"))
                for side in ("one process", "parallel"):
                    parity_oracle.measure_rounding(runs[side, torch.float32][2].recording, runs[side, torch.float64][2].recording)
                rows += parity_oracle.compare(reference, parallel, [k for k in reference["names"] if k.startswith(f"{step}/")])
                ui.print(parity_oracle.step_line(step, rows))
            if step in SHOWN_STEPS or step == args.steps:  # for Step 5: the weights, whole
                w32, w64 = (whole_weights(runs["parallel", dtype][0], shapes) for dtype in TWINS)
                if rank == 0:
                    lesson_13 = {k: v.cpu() for k, v in runs["one process", torch.float32][0].model.named_parameters()}
                    gaps[step] = (parity_oracle.max_abs_diff64(w32, lesson_13), parity_oracle.max_abs_diff64(w32, w64))
            bar.advance()
    wall = timer.seconds
    losses["parallel"] = T.mean_over_ranks(losses["parallel"])  # the ranks' shares' mean: the batch's
    final_state = whole_weights(runs["parallel", torch.float32][0], shapes)
    del runs, split
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return

    # Step 4: Walk the entries in order: rounding, or where it starts
    # The first entry whose difference is more than its floor is where the bug is: everything
    # after it was computed from wrong numbers, so only the first one says where to look.
    ui.step(4, "Walk the entries in order: rounding, or where it starts")
    first = parity_oracle.first_divergence(rows)
    ui.table("In the order they happened: " + ("the entries up to the first divergence" if first else
             "the largest ratios (none above 1)"), parity_oracle.COLUMNS, parity_oracle.table_rows(rows))
    ui.print(parity_oracle.verdict_line(rows))
    if first is not None and first["pass"] == "backward" and abs(first["norm_ratio"] - world) < 0.01:
        ui.print(f"|B| / |A| = {first['norm_ratio']:.3f} on {world} ranks: a sum where a mean was meant")
    # The same walk with lessons 14-24's floor: how far lesson 13 moves when it sums each batch
    # in N chunks. It models data parallel's reordering only, and both runs' rounding not at all.
    floor_14 = parity_oracle.with_floor_from(reference, parity_oracle.join_chunks(chunked[2].recording, shapes))
    rows_14 = parity_oracle.compare(floor_14, {**parallel, "rounding": {}})
    above = [r for r in rows_14 if not r["ratio"] <= 1]
    ui.print(f"with lessons 14-24's floor instead (lesson 13 summing each batch in {world} chunks): {len(above)} "
             f"of the {len(rows_14)} entries above it" + (f", the first {parity_oracle.where(above[0])}, "
             f"{parity_oracle.times(above[0]['ratio'])}" if above else ""))

    # Step 5: Watch the difference grow: rounding through AdamW, a bug from its first step
    # The weights after each step: the layout against lesson 13's one process, and against its
    # own float64 twin (how far rounding alone carried it). A bug is in the twin too.
    ui.step(5, "Watch the difference grow: rounding through AdamW, a bug from its first step")
    ui.table("The layout's weights after each step", ["step", "max |w - w_one process|", "max |w - w_float64 twin|",
             "|loss - loss_one process|"], [[s, f"{d:.1e}", f"{t:.1e}", f"{abs(losses['parallel'][s - 1] - losses['one process'][s - 1]):.1e}"]
                                             for s, (d, t) in gaps.items()])
    for s in sorted({1, args.steps}):  # how far from lesson 13, against how far rounding alone carried it
        ui.print(f"after step {s:>3}: {gaps[s][0]:.1e} from one process, {gaps[s][0] / gaps[s][1]:.2g}x "
                 f"its own distance from its float64 twin")
    ui.print(f"the difference grew {gaps[args.steps][0] / gaps[1][0]:.0f}x in {args.steps} steps; " + (
        "rounding in every recorded entry (Step 4): AdamW's steps grow it, and a tolerance on the final "
        "weights has to grow with it" if first is None else
        "a bug, from its first step: its float64 twin has the bug too, so the twin stays close and the "
        "one-process run does not"))

    # Step 6: Save the recordings and the results
    # The two recordings are the input of tools/parity.py: compare them, or your own.
    ui.step(6, "Save the recordings and the results")
    folder = out_dir("26", args.out)
    for name, recording in (("reference.pt", reference), ("parallel.pt", parallel)):
        parity_oracle.save(recording, folder / name)
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="26", world_size=world, backend=backend_for(device), device=str(device), losses=losses["parallel"],
        final_accuracy=None, wall_seconds=wall, samples=samples, steps=args.steps, seed=args.seed,
        global_batch=T.GLOBAL_BATCH, layout=args.layout, bug=args.bug, record_steps=args.record_steps,
        first_divergence=parity_oracle.divergence_metrics(first), max_ratio=parity_oracle.number(max(r["ratio"] for r in rows)),
        max_ratio_per_step=[parity_oracle.number(row["ratio"]) for row in parity_oracle.by_step(rows).values()],
        max_abs_diff_per_step=[max(r["diff"] for r in rows if r["step"] == s) for s in range(1, args.record_steps + 1)],
        entries_per_step=len(rows) // args.record_steps, weights_gap={str(s): d for s, (d, _) in gaps.items()},
        weights_gap_to_float64_twin={str(s): t for s, (_, t) in gaps.items()},
        chunked_floor_entries_above=len(above), chunked_floor_first=parity_oracle.divergence_metrics(above[0] if above else None),
        losses_one_process=losses["one process"], entries=[  # every comparison, in order (the pictures)
            [r["step"], r["pass"], r["name"], parity_oracle.number(r["diff"]), r["floor"], parity_oracle.number(r["ratio"])]
            for r in rows]))
    ui.print(f"wrote {shown(folder / 'reference.pt')}, {shown(folder / 'parallel.pt')} (the recordings), "
             f"{shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')}")
    ui.print(f"compare them yourself: .venv/bin/python tools/parity.py {shown(folder / 'reference.pt')} "
             f"{shown(folder / 'parallel.pt')}")


if __name__ == "__main__":
    run(main)
