"""Step 9 of lesson 12: save on rank 0, then barrier, then load; two races without.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/saving.py
    .venv/bin/python lessons/12_pitfalls/saving.py --break save-every-rank
    .venv/bin/python lessons/12_pitfalls/saving.py --break no-barrier
or as part of the whole lesson: make lesson-12 ARGS="--break save-every-rank".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 9.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks (Steps 1, 2, 10) and this step only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

import io

import torch
import torch.distributed as dist
from rich.markup import escape

from common import recipe
from apparatus.results import atomic_write, out_dir, shown
from apparatus.ui import Timer
from kit import gather, leave

STEP = 9
NAMES = ['save-every-rank', 'no-barrier']  # its --break modes


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # Under DDP every rank holds the same weights, so one writer is enough: rank 0. Every rank
    # writing the same path is N times the I/O and a race on one file. And a rank that reads
    # the checkpoint must wait until it is complete: that is the barrier's job. We write to a
    # temporary file and rename it (apparatus.results.atomic_write): readers never see half.
    folder = out_dir("12", args.out)
    path = folder / "checkpoint.pt"
    weights = recipe.make_model(args.seed).state_dict()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # no stale file from an earlier run
    dist.barrier()

    if args.brk == "save-every-rank":
        # Every rank calls torch.save(weights, path). To make the race happen every time (in
        # real jobs: now and then), rank 1 is held halfway through its write while rank 0,
        # done with its own save, reads the file back. The store is the referee here.
        blob = io.BytesIO()
        torch.save(weights, blob)
        blob = blob.getvalue()
        if rank not in (0, 1):
            torch.save(weights, path)
        dist.barrier()
        if rank == 0:
            torch.save(weights, path)
            store.set("rank0-saved", "1")
            store.wait(["rank1-half-written"])
            try:
                torch.load(path, weights_only=True)
                ui.say_all("loaded the checkpoint: this time the race was won")
                code = 0
            except Exception as exc:
                ui.say_all(f"torch.load({shown(path)}) while rank 1 is still writing it: "
                           f"{type(exc).__name__}: {escape(str(exc))}")
                code = 1
            store.set("rank0-loaded", "1")
            store.wait(["rank1-done"])  # rank 0 hosts the store: stay until rank 1 is done
            leave(code)
        if rank == 1:
            store.wait(["rank0-saved"])
            with open(path, "wb") as f:  # what torch.save(weights, path) does: truncate, write
                f.write(blob[:len(blob) // 2])
                f.flush()
                ui.say_all(f"torch.save halfway: {len(blob) // 2} of {len(blob)} bytes written")
                store.set("rank1-half-written", "1")
                store.wait(["rank0-loaded"])
                f.write(blob[len(blob) // 2:])
            ui.say_all("finished writing: the file is whole again, but rank 0 already failed")
            store.set("rank1-done", "1")
        leave(0)

    if args.brk == "no-barrier":
        # Rank 0 saves, the others load at once: no barrier between. To lose the race every
        # time (in real jobs: only sometimes, which is worse), rank 0 is slow on purpose: it
        # waits, through the store, until every other rank has looked for the file.
        others = range(1, world_size)
        if rank == 0:
            store.wait([f"rank{r}-looked" for r in others])
            atomic_write(path, lambda f: torch.save(weights, f))
            ui.say_all(f"wrote {shown(path)}, after the others had looked for it")
            store.set("rank0-wrote", "1")
            store.wait([f"rank{r}-done" for r in others])  # rank 0 hosts the store: stay
            leave(0)
        try:
            torch.load(path, weights_only=True)
            ui.say_all("loaded the checkpoint: this time the race was won")
            code = 0
        except FileNotFoundError as exc:
            ui.say_all(f"torch.load right away, no barrier: FileNotFoundError: {escape(str(exc))}")
            code = 1
        store.set(f"rank{rank}-looked", "1")
        store.wait(["rank0-wrote"])
        torch.load(path, weights_only=True)
        ui.say_all("loaded it fine once rank 0 had written it: a barrier would have waited for that")
        store.set(f"rank{rank}-done", "1")
        leave(code)

    timer = Timer()
    if rank == 0:
        atomic_write(path, lambda f: torch.save(weights, f))
    writes = gather(rank == 0)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    loaded = torch.load(path, weights_only=True)
    diff = max((loaded[k] - weights[k]).abs().max().item() for k in weights)
    diffs = gather(diff)
    ui.print(f"fixed: rank 0 wrote {shown(path)} ({sum(writes)} write in all), barrier(), then "
             f"every rank loaded it in {timer.seconds * 1000:.0f} ms")
    ui.print(f"max |loaded - own weights| per rank: {[f'{d:.1e}' for d in diffs]}")
    evidence["saving"] = {"writes": sum(writes), "max_diff_after_load": max(diffs)}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "save-every-rank": (
        "Symptom: loading the checkpoint failed (a truncated file) while another rank was still "
        "writing the same path; in real jobs this happens only sometimes. Cause: every rank "
        "called torch.save on one path, and a write truncates the file first. Fix: save on rank "
        "0 only (the weights are the same everywhere), to a temporary file that you rename "
        "into place, and make the others wait at a barrier before they load."),
    "no-barrier": (
        "Symptom: FileNotFoundError (or, worse, a stale checkpoint from an earlier run) on the "
        "ranks that load right after rank 0 was asked to save. Cause: nothing made them wait "
        "for rank 0 to finish writing. Fix: dist.barrier() between rank 0's save and the other "
        "ranks' load, and write atomically (temporary file, then rename)."),
}
