"""Lesson 12: pitfalls and hangs, each one reproduced in seconds and then fixed.

New since lesson 05: no new API, but the bugs everyone hits once. The default run walks
through every pitfall in its *fixed* form and prints the evidence that the fix works.
`--break NAME` runs one pitfall in its *broken* form: you see the symptom (a wrong number,
an error, or a hang that a short timeout ends), then one paragraph with the symptom, the
cause and the fix. Errors exit non-zero; the silent bugs exit 0 and print the wrong
numbers next to the right ones. Every broken mode ends on its own, within the --timeout
(10 s here, so that hangs end quickly) plus start-up.

Run:
    make lesson-12                                   # every pitfall, fixed
    make lesson-12 ARGS="--break set-epoch"          # one pitfall, broken
    .venv/bin/python lessons/12_pitfalls.py --break collective-order --debug-detail
    .venv/bin/python lessons/12_pitfalls.py --world-size 3 --break eval-padding

The --break names, in the order of the steps:
    busy-port           start the job on a port that another process holds
    rank-crash          one rank raises while the others wait in a collective
    set-epoch           forget sampler.set_epoch(epoch): every epoch has the same order
    same-seed           seed the augmentation with the same seed on every rank
    collective-missing  a collective called on rank 0 only: a hang, ended by the timeout
    collective-order    collectives in a different order on different ranks
    unused-params       a parameter without a gradient, and no find_unused_parameters=True
    batchnorm           BatchNorm statistics computed per rank, not over the global batch
    eval-padding        evaluation with DistributedSampler, which pads with duplicates
    save-every-rank     every rank writes the same checkpoint file
    no-barrier          rank 1 loads the checkpoint before rank 0 has written it

This file starts the ranks (Step 1), joins them (Step 2) and leaves (Step 10); each of
Steps 3-9 is one short file in lessons/12_pitfalls/, runnable on its own (2 ranks, that step
only), e.g. `.venv/bin/python lessons/12_pitfalls/set_epoch.py --break set-epoch`; kit.py there
holds the helpers they share (run a collective, leave a rank, gather).

Doc: docs/12_pitfalls.md
"""
import contextlib
import datetime
import io
import json
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 12_pitfalls/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from rich.markup import escape

import batchnorm
import collectives
import eval_padding
import same_seed
import saving
import set_epoch
import start
import unused_params
from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run
from common.distributed import choose_port, spawn, teardown
from apparatus.results import atomic_write, claim_out, out_dir, shown
from apparatus.ui import UI, Timer
from kit import collective, first_line, leave

# Steps 3-9, each one file in lessons/12_pitfalls/; Steps 1, 2 and 10 are in this file.
PITFALLS = [set_epoch, same_seed, collectives, unused_params, batchnorm, eval_padding, saving]
BREAKS = dict(start.STEPS)  # --break NAME -> the step that shows it
BREAKS.update({name: pitfall.STEP for pitfall in PITFALLS for name in pitfall.NAMES})
ONLY = {"start": 2, **{pitfall.__name__: pitfall.STEP for pitfall in PITFALLS}}
MAX_WORLD = 4    # every demo needs 2 ranks at least; more only shares 2 cores thinner


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.set_defaults(timeout=10.0)  # short, so that the hang demos end in seconds
    parser.add_argument("--break", dest="brk", choices=list(BREAKS), default=None,
                        help="run one pitfall in its broken form; each name is explained at the top of "
                             "this file and in docs/12_pitfalls.md")
    parser.add_argument("--debug-detail", action="store_true",
                        help="set TORCH_DISTRIBUTED_DEBUG=DETAIL for the ranks (checks every "
                             "collective's type and shapes across ranks before running it)")
    parser.add_argument("--only", choices=list(ONLY), default=None,
                        help="run one step's pitfall (fixed, or broken with --break), as "
                             "lessons/12_pitfalls/NAME.py does when you run it on its own")
    parser.add_argument("--seed", type=nonnegative_int, default=recipe.SEED,
                        help="seed for the initial weights and the sample order")
    parser.add_argument("--epochs", type=positive_int, default=recipe.EPOCHS,
                        help="epochs of sample orders to show in the set_epoch step")
    args = parser.parse_args()
    if not 2 <= args.world_size <= MAX_WORLD:
        fail(f"--world-size {args.world_size}: every pitfall here needs 2 to {MAX_WORLD} ranks")
    if args.device == "cuda":
        fail("lesson 12 reproduces every pitfall on the CPU with gloo, so that each one "
             "behaves the same on every machine; run it with --device cpu (or auto)")
    if args.only and args.brk and BREAKS[args.brk] != ONLY[args.only]:
        fail(f"--break {args.brk} is a pitfall of Step {BREAKS[args.brk]}, not of --only "
             f"{args.only} (Step {ONLY[args.only]}); leave one of the two out")
    if args.debug_detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read by every rank at init
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    if detail and args.brk in (None, "unused-params") and args.only in (None, "unused_params"):
        # Measured on torch 2.14.1 with gloo: DDP's constructor dies with SIGSEGV in
        # DistributedDataParallel.__init__ (logger.set_construction_data_and_log) under DETAIL.
        fail("TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP's constructor (SIGSEGV) on torch "
             f"{torch.__version__} with gloo, and this run builds a DDP model; use DETAIL "
             "with --break collective-missing or collective-order, or use INFO")
    return args


def main() -> None:
    args = parse_args()
    claim_out(out_dir("12", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    mode = f"--break {args.brk}" if args.brk else "every pitfall, fixed"
    ui.title(f"Lesson 12: pitfalls and hangs ({mode}) on {args.world_size} CPU ranks")

    # Step 1: Start the ranks on a free port
    # Rank 0 hosts the rendezvous store on MASTER_PORT; if another program already listens
    # there, the store cannot open it. choose_port() checks *before* any rank starts and
    # says so in one line; without it the job fails inside the ranks (--break busy-port).
    ui.step(1, "Start the ranks on a free port")
    blocker = None
    if args.brk == "busy-port":
        blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            blocker.bind(("127.0.0.1", args.master_port or 0))
            blocker.listen()  # now the port is busy, like a job that is still running
            port = blocker.getsockname()[1]
            ui.print(f"this process now listens on 127.0.0.1:{port}, standing in for another job")
        except OSError:  # --master-port names a port that is busy already: even better
            blocker.close()
            blocker, port = None, args.master_port
            ui.print(f"127.0.0.1:{port} is busy already (another program listens there)")
        said = io.StringIO()
        with contextlib.redirect_stderr(said):  # fail() writes its one line to stderr
            try:
                choose_port(port)
            except SystemExit:
                pass
        ui.print(f"with the check, before any rank starts: {escape(said.getvalue().strip())}")
        ui.print("without the check: the ranks start on that port anyway ...")
    else:
        port = choose_port(args.master_port)
        ui.print(f"MASTER_PORT={port}: choose_port() made sure nothing listens there")
    debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
    ui.print(f"spawn(worker, nprocs={args.world_size}); collectives time out after "
             f"{args.timeout:g}s; TORCH_DISTRIBUTED_DEBUG={debug}")
    ui.pause(next_step=(2, "Join the process group with a short timeout"))

    timer = Timer()
    try:
        spawn(worker, (args.world_size, args, port), args.world_size)
    except SystemExit:  # spawn() has printed the one-line error; now say what it means
        explain(ui, args.brk, timer.seconds)
        raise
    finally:
        if blocker is not None:
            blocker.close()
    if args.brk:
        explain(ui, args.brk, timer.seconds)
    else:
        ui.print(f"\nevery pitfall ran in its fixed form in {timer.seconds:.1f}s; now break one, "
                 f"e.g. make lesson-12 ARGS=\"--break set-epoch\"")


def explain(ui: UI, name: str | None, seconds: float) -> None:
    if name is None:
        return
    ui.print(f"\n[bold]What went wrong (--break {name}; the job ended after {seconds:.1f}s)[/bold]")
    # under DETAIL the mismatched collectives fail at once instead of hanging: say that
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    text = explanation(name, detail)
    ui.print(textwrap.fill(text, width=92), markup=False)


def explanation(name: str, detail: bool) -> str:
    """The paragraph for --break NAME, from the file that holds the pitfall."""
    for module in [start, *PITFALLS]:
        if name in getattr(module, "EXPLAIN", {}):
            return getattr(module, "EXPLAIN_DETAIL", {}).get(name, module.EXPLAIN[name]) \
                if detail else module.EXPLAIN[name]
    raise KeyError(name)


def worker(rank: int, world_size: int, args, port: int) -> None:
    """What every rank runs: join, then the pitfalls (all of them, or the one to break)."""
    ui = UI(rank, world_size, step_mode=args.step)
    torch.set_num_threads(1)  # 2 cores, 2+ ranks: one thread each, no fighting
    brk = args.brk

    # Step 2: Join the process group with a short timeout
    # We create the store ourselves (init_method="env://" did it for us in lesson 05) to use
    # it below as a referee that works even when collectives are stuck. The timeout bounds
    # the rendezvous *and* every collective: a rank that never answers becomes an error
    # after --timeout seconds instead of a frozen terminal. A rank that *crashes* ends the
    # job sooner: spawn() sees the dead process and stops the others (--break rank-crash).
    ui.step(2, "Join the process group with a short timeout")
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
    except Exception as exc:  # --break busy-port: the port is taken
        ui.say_all(f"dist.TCPStore(port={port}) failed: {escape(first_line(exc))}")
        leave(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    ones = torch.ones(1)
    if brk == "rank-crash" and rank == 1:
        time.sleep(0.5)  # let the others get into their all_reduce first
        raise RuntimeError("rank 1 crashed on purpose (--break rank-crash) while the others wait")
    if brk == "rank-crash":
        ui.say_all("waiting in all_reduce for rank 1 ...")
    collective(ui, "all_reduce(ones)", lambda: dist.all_reduce(ones),
               wait_if_peer_died=args.timeout if brk == "rank-crash" else 0.0)
    ui.print(f"all_reduce(ones) = {ones.item():g} on every rank: all {world_size} ranks are here")

    data = recipe.load_data()
    evidence: dict = {"world_size": world_size, "break": brk, "timeout_s": args.timeout}
    steps = {BREAKS[brk]} if brk else {ONLY[args.only]} if args.only else set(range(3, 10))

    # Step 3: Call set_epoch every epoch
    # DistributedSampler shuffles with seed + epoch; forget set_epoch() and every epoch
    # replays epoch 0's order (lessons/12_pitfalls/set_epoch.py).
    if 3 in steps:
        ui.step(3, "Call set_epoch every epoch")
        set_epoch.run(ui, rank, world_size, args, data, store, evidence)

    # Step 4: Give each rank its own augmentation seed
    # Same seed everywhere: right for the weights, wrong for augmentation (same_seed.py).
    if 4 in steps:
        ui.step(4, "Give each rank its own augmentation seed")
        same_seed.run(ui, rank, world_size, args, data, store, evidence)

    # Step 5: Call every collective on every rank, in the same order
    # Ranks pair collectives by order, not by name: a missing one hangs, swapped ones hang
    # or silently swap values (collectives.py).
    if 5 in steps:
        ui.step(5, "Call every collective on every rank, in the same order")
        collectives.run(ui, rank, world_size, args, data, store, evidence)

    # Step 6: Tell DDP about parameters it will not use
    # A parameter without a gradient never reports to DDP's reducer (unused_params.py).
    if 6 in steps:
        ui.step(6, "Tell DDP about parameters it will not use")
        unused_params.run(ui, rank, world_size, args, data, store, evidence)

    # Step 7: Synchronise BatchNorm statistics
    # BatchNorm normalises with the per-rank batch, not the global one (batchnorm.py).
    if 7 in steps:
        ui.step(7, "Synchronise BatchNorm statistics")
        batchnorm.run(ui, rank, world_size, args, data, store, evidence)

    # Step 8: Evaluate every sample exactly once
    # DistributedSampler pads with repeats; all-reduce sums, not averages (eval_padding.py).
    if 8 in steps:
        ui.step(8, "Evaluate every sample exactly once")
        eval_padding.run(ui, rank, world_size, args, data, store, evidence)

    # Step 9: Save on rank 0, then barrier, then load
    # One writer, written atomically, and nobody reads before the barrier (saving.py).
    if 9 in steps:
        ui.step(9, "Save on rank 0, then barrier, then load")
        saving.run(ui, rank, world_size, args, data, store, evidence)

    leave_group(ui, rank, args, evidence)



def leave_group(ui, rank, args, evidence) -> None:
    # Step 10: Leave the process group
    # The clean exit, for runs where nothing failed: free what holds the group (the DDP
    # models are gone with their steps), gc.collect(), destroy (common.distributed.teardown).
    # After a *failed* collective we never get here: see leave() below.
    ui.step(10, "Leave the process group")
    dist.barrier()
    if rank == 0:
        text = json.dumps(evidence, indent=2) + "\n"
        folder = out_dir("12", args.out)
        atomic_write(folder / "metrics.json", lambda f: f.write(text.encode()))
        ui.print(f"wrote the numbers above to {shown(folder / 'metrics.json')}")
    teardown()
    ui.print("done: every rank left the process group cleanly")


if __name__ == "__main__":
    run(main)
