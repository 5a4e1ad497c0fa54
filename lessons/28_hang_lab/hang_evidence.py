"""Read what a hung job of lesson 28 left behind, side by side, and name the culprit.

Lesson 28 (lessons/28_hang_lab.py, docs/28_hang_lab.md) collects the evidence; this module
only reads it, so that the verdict comes from the files, as it would for a job you did not write:

* every rank's flight recorder (fr_rank_<N>.json): its collectives in order, each with its
  sequence number, sizes, whether it was still waiting, and the Python line that called it;
* every rank's check-in at the monitored barrier after the timeout (check_in_rank_<N>.json);
* every rank's Python stack at the moment the hang was suspected (stack_rank_<N>.txt, written
  by faulthandler on SIGUSR1) and py-spy's view from outside (pyspy_rank_<N>.txt);
* every rank's own log (log_rank_<N>.txt): its stderr, where gloo and faulthandler write.

`collect(folder, world)` reads them all; `diagnose(evidence)` says who, which call and where.
Plain data throughout: a dump is unpickled with every class refused, and written as JSON.
"""
from __future__ import annotations

import functools
import io
import json
import pickle
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
LESSONS = ROOT / "lessons"
SIZE_ABORT = "Received data size doesn't match expected size"  # gloo's check, then abort()
STATES = ("fr_rank_", "check_in_rank_", "stack_rank_", "pyspy_rank_", "log_rank_")


# --- the flight recorder ------------------------------------------------------------------

class _PlainData(pickle.Unpickler):
    """torch's flight recorder dump is a pickle of dicts, lists and numbers. Refusing every
    class (find_class) means that loading it can build nothing else, so it can run no code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a flight recorder dump holds plain data, not {module}.{name}")


def where(file: str, line: int) -> str:
    """A frame's place as the learner reads it: relative to the repository when inside it."""
    return f"{_shown_file(file)}:{line}"


@functools.lru_cache(maxsize=None)
def _shown_file(file: str) -> str:
    path = Path(file).resolve()  # once per file: a dump has thousands of frames, a few files
    if "site-packages" in path.parts:  # torch's own files: from the package on
        return "/".join(path.parts[path.parts.index("site-packages") + 1:])
    python = re.split(r"/lib/python3\.\d+/", path.as_posix())
    if len(python) > 1:  # Python's own files: threading.py, queue.py
        return python[-1]
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return file


def dump_as_json(raw: bytes) -> str:
    """The recorder's pickle (torch._C._distributed_c10d._dump_fr_trace) as JSON, each entry's
    Python frames kept as "file:line in function" (the JSON dump of torch 2.14.1 has none)."""
    dump = _PlainData(io.BytesIO(raw)).load()
    for entry in dump.get("entries", []):
        entry["frames"] = [f"{where(f['filename'], f['line'])} in {f['name']}" for f in entry.get("frames", [])]
    return json.dumps(dump, indent=1, default=str)


def read_dumps(folder: Path, world: int) -> dict[int, dict]:
    """{rank: dump} for every rank that wrote one."""
    dumps = {}
    for rank in range(world):
        path = Path(folder) / f"fr_rank_{rank}.json"
        if path.exists():
            dumps[rank] = json.loads(path.read_text())
    return dumps


def collectives(dump: dict) -> dict[int, dict]:
    """{sequence number: entry} of the default process group's collectives."""
    return {int(e["collective_seq_id"]): e for e in dump.get("entries", [])
            if not e.get("is_p2p") and int(e.get("pg_id", 0)) == 0}


def _frames(frames: list[str]) -> list[tuple[str, str]]:
    """["file:line in name", ...] -> [(file:line, name)], innermost first."""
    return [tuple(f.rsplit(" in ", 1)) for f in frames if " in " in f]


def ours(frames: list[tuple[str, str]]) -> str | None:
    """The innermost frame in the lessons' own code: the line that made the call."""
    return next((place for place, _ in frames if place.startswith("lessons/")), None)


def call_made(frames: list[tuple[str, str]]) -> str | None:
    """What our line called: the frame just inside it (torch's logging wrapper skipped), or
    our own function when it is the innermost frame (a loop of ours)."""
    inside = None
    for place, name in frames:
        if place.startswith("lessons/"):
            return inside or name
        if "c10d_logger.py" not in place:
            inside = name
    return None


def plain(message: str) -> str:
    """An error without the C++ source path gloo puts first ('[/__w/.../pair.cc:561] ')."""
    return re.sub(r"^(\[[^\]]*\]:?\s*)+", "", str(message).strip())


def operation(entry: dict) -> str:
    """'gloo:all_reduce' -> 'all_reduce'."""
    return entry["profiling_name"].split(":")[-1]


def entry_place(entry: dict) -> str | None:
    return ours(_frames(entry.get("frames", [])))


def describe(entry: dict | None) -> str:
    """One cell of the side-by-side table: the call, its sizes, its line, and if it waits."""
    if entry is None:
        return "-"
    sizes = "x".join(map(str, entry["input_sizes"][0])) if entry.get("input_sizes") else ""
    place = (entry_place(entry) or "?").replace("lessons/", "")
    waiting = " WAITING" if not entry.get("retired") else ""
    return f"{operation(entry)} [{sizes}] {place}{waiting}"


def last_seq(dump: dict | None) -> int | None:
    seqs = collectives(dump or {})
    return max(seqs) if seqs else None


def what_follows(seqs: dict[int, dict], n: int) -> str | None:
    """On one rank: the line that came right after the call at seq n's line, the last time
    that line ran before n (the job repeats its step, so its history says what is normal)."""
    place = entry_place(seqs[n])
    earlier = [m for m in seqs if m < n and entry_place(seqs[m]) == place and m + 1 in seqs]
    return entry_place(seqs[max(earlier) + 1]) if earlier else None


def first_divergence(dumps: dict[int, dict]) -> dict | None:
    """The first sequence number where the ranks that dumped differ: what most of them called
    there ('majority'), and the odd ranks, each with what it called there (None: nothing)."""
    seqs = {rank: collectives(d) for rank, d in dumps.items()}
    every = sorted(set().union(*seqs.values())) if seqs else []
    for n in every:
        calls = {rank: s.get(n) for rank, s in seqs.items()}
        key = {rank: (operation(e), entry_place(e)) if e else None for rank, e in calls.items()}
        votes = Counter(k for k in key.values() if k)
        if len(votes) == 1 and all(key.values()):
            continue
        (majority, count), = votes.most_common(1)
        if count * 2 <= len(dumps):  # no majority: e.g. two ranks that disagree
            return {"seq": n, "majority": None, "odd": sorted(dumps), "calls": calls}
        odd = sorted(r for r, k in key.items() if k != majority)
        first = next(r for r, k in key.items() if k == majority)
        return {"seq": n, "majority": {"operation": majority[0], "where": majority[1],
                                       "ranks": sorted(r for r, k in key.items() if k == majority),
                                       "then": what_follows(seqs[first], n)},
                "odd": odd, "calls": calls}
    return None


def side_by_side(dumps: dict[int, dict], world: int, before: int = 3) -> tuple[list[str], list[list[str]]]:
    """Columns and rows: the last collectives of every rank, one row per sequence number, from
    a few before the first difference (or before the end) to the last one anybody called."""
    seqs = {rank: collectives(d) for rank, d in dumps.items()}
    every = sorted(set().union(*seqs.values())) if seqs else []
    if not every:
        return [], []
    found = first_divergence(dumps)
    start = (found["seq"] if found else every[-1]) - before
    columns = ["#"] + [f"rank {r}" for r in range(world)]
    rows = []
    for n in (m for m in every if m >= start):
        rows.append([str(n)] + [describe(seqs[r].get(n)) if r in seqs else "(no dump)" for r in range(world)])
    return columns, rows


# --- the check-ins, the stacks, the logs --------------------------------------------------

def read_check_ins(folder: Path, world: int) -> dict[int, dict]:
    """{rank: {"passed": bool, "error": str}} for every rank that got to the monitored barrier."""
    found = {}
    for rank in range(world):
        path = Path(folder) / f"check_in_rank_{rank}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text())
    return found


def never_checked_in(check_ins: dict[int, dict], world: int) -> list[int] | None:
    """The ranks the monitored barrier named, or None when nobody got to it.

    Rank 0 waits for every other rank and names the ones that never came ("Ranks 1, 2 failed
    to pass monitoredBarrier"); the others only wait for rank 0 ("received errors while waiting
    for send/recv from rank 0"), whether rank 0 is missing or only reporting someone else. A
    rank with no check-in file at all never got there either (dead, stuck, or killed first)."""
    if not check_ins:
        return None
    named = {r for r in range(world) if r not in check_ins}  # no file: never got there
    said = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", (check_ins.get(0) or {}).get("error") or "")
    if said:
        named |= {int(r) for r in said[1].split(",") if r.strip()}
    return sorted(named)


def threads(text: str) -> list[list[tuple[str, str]]]:
    """faulthandler's text: every thread's frames as [(file:line, function)], innermost first."""
    found: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        if re.match(r"(Current thread|Thread) 0x", line):
            found.append([])
        frame = re.match(r'\s+File "(.*)", line (\d+) in (\S+)', line)
        if frame and found:
            found[-1].append((where(frame[1], int(frame[2])), frame[3]))
    return found


def main_thread(text: str) -> list[tuple[str, str]] | None:
    """The main thread's frames: the one not started by threading (no _bootstrap at its bottom)."""
    for frames in threads(text):
        if frames and not frames[-1][1].startswith("_bootstrap"):
            return frames
    return None


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Evidence:
    world: int
    dumps: dict = field(default_factory=dict)      # rank -> flight recorder dump
    check_ins: dict = field(default_factory=dict)  # rank -> its check-in
    stacks: dict = field(default_factory=dict)     # rank -> main thread's frames (None: no answer)
    pyspy: dict = field(default_factory=dict)      # rank -> py-spy's text ("" if none)
    aborts: dict = field(default_factory=dict)     # rank -> (gloo's message, main thread's frames)


def collect(folder: Path, world: int) -> Evidence:
    folder = Path(folder)
    evidence = Evidence(world, read_dumps(folder, world), read_check_ins(folder, world))
    for rank in range(world):
        evidence.stacks[rank] = main_thread(read_text(folder / f"stack_rank_{rank}.txt"))
        evidence.pyspy[rank] = read_text(folder / f"pyspy_rank_{rank}.txt")
        log = read_text(folder / f"log_rank_{rank}.txt")
        if SIZE_ABORT in log:  # gloo's check failed, abort(): faulthandler printed the stacks
            message = next(line for line in log.splitlines() if SIZE_ABORT in line)
            evidence.aborts[rank] = (message.strip(), main_thread(log.split("Fatal Python error", 1)[-1]))
    return evidence


# --- the verdict ----------------------------------------------------------------------------

def diagnose(ev: Evidence) -> dict | None:
    """Who, which call, where, and the evidence that says so; None when nothing went wrong.

    In the order an engineer would look: a rank that crashed on its own check; a rank that
    answers nothing (no dump, no stack); a rank alive but absent from the check-in (stuck
    outside any collective: only its stack knows where); then the recorders side by side."""
    for rank, (message, frames) in sorted(ev.aborts.items()):
        check = re.search(r"\] (.*?expected size)", message)
        return {"kind": "crashed", "rank": rank, "operation": call_made(frames or []),
                "where": ours(frames or []),
                "because": f"rank {rank}'s log: gloo aborted it ({check[1] if check else plain(message)[:100]}); "
                           f"its stack, printed by faulthandler as it died, is in that call"}
    waiting = {r: collectives(d)[last_seq(d)] for r, d in ev.dumps.items() if last_seq(d) is not None}
    gone = [r for r in range(ev.world) if r not in ev.dumps and not ev.stacks.get(r)]
    if gone and waiting:
        (name, place), _ = Counter((operation(e), entry_place(e)) for e in waiting.values()).most_common(1)[0]
        return {"kind": "gone", "rank": gone[0], "operation": name, "where": place,
                "because": f"rank {gone[0]} left no dump and answered no signal, and never checked in; "
                           f"the others wait in {name} at {place}"}
    missing = never_checked_in(ev.check_ins, ev.world) or []
    for rank in missing:
        frames = ev.stacks.get(rank)
        if frames:
            return {"kind": "stuck in Python", "rank": rank, "operation": call_made(frames),
                    "where": ours(frames),
                    "because": f"rank {rank} is alive (its stack answered) but never checked in: "
                               f"it is in {call_made(frames)}, called at {ours(frames)}, outside any collective"}
    found = first_divergence(ev.dumps)
    if found is None or found["majority"] is None:
        return None
    n, majority = found["seq"], found["majority"]
    for rank in found["odd"]:
        entry = found["calls"][rank]
        if entry is None:  # never got to collective n: its stack says where it is instead
            frames = ev.stacks.get(rank) or []
            return {"kind": "stuck in a send/recv", "rank": rank, "operation": call_made(frames),
                    "where": ours(frames),
                    "because": f"rank {rank} never called collective #{n} ({majority['operation']}); "
                               f"its stack: {call_made(frames)} at {ours(frames)} (gloo records no send/recv)"}
        mine = entry_place(entry)
        if mine == majority["then"]:  # it called what normally comes next: it left n's call out
            return {"kind": "skipped", "rank": rank, "operation": majority["operation"],
                    "where": majority["where"],
                    "because": f"at #{n} the others called {majority['operation']} at {majority['where']}; "
                               f"rank {rank} called {operation(entry)} at {mine}, the call that comes after it"}
        return {"kind": "out of order", "rank": rank, "operation": operation(entry), "where": mine,
                "because": f"at #{n} the others called {majority['operation']} at {majority['where']}; "
                           f"rank {rank} called {operation(entry)} at {mine}, a line of its own"}
    return None


def clear(folder: Path) -> None:
    """Delete an earlier run's evidence and results: never read as this run's."""
    for name in (*(f"{s}*" for s in STATES), "final.pt", "metrics.json"):
        for old in Path(folder).glob(name):
            old.unlink()
