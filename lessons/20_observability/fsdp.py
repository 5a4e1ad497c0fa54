"""Lesson 20's --fsdp: the same profiler on FSDP2, where communication is per block.

DDP (the lesson's own run) sends gradients once per bucket during backward. FSDP2 (lesson 15)
keeps 1/N of every weight on each rank: before a block's forward it *all-gathers* the block's
weights, before its backward it gathers them again (they were freed after forward), and after
its backward it *reduce-scatters* the gradients, each rank keeping the sum of its 1/N. Here:

* trace(rank, world, device, folder, seed): lesson 13's transformer (common/transformer.py),
  each block and then the root wrapped with fully_shard as lesson 15 does, 2 steps on this
  rank's rows of lesson 13's batches under torch.profiler (warm up 1: FSDP2's lazy set-up, record 1); the
  Chrome trace goes to fsdp_trace_rank<r>.json, for https://ui.perfetto.dev or chrome://tracing.
* units(path): per FSDP unit (the root: embeddings, final norm and head; blocks.0; blocks.1),
  when its collectives ran and when it computed, in ms from the start of the recorded step,
  read from FSDP2's own labels in the trace (`FSDP::all_gather (blocks.0)`, `FSDP::pre_forward`,
  `FSDP::post_backward_reduce`, ...) and the collectives they enqueued (`c10d::_allgather_base_`,
  `c10d::_reduce_scatter_base_`), matched in order with what ran on the backend's threads.
* report(ui, folder, world): rank 0's table, one summary line per rank, the trace files.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from apparatus.results import shown

ENQUEUE = {"all_gather": "c10d::_allgather_base_", "reduce_scatter": "c10d::_reduce_scatter_base_"}
COLUMNS = ["unit", "gather (fwd)", "forward", "gather (bwd)", "backward", "reduce-scatter"]


def trace(rank: int, world: int, device, folder: Path, seed: int) -> Path:
    """Two FSDP2 steps of lesson 13's transformer under the profiler; returns the trace's path."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile, schedule

    from common import transformer as T

    model = T.make_model(seed).to(device)
    mesh = dist.init_device_mesh(device.type, (world,))  # all ranks, the default group's
    for block in model.blocks:  # one FSDP unit per block: gathered just before it runs
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings, final norm and head
    optimizer = T.make_optimizer(model)
    path = Path(folder) / f"fsdp_trace_rank{rank}.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as profiler:
        for step in range(2):
            x, y = (T.shard(t, rank, world).to(device) for t in T.batch(step, seed))
            with warnings.catch_warnings():  # FSDP2 warns that the logits are a view; nobody
                warnings.filterwarnings("ignore", message=".*returned a view tensor")  # edits them in place
                loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gathers each block again, then reduce-scatters its gradients
            optimizer.step()
            profiler.step()
    return path


def _interval(e: dict) -> tuple[float, float]:
    return e["ts"], e["ts"] + e["dur"]


def _ran_on_backend(e: dict, kind: str, main) -> bool:
    """A collective running outside the training thread: gloo's threads, or NCCL's GPU kernels.
    (gloo runs FSDP2's reduce-scatter as an all-reduce: the trace names it gloo:all_reduce.)"""
    name = e["name"].lower().replace("_", "")
    words = ("allgather",) if kind == "all_gather" else ("reducescatter", "allreduce")
    return e["tid"] != main and not name.startswith("c10d::") and any(w in name for w in words)


def units(path: Path) -> dict:
    """{"step_ms", "units": {unit: {column: (start_ms, end_ms) or None}}} for the recorded step."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    step = next(e for e in events if e["name"].startswith("ProfilerStep#")  # the CPU's span, not
                and e.get("cat") != "gpu_user_annotation")                  # its copy on a GPU stream
    t0, t1, main = step["ts"], step["ts"] + step["dur"], step["tid"]
    inside = sorted((e for e in events if t0 <= e["ts"] < t1), key=lambda e: e["ts"])
    on_main = [e for e in inside if e["tid"] == main]
    ms = lambda a, b: (round((a - t0) / 1000, 3), round((b - t0) / 1000, 3))  # noqa: E731
    ran = {}  # the i-th collective enqueued is the i-th to run: the process group keeps the order
    for kind, label in ENQUEUE.items():
        enqueued = [e for e in on_main if e["name"] == label]
        runs = [e for e in inside if _ran_on_backend(e, kind, main)]
        ran.update({id(q): r for q, r in zip(enqueued, runs)})

    def labelled(what: str, unit: str) -> list[dict]:  # FSDP2's labels: "FSDP::pre_forward (blocks.0)"
        return [e for e in on_main if e["name"] == (f"{what} ({unit})" if unit else what)]

    def collective(wrapper: dict | None, kind: str):
        inner = [e for e in on_main if e["name"] == ENQUEUE[kind] and wrapper
                 and wrapper["ts"] <= e["ts"] <= wrapper["ts"] + wrapper["dur"]]
        run = ran.get(id(inner[0])) if inner else None
        return ms(*_interval(run)) if run else None

    names = sorted({m[1] for e in on_main if (m := re.fullmatch(r"FSDP::pre_forward \((.+)\)", e["name"]))})
    result = {}
    for unit in ["", *names]:  # "" is the root: its hooks wrap the whole model, blocks included
        gathers = labelled("FSDP::all_gather", unit)
        row = {"gather (fwd)": collective(gathers[0] if gathers else None, "all_gather"),
               "gather (bwd)": collective(gathers[1] if len(gathers) > 1 else None, "all_gather"),
               "reduce-scatter": collective(next(iter(labelled("FSDP::post_backward_reduce", unit)), None),
                                            "reduce_scatter"),
               "forward": None, "backward": None}
        copied, after = labelled("FSDP::all_gather_copy_out", unit), labelled("FSDP::post_forward", unit)
        pre_bw, post_bw = labelled("FSDP::pre_backward", unit), labelled("FSDP::post_backward_accumulate", unit)
        if unit and copied and after:  # the block's own forward: weights in place -> its post-forward hook
            row["forward"] = ms(_interval(copied[0])[1], after[0]["ts"])
        if unit and pre_bw and post_bw:  # and its backward: pre-backward hook -> gradients ready
            row["backward"] = ms(_interval(pre_bw[0])[1], post_bw[0]["ts"])
        result[unit or "root"] = row
    return {"step": step["name"], "step_ms": round(step["dur"] / 1000, 3), "units": result}


def overlap_ms(found: dict) -> tuple[float, float]:
    """(ms of collectives, ms of them that ran while some block computed) in the step."""
    comm = [v for row in found["units"].values() for k, v in row.items() if v and k not in ("forward", "backward")]
    compute = [v for row in found["units"].values() for k, v in row.items() if v and k in ("forward", "backward")]
    total = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return round(total, 3), round(hidden, 3)


def report(ui, folder: Path, world: int) -> None:
    """Rank 0's units as a table, a line per rank, and where the traces are. Nothing without --fsdp."""
    paths = [Path(folder) / f"fsdp_trace_rank{r}.json" for r in range(world)]
    if not any(p.exists() for p in paths):
        return
    ui.print("\n[bold]FSDP2 (--fsdp)[/bold]: lesson 13's transformer, each block one fully_shard unit")
    for rank, path in enumerate(paths):
        if not path.exists():
            ui.print(f"rank {rank}: no FSDP2 trace")
            continue
        found = units(path)
        if rank == 0:
            cell = lambda v: f"{v[0]:.1f}-{v[1]:.1f}" if v else "-"  # noqa: E731
            ui.table(f"rank 0, FSDP2, {found['step']} ({found['step_ms']:.1f} ms): when each unit's "
                     f"collectives ran and when it computed, ms from the step's start",
                     COLUMNS, [[u, *(cell(row[c]) for c in COLUMNS[1:])] for u, row in found["units"].items()])
        total, hidden = overlap_ms(found)
        ui.print(f"rank {rank}, FSDP2, {found['step']}: all-gathers and reduce-scatters {total:.2f} ms, "
                 f"{hidden:.2f} ms of it while a block computed; trace: {shown(path)}")
