"""Lesson 27: a zoo of real upstream bugs, each re-created, caught and fixed.

Parent: lesson 26 (lessons/26_parity_oracle.py)

New since lesson 26: lesson 26 injected the mistakes learners make; here every bug happened to
someone, and is cited from its tracker (owner/repo#number and title; one from Hugging Face's
Smol Training Playbook). Each lives in its own file in lessons/27_bug_zoo/, re-created on torch
2.14.1 by the mechanism that broke upstream, small: lesson 13's recipe on 2 ranks. For each bug:
its run against the baseline (lesson 13's one process, with what the bug's recipe adds), how far
its weights and loss end from it; how it is caught (lesson 26's oracle at step 1, imported from
lessons/26_parity_oracle/, or the check that caught it upstream); and the fixed run, back within
Part 2's 1e-3. --bug mystery runs one bug without naming it: exercise 27.

    gloo-avg        pytorch/pytorch#162338     FSDP2's gradients summed where gloo should average
    late-sync-flag  karpathy/build-nanogpt#30  accumulation's sync flag set after the forward
    tp-same-seed    Smol Training Playbook     tensor-parallel ranks draw their shards from one seed
    hsdp-seed       allenai/OLMo-core#319      HSDP replicas initialized from seed + rank
    pipeline-clip   pytorch/torchtitan#596     each pipeline stage clips by its own gradient norm
    dcp-initial-lr  pytorch/pytorch#140900     a DCP resume loses the scheduler's initial_lr

Run:
    make lesson-27                                   # the whole zoo
    make lesson-27 ARGS="--bug late-sync-flag"       # one bug
    make lesson-27 ARGS="--bug mystery --seed 3"     # exercise 27: which bug is it?
    .venv/bin/python lessons/27_bug_zoo.py --bug hsdp-seed --world-size 4

Doc: docs/27_bug_zoo.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 27_bug_zoo/
sys.path.insert(1, str(Path(__file__).resolve().parent / "26_parity_oracle"))  # lesson 26's oracle and layouts
sys.path.insert(1, str(Path(__file__).resolve().parent / "17_tensor_parallel"))  # lesson 17's collectives (for 26's tp)
sys.path.insert(1, str(Path(__file__).resolve().parent / "21_context_parallel"))  # lesson 21's ring (for 26's cp)

import torch

import bug_zoo
import parity_oracle
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--bug", choices=[*bug_zoo.ZOO, "mystery"], default=None,
                        help="one bug of the zoo (default: all of them, in order); mystery: one chosen "
                             "by --seed and not named (exercise 27)")
    parser.add_argument("--steps", type=positive_int, default=bug_zoo.STEPS,
                        help="optimizer steps of every run (dcp-initial-lr saves and resumes half-way)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches (and the mystery's choice)")
    return bug_zoo.check_flags(parser, parser.parse_args())  # world size 2 or 4; enough steps to resume


def main() -> None:
    args = parse_args()
    claim_out(out_dir("27", args.out))  # checked now, not after training; ours alone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, *plan_device(args.device, args.world_size)), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    hidden = args.bug == "mystery"
    names = [bug_zoo.mystery(args.seed)] if hidden else [args.bug] if args.bug else list(bug_zoo.ZOO)
    bugs = [bug_zoo.ZOO[name] for name in names]
    ui.title(f"Lesson 27: a zoo of real upstream bugs, {'a mystery' if hidden else ', '.join(names)} on "
             f"{world} processes" + (f" ({note})" if note else ""))

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
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()}); "
             f"{args.steps} steps of lesson 13's recipe per run, on {world} ranks")

    # Step 2: Re-create each bug and measure its symptom against the baseline
    # The bug's file trains lesson 13's recipe its own way, with the upstream mistake in its loop.
    # The baseline is lesson 13 in one process, plus what the bug's recipe adds (clipping, a
    # schedule): the run a correct layout ends within 1e-3 of.
    ui.step(2, "Re-create each bug and measure its symptom against the baseline")
    timer = Timer()
    found = {}
    for bug in bugs:
        run, base, symptom = bug_zoo.recreate(bug, rank, world, args.steps, args.seed, device)
        found[bug.NAME] = {"run": run, "base": base, "symptom": symptom}
        if rank == 0:
            for line in bug_zoo.symptom_lines(bug, symptom, args.steps, hidden):
                ui.print(line)

    # Step 3: Catch each bug: lesson 26's oracle, or the check that caught it upstream
    # The oracle records step 1 of the bug's run and its float64 twin, beside lesson 13's one
    # process and its twin, and names the first entry whose difference is more than rounding.
    ui.step(3, "Catch each bug: lesson 26's oracle, or the check that caught it upstream")
    for bug in bugs:
        caught = bug_zoo.catch(bug, rank, world, args.seed, device, found[bug.NAME]["run"])
        found[bug.NAME]["caught"] = caught
        if rank == 0 and caught["rows"]:
            ui.table(f"{'the mystery' if hidden else bug.NAME}: step 1's entries up to the first divergence",
                     parity_oracle.COLUMNS, parity_oracle.table_rows(caught["rows"]))
        if rank == 0:
            for line in bug_zoo.caught_lines(bug, caught, hidden, world):
                ui.print(line)

    # Step 4: Fix each bug and measure it against the same baseline
    # The fix is the one upstream made (or the rule it restored); the fixed run must end within
    # Part 2's tolerance of the baseline. The mystery keeps its fix until you have named it.
    ui.step(4, "Fix each bug and measure it against the same baseline")
    for bug in ([] if hidden else bugs):
        fixed_run, fixed = bug_zoo.fix(bug, rank, world, args.steps, args.seed, device, found[bug.NAME]["base"])
        found[bug.NAME]["fixed"] = fixed
        if rank == 0:
            for line in bug_zoo.fixed_lines(bug, fixed):
                ui.print(line)
    if hidden:
        ui.print("the mystery's fix stays hidden: name the bug in exercises/27_mystery_bug.py, then make check-27")
    wall = timer.seconds
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return

    # Step 5: Save the zoo's table
    # One row per bug: where it came from, how far its symptom went, what caught it, and how
    # close the fix came back. metrics.json keeps them as `bugs`.
    ui.step(5, "Save the zoo's table")
    rows = [] if hidden else [bug_zoo.row(bug, found[bug.NAME]["symptom"], found[bug.NAME]["caught"],
                                          found[bug.NAME]["fixed"]) for bug in bugs]
    if rows:
        ui.table("The zoo: every symptom against the baseline, and every fix", bug_zoo.TABLE_COLUMNS,
                 bug_zoo.table_rows(rows))
    folder = out_dir("27", args.out)
    first = found[names[0]]
    save_results(folder, first["run"].state, make_metrics(
        lesson="27", world_size=world, backend=backend_for(device), device=str(device),
        losses=first["run"].losses, final_accuracy=None, wall_seconds=wall, samples=args.steps * T.GLOBAL_BATCH,
        steps=args.steps, seed=args.seed, bug=args.bug, bugs=rows,
        mystery=bug_zoo.mystery_metrics(first) if hidden else None))
    ui.print(f"wrote {shown(folder / 'final.pt')} (the {'mystery' if hidden else names[0]} run's weights) and "
             f"{shown(folder / 'metrics.json')}; {wall:.0f}s for {len(bugs)} bug{'s' if len(bugs) > 1 else ''}")


if __name__ == "__main__":
    run(main)
