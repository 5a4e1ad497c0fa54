"""What lesson 28 prints in Steps 4-8, from the evidence hang_evidence.py read.

Each function is one step of lessons/28_hang_lab.py's read_back (docs/28_hang_lab.md): the
timeline of the hang, the recorders side by side, the check-ins, the stacks, the verdict.
"""
from __future__ import annotations

import json
import textwrap

from rich.markup import escape

import hang_evidence
from apparatus.results import shown


def _clock(started: float | None, first: float):
    origin = started if started is not None else first
    return lambda t: f"{t - origin:+6.1f}s"


def timeline(ui, store, key: str, world: int, events: list, started: float | None, ended: float,
             launcher_line: str) -> list[tuple[float, str]]:
    """Step 4: every alarm, failure and action, on the clock of the planted bug."""
    lines = list(events)
    for rank in range(world):
        if store.check([f"{key}suspect/{rank}"]):
            when, what, waited = json.loads(store.get(f"{key}suspect/{rank}"))
            lines.append((when, f"rank {rank}'s watchdog: {what} has waited {waited:.1f}s: a suspected hang"))
        if store.check([f"{key}failed/{rank}"]):
            when, message = json.loads(store.get(f"{key}failed/{rank}"))
            lines.append((when, f"rank {rank}'s collective failed: {hang_evidence.plain(message).split('. ')[0][:110]}"))
    if not lines and started is None:
        ui.print("no watchdog fired and no collective failed: the job ran to its end")
        return lines
    if started is not None:
        lines.append((started, "the planted bug fires (the lab's own clock, not an instrument)"))
    lines.append((ended, "the last rank has ended: the job is over"))
    lines.sort()
    clock = _clock(started, lines[0][0])
    for when, what in lines:
        ui.print(f"{clock(when)}  {escape(what)}")
    if launcher_line:
        ui.print(f"the launcher's own line: [italic]{escape(launcher_line.splitlines()[-1])}[/italic] "
                 f"(it names the first rank to leave; that is rarely the culprit)")
    return lines


def recorders(ui, ev: hang_evidence.Evidence) -> dict | None:
    """Step 5: the last collectives of every rank, side by side, and who is behind."""
    if not ev.dumps:
        ui.print("no rank left a flight recorder dump")
        return None
    columns, rows = hang_evidence.side_by_side(ev.dumps, ev.world)
    found = hang_evidence.first_divergence(ev.dumps)
    missing = [r for r in range(ev.world) if r not in ev.dumps]
    if found is None and not missing:
        count = len(hang_evidence.collectives(next(iter(ev.dumps.values()))))
        ui.print(f"every rank recorded the same {count} collectives, in the same order, all completed")
        return None
    ui.table("the flight recorders, side by side (WAITING: enqueued, never completed)", columns, rows)
    last = {r: hang_evidence.last_seq(d) for r, d in ev.dumps.items()}
    ahead = max(v for v in last.values() if v is not None)
    behind = [r for r, v in sorted(last.items()) if v is not None and v < ahead]
    ui.print(f"last collective called: {', '.join(f'rank {r} #{v}' for r, v in sorted(last.items()))}"
             + (f"; behind: rank {', '.join(map(str, behind))}" if behind else "; nobody is behind"))
    if found is not None:
        ui.print(f"the first difference is at #{found['seq']}: ranks "
                 f"{', '.join(map(str, (found['majority'] or {}).get('ranks', [])))} agree, "
                 f"rank {', '.join(map(str, found['odd']))} differ")
    if missing:
        ui.print(f"no dump from rank {', '.join(map(str, missing))}: its recorder never reached the disk")
    return found


def check_ins(ui, ev: hang_evidence.Evidence, hung: bool) -> None:
    """Step 6: what the monitored barrier told each rank."""
    if not ev.check_ins:
        ui.print("nobody got to the monitored barrier: the job ended first (a crash ends it at once)")
        return
    for rank in range(ev.world):
        said = ev.check_ins.get(rank)
        if said is None:
            ui.print(f"rank {rank}: never checked in (no file)")
        elif said["passed"]:
            ui.print(f"rank {rank}: checked in, and so did every other rank")
        else:
            ui.print(f"rank {rank}: {escape(hang_evidence.plain(said['error'])[:160])}")
    named = hang_evidence.never_checked_in(ev.check_ins, ev.world)
    if named:
        ui.print(f"[bold]never checked in: rank {', '.join(map(str, named))}[/bold] (dead, or stuck "
                 f"outside any collective)")
    elif all(c["passed"] for c in ev.check_ins.values()):
        ui.print("every rank checked in" + (": all were alive, each waiting in a collective" if hung else ""))


def stacks(ui, ev: hang_evidence.Evidence, pyspy: str | None, taken: bool, late: bool) -> None:
    """Step 7: each rank's main thread, by faulthandler and by py-spy. late: the stacks were
    taken after a collective had failed (no watchdog suspected anything first)."""
    if not taken:
        ui.print("no stack was taken: no watchdog suspected a hang. Take one yourself while a job runs: "
                 "kill -USR1 <pid> (the world table's pids), then read runs/lesson-28/stack_rank_<N>.txt")
        return
    if late:
        ui.print("no watchdog suspected a hang first: a collective failed at once, so these stacks show "
                 "the ranks after it failed, not where anything waited")
    for rank in range(ev.world):
        frames = ev.stacks.get(rank)
        if rank in ev.aborts:
            message, died = ev.aborts[rank]
            ui.print(f"rank {rank}: died of SIGABRT; as it died, faulthandler printed (log_rank_{rank}.txt): "
                     f"{hang_evidence.call_made(died or [])} at {hang_evidence.ours(died or [])}")
        elif frames:
            ui.print(f"rank {rank}: in {hang_evidence.call_made(frames)}, called at {hang_evidence.ours(frames)} "
                     f"(innermost: {frames[0][1]} at {frames[0][0]})")
        else:
            ui.print(f"rank {rank}: no stack: it never answered SIGUSR1")
    if not pyspy:
        ui.print("py-spy is not installed here, so only faulthandler's stacks (from inside each rank) "
                 "are shown; `pip install py-spy` adds a view from outside, with --native the C++ frames")
        return
    for rank in range(ev.world):
        text = ev.pyspy.get(rank) or ""
        if not text:
            continue
        if text.startswith("py-spy failed"):
            ui.print(f"py-spy, rank {rank}: {escape(textwrap.shorten(text, 110, placeholder=' ...'))}")
            continue
        main = text.split('"MainThread"', 1)[-1].splitlines()[1:]
        mine = next((line.strip() for line in main if "lessons/" in line or "28_hang_lab" in line), "?")
        ui.print(f"py-spy, rank {rank}: {escape(main[0].strip() if main else '?')} ... {escape(mine)}")


def verdict(ui, args, found: dict | None, truth: dict | None, metrics: dict, folder) -> None:
    """Step 8: the verdict, checked against the planted bug (not for a mystery)."""
    if args.hang == "mystery":
        ui.print("this hang is a mystery: the evidence above is all there is. Name the rank, the call "
                 "and its file:line in exercises/28_hang_mystery.py, then: make check-28")
    elif found is None:
        ui.print("[bold]the evidence names nobody[/bold]")
    else:
        ui.print(f"[bold]the culprit: rank {found['rank']}, {found['operation']} at {found['where']}[/bold] "
                 f"({found['kind']})")
        ui.print(f"because {escape(found['because'])}")
    if truth is not None:
        ui.print(f"the planted bug: rank {truth['rank']}, {truth['operation']} at {truth['where']}: "
                 + ("[green]the diagnosis is right[/green]" if metrics["right"] else "[red]the diagnosis is WRONG[/red]"))
    if metrics["ended_after_seconds"] is not None:
        ui.print(f"the job ended {metrics['ended_after_seconds']:g}s after the bug fired (timeout "
                 f"{args.timeout:g}s + at most {metrics['bound_seconds']:g}s); wrote {shown(folder / 'metrics.json')}")
