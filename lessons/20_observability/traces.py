"""Read what lesson 20 records: a profiler's Chrome trace and the flight recorder's dumps.

Lesson 20 (docs/20_observability.md) teaches the two instruments; this module only *reads*
what they wrote, so the lesson can print numbers from its own run.

* `steps(path)`: one dict per profiled step of a Chrome trace (`export_chrome_trace`): when
  backward ran, when each all-reduce ran (on the backend's own threads), and how much of the
  step went to communication and to computation. All times in milliseconds from the start
  of the step.
* `read_dumps(folder, world_size)` and `diagnose(dumps)`: the flight recorder's JSON dumps of
  every rank, and the first collective that not every rank called: its sequence number, its
  name and sizes, the ranks that called it, and the ranks that never arrived.

Plain JSON throughout: a trace or a dump is data and never runs code (no pickle).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from apparatus.results import shown

# Events on the training thread that are computation: forward, every autograd node, the
# optimizer. The enqueue of a collective (c10d::allreduce_) is nested inside autograd
# nodes; it is subtracted from computation and counted as communication's cost instead.
COMPUTE = ("DistributedDataParallel.forward", "autograd::engine::evaluate_function", "Optimizer.step")
BACKWARD = "autograd::engine::evaluate_function"
ENQUEUE = "c10d::allreduce_"
RUNS = (":all_reduce",)  # gloo:all_reduce / nccl:all_reduce: the collective itself


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in _union(list(intervals)))


def _minus(keep: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (merged) intervals `keep` outside every interval of `cut`."""
    result = []
    for a, b in keep:
        pieces = [(a, b)]
        for c, d in cut:
            pieces = [p for x, y in pieces for p in ((x, min(y, c)), (max(x, d), y)) if p[1] > p[0]]
        result += pieces
    return result


def _clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def load(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace, each with start 'ts' and 'dur' in µs."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def steps(path: Path) -> list[dict]:
    """Per profiled step: backward, the all-reduces, communication and computation (ms)."""
    events = load(path)
    result = []
    for step in sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]):
        t0, t1, main = step["ts"], step["ts"] + step["dur"], step["tid"]
        inside = [e for e in events if t0 <= e["ts"] < t1]
        ms = lambda us: round((us - t0) / 1000, 3)  # noqa: E731 - µs in the trace -> ms in the step
        on_main = [e for e in inside if e["tid"] == main]
        backward = [e for e in on_main if e["name"].startswith(BACKWARD)]
        enqueued = sorted((e for e in on_main if e["name"] == ENQUEUE), key=lambda e: e["ts"])
        runs = sorted((e for e in inside if e["name"].endswith(RUNS) and e["tid"] != main),
                      key=lambda e: e["ts"])
        bw = (min(e["ts"] for e in backward), max(e["ts"] + e["dur"] for e in backward)) if backward else (t0, t0)
        reduces = []
        for i, run in enumerate(runs):
            # the i-th collective to run is the i-th one enqueued (a process group runs them in order)
            sizes = enqueued[i].get("args", {}).get("Input Dims") if i < len(enqueued) else None
            numel = _numel(sizes)
            reduces.append({"name": run["name"], "numel": numel,
                            "enqueued_ms": ms(enqueued[i]["ts"]) if i < len(enqueued) else None,
                            "start_ms": ms(run["ts"]), "end_ms": ms(run["ts"] + run["dur"]),
                            "during_backward": bool(backward) and run["ts"] < bw[1],
                            "overlap_ms": round(_length(_clip([(run["ts"], run["ts"] + run["dur"])], *bw)) / 1000, 3)})
        # computation: the training thread inside forward, backward or the optimizer, except
        # while it hands a collective to the backend (c10d::allreduce_, nested in backward)
        compute = _minus(_union([(e["ts"], e["ts"] + e["dur"]) for e in on_main
                                 if e["name"].startswith(COMPUTE)]),
                         _union([(e["ts"], e["ts"] + e["dur"]) for e in enqueued]))
        # communication: the collectives running on the backend's threads
        comm = _union(_clip([(r["ts"], r["ts"] + r["dur"]) for r in runs], t0, t1))
        hidden = sum(_length(_clip([c], a, b)) for c in comm for a, b in compute)
        comm_ms, compute_ms = _length(comm) / 1000, _length(compute) / 1000
        result.append({"step": step["name"], "step_ms": round(step["dur"] / 1000, 3),
                       "backward_ms": (ms(bw[0]), ms(bw[1])), "all_reduces": reduces,
                       "communication_ms": round(comm_ms, 3), "computation_ms": round(compute_ms, 3),
                       "hidden_ms": round(hidden / 1000, 3)})
    return result


def _numel(sizes) -> int | None:
    """Elements of the first input of a collective, from the trace's 'Input Dims' (record_shapes)."""
    if not sizes or not isinstance(sizes, list):
        return None
    first = sizes[0]
    while isinstance(first, list) and first and isinstance(first[0], list):
        first = first[0]  # a list of tensors: the bucket is the first (and only) one
    n = 1
    for d in first or []:
        n *= d
    return n


def step_rows(step: dict) -> list[list[str]]:
    """Table rows for one step: one per all-reduce, in the order they ran."""
    rows = []
    for i, r in enumerate(step["all_reduces"]):
        in_backward = r["enqueued_ms"] is not None and r["enqueued_ms"] <= step["backward_ms"][1]
        what = f"bucket {i}" if in_backward else "after backward"  # e.g. the logged losses
        size = f"{r['numel']:,}" if r["numel"] is not None else "?"
        when = (f"yes, {r['overlap_ms']:.2f} ms of it" if r["during_backward"] else "no: after backward")
        rows.append([what, size, f"{r['start_ms']:.2f}", f"{r['end_ms']:.2f}", when])
    return rows


STEP_COLUMNS = ["all-reduce", "floats", "start (ms)", "end (ms)", "during backward?"]


# --- the flight recorder -------------------------------------------------------------------

def dump_path(prefix: str, rank: int) -> Path:
    return Path(f"{prefix}{rank}.json")


def wait_for_dumps(prefix: str, world_size: int, timeout: float) -> bool:
    """After writing our own dump, give the other ranks up to `timeout` s to write theirs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(dump_path(prefix, r).exists() for r in range(world_size)):
            return True
        time.sleep(0.1)
    return False


def read_dumps(prefix: str, world_size: int) -> dict[int, dict]:
    """{rank: the dump as JSON} for every rank that wrote one."""
    dumps = {}
    for rank in range(world_size):
        path = dump_path(prefix, rank)
        if path.exists():
            dumps[rank] = json.loads(path.read_text())
    return dumps


def collectives(dump: dict) -> dict[int, dict]:
    """{collective sequence number: entry} of the default process group, p2p left out."""
    found = {}
    for e in dump.get("entries", []):
        if not e.get("is_p2p") and int(e.get("pg_id", 0)) == 0:
            found[int(e["collective_seq_id"])] = e
    return found


def describe(entry: dict | None) -> str:
    if entry is None:
        return "nothing"
    sizes = entry.get("input_sizes") or []
    shape = "x".join(map(str, sizes[0])) if sizes and sizes[0] else "-"
    return f"{entry['profiling_name']} #{entry['collective_seq_id']} (input {shape})"


def diagnose(dumps: dict[int, dict], world_size: int) -> dict:
    """The first collective not every rank called, and who never arrived there.

    Ranks call collectives in the same order, so their sequence numbers line up; the first
    number where one rank has no entry, or another operation, is where the job went wrong.
    Returns {"ok": True, "count": n} when every rank recorded the same collectives.
    """
    seqs = {rank: collectives(d) for rank, d in dumps.items()}
    missing_dumps = [r for r in range(world_size) if r not in dumps]
    everything = sorted(set().union(*[set(s) for s in seqs.values()])) if seqs else []
    for n in everything:
        entries = {rank: s.get(n) for rank, s in seqs.items()}
        kinds = {(e["profiling_name"], str(e.get("input_sizes"))) for e in entries.values() if e}
        if all(entries.values()) and len(kinds) == 1:
            continue
        # the operation most ranks called at n (ties: the lowest rank's) is "the collective"
        votes: dict = {}
        for rank, e in sorted(entries.items()):
            if e:
                votes.setdefault((e["profiling_name"], str(e.get("input_sizes"))), []).append(rank)
        (name, sizes), arrived = max(votes.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        never = sorted(r for r in range(world_size) if r not in arrived)
        last = {r: describe(max(seqs[r].values(), key=lambda e: e["collective_seq_id"]) if seqs.get(r) else None)
                for r in never if r in seqs}
        return {"ok": False, "seq": n, "name": name, "entry": describe(entries[arrived[0]]),
                "arrived": arrived, "never_arrived": never, "last_of_missing": last,
                "instead": {r: describe(entries.get(r)) for r in never if entries.get(r)},
                "no_dump": missing_dumps}
    return {"ok": True, "count": len(everything), "no_dump": missing_dumps}


# --- what lesson 20 prints in Steps 9 and 10 ------------------------------------------------

def report_traces(ui, folder: Path, world_size: int) -> list[dict]:
    """Rank 0's profiled steps as tables, and one line per step of every rank."""
    every = []
    for rank in range(world_size):
        path = Path(folder) / f"trace_rank{rank}.json"
        if not path.exists():
            ui.print(f"rank {rank}: no trace (the run stopped before the profiled steps)")
            continue
        for s in steps(path):
            if not s["all_reduces"]:
                ui.print(f"rank {rank}, {s['step']}: no all-reduce on a backend thread (with NCCL "
                         f"they run as GPU kernels: read the GPU rows of the trace in Perfetto)")
            elif rank == 0:  # every rank's table looks alike: print rank 0's, sum up the others
                ui.table(f"rank 0, {s['step']}: backward ran from {s['backward_ms'][0]:.2f} to "
                         f"{s['backward_ms'][1]:.2f} ms", STEP_COLUMNS, step_rows(s))
            ui.print(f"rank {rank}, {s['step']} ({s['step_ms']:.2f} ms): communication "
                     f"{s['communication_ms']:.2f} ms, of which {s['hidden_ms']:.2f} ms hidden "
                     f"behind computation; computation {s['computation_ms']:.2f} ms")
            every.append({"rank": rank, **s})
        ui.print(f"trace of rank {rank}: {shown(path)}")
    return every


def report_recorder(ui, prefix: str, world_size: int) -> dict:
    """The diagnosis of every rank's dump, in a few lines."""
    dumps = read_dumps(prefix, world_size)
    if not dumps:  # e.g. NCCL's watchdog ended the ranks first: it writes pickles, not JSON
        ui.print(f"no JSON dumps at {shown(Path(prefix))}<rank>.json; a dump NCCL's watchdog "
                 f"wrote (a pickle, {shown(Path(prefix))}<rank>) is read by torchfrtrace")
        return {"ok": False, "no_dump": list(range(world_size))}
    found = diagnose(dumps, world_size)
    if found["ok"]:
        ui.print(f"every rank recorded the same {found['count']} collectives, in the same "
                 f"order: nobody is missing")
    else:
        never = ", ".join(map(str, found["never_arrived"]))
        ui.print(f"collective #{found['seq']}, {found['entry']}: called by rank(s) "
                 f"{', '.join(map(str, found['arrived']))}; [bold]rank {never} never arrived[/bold]")
        for r, last in found["last_of_missing"].items():
            instead = found["instead"].get(r)
            ui.print(f"rank {r}'s last collective was {last}"
                     + (f"; at #{found['seq']} it called {instead} instead" if instead else ""))
    if found["no_dump"]:
        ui.print(f"no dump from rank(s) {', '.join(map(str, found['no_dump']))}")
    return found


def clear(folder: Path) -> None:
    """Delete an earlier run's traces and dumps from the run folder."""
    for old in [*Path(folder).glob("fr_rank_*"), *Path(folder).glob("*trace_rank*.json")]:
        old.unlink()
