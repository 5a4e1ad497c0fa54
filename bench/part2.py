"""Part 2's benchmarks on the transformer recipe (common/transformer.py): what the ranks run.

    fsdp      DDP, FSDP2 ZeRO-3 and FSDP2 ZeRO-2-like (reshard_after_forward=False) on 1 and 2
              ranks: sequences/s, bytes each rank sends per step (apparatus/comm.py's CommLog),
              bytes of parameters, gradients and optimizer state it holds (apparatus/sharding.py)
    tp        tensor parallel on 2 ranks, lesson 17's two implementations (by hand, DTensor),
              with and without sequence parallel: the collectives of one block, counted by
              apparatus/tensor_parallel.py and then replayed alone to time them, beside the
              time of a whole step and of one unsplit process
    pipeline  lesson 18's four schedules on 2 ranks: time per step beside the idle share the
              schedule's own timeline predicts (apparatus/pipeline.py)

The ranks start the suite's one way (bench/run.py spawn_ranks); this world is the whole job, so
the lessons' code, which uses the default group, runs as the lessons run it. The model, the
layers that split it and the schedules are the lessons' own, imported and not copied.
"""
from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus import sharding
from apparatus import tensor_parallel as TPA
from apparatus.comm import CommLog, route_ddp_through_python
from apparatus.pipeline import Recorder, bubble_formula, idle_fraction, timeline
from bench.measure import Ctx, summary
from common import transformer as T
from common.cli import ROOT
from common.distributed import env_store
from common.results import atomic_write

BENCHMARKS = ["fsdp", "tp", "pipeline"]
STRATEGIES = ["ddp", "fsdp-zero3", "fsdp-zero2"]


def make_plan(quick: bool) -> dict:
    return {
        "fsdp": {"worlds": [1, 2], "strategies": STRATEGIES, "steps": 1 if quick else 6,
                 "count_steps": 1 if quick else 2},
        "tp": {"variants": ([["manual", True]] if quick else
                            [["manual", False], ["dtensor", False], ["manual", True],
                             ["dtensor", True]]),
               "steps": 1 if quick else 6, "replay_inner": 1 if quick else 20},
        "pipeline": {"schedules": (["gpipe", "zero-bubble"] if quick else
                                   ["gpipe", "1f1b", "interleaved", "zero-bubble"]),
                     "microbatches": 4, "steps": 1 if quick else 4},
        "model": {"blocks": T.N_BLOCKS, "dim": T.DIM, "heads": T.N_HEADS, "seq": T.SEQ,
                  "global_batch": T.GLOBAL_BATCH,
                  "params": sum(p.numel() for p in T.make_model(T.SEED).parameters())},
    }


def load_lesson(number: str, needed: tuple[str, ...]):
    """A lesson file as a module (its name starts with a digit, so `import` cannot name it)."""
    path = next((ROOT / "lessons").glob(f"{number}_*.py"), None)
    if path is None:
        raise RuntimeError(f"lessons/{number}_*.py not found: bench/part2.py imports it")
    spec = importlib.util.spec_from_file_location(f"lesson{number}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [n for n in needed if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"{path.name} no longer defines {', '.join(missing)}, which "
                           f"bench/part2.py imports; update it")
    return module


def batches(rank: int, n: int, count: int = 3, shard: bool = True) -> list:
    out = []
    for step in range(count):
        x, y = T.batch(step, T.SEED)
        out.append((T.shard(x, rank, n), T.shard(y, rank, n)) if shard else (x, y))
    return out


def plain_step_ms(ctx: Ctx, n: int, steps: int) -> dict:
    """One process, the whole model, the whole batch: every rank at once, each on its core."""
    model = T.make_model(T.SEED)
    opt = T.make_optimizer(model)
    data = batches(0, 1)

    def window():
        for s in range(steps):
            x, y = data[s % len(data)]
            loss = T.loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return summary([t / steps * 1e3 for t in ctx.timed(window, n)])


# ---------------------------------------------------------------------------------------
# FSDP2 vs DDP
# ---------------------------------------------------------------------------------------

def fsdp(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    from torch.distributed.fsdp import fully_shard

    rows = []
    data = batches(ctx.rank, n)
    for strategy in cfg["strategies"]:
        model = T.make_model(T.SEED)
        if strategy == "ddp":
            net = DDP(model, gradient_as_bucket_view=True)
            route_ddp_through_python(net)  # PyTorch's allreduce_hook: CommLog sees the buckets
        else:  # lesson 15: each block one FSDP group, then the root
            mesh = dist.init_device_mesh("cpu", (n,))
            for module in (*model.blocks, model):
                fully_shard(module, mesh=mesh, reshard_after_forward=strategy == "fsdp-zero3")
            net = model
        opt = T.make_optimizer(model)

        def train(steps):
            for s in range(steps):
                x, y = data[s % len(data)]
                loss = T.loss_fn(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        log = CommLog()
        with log.recording():  # untimed: counting costs a little; it is also the warm-up
            train(cfg["count_steps"])
        comm = log.summary(cfg["count_steps"])
        times = ctx.timed(lambda: train(cfg["steps"]), n)
        held = sharding.held_bytes(model, opt)
        most = torch.tensor([held[k] for k in sharding.KEYS], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the rank that holds the most
        rows.append({
            "strategy": strategy, "world_size": n, "steps_per_rep": cfg["steps"],
            "sequences_per_s": summary([cfg["steps"] * T.GLOBAL_BATCH / t for t in times]),
            "step_ms": summary([t / cfg["steps"] * 1e3 for t in times]),
            "calls_per_step": comm["calls_per_step"],
            "sent_bytes_per_step": comm["sent_bytes_per_step"],
            "held_bytes": {k: int(v) for k, v in zip(sharding.KEYS, most.tolist())},
        })
        del net, opt, model, log
        gc.collect()
    return rows


# ---------------------------------------------------------------------------------------
# Tensor parallel
# ---------------------------------------------------------------------------------------

def _replay(calls: list[tuple[str, int]], n: int):
    """A window that runs the same collectives (kind, bytes of data S) with dist calls."""
    plan = []
    for kind, size in calls:
        elems = size // 4
        if kind == "all_reduce":
            t = torch.zeros(elems)
            plan.append(lambda t=t: dist.all_reduce(t))
        elif kind == "all_gather":
            out, inp = torch.zeros(elems), torch.zeros(elems // n)
            plan.append(lambda o=out, i=inp: dist.all_gather_single(o, i))
        else:
            inp, out = torch.zeros(elems), torch.zeros(elems // n)
            plan.append(lambda o=out, i=inp: dist.reduce_scatter_single(o, i))
    return plan


def tp(ctx: Ctx, n: int, cfg: dict, lesson) -> dict:
    from torch.distributed._tools.mod_tracker import ModTracker

    rows = []
    data = batches(0, 1)  # tensor parallel splits the model, not the data: the whole batch
    last = T.N_BLOCKS - 1
    for impl, sp in cfg["variants"]:
        split = lesson.parallelize_by_hand if impl == "manual" else lesson.parallelize_dtensor
        model = split(T.make_model(T.SEED), ctx.rank, n, sp)
        opt = T.make_optimizer(model)
        shared = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]

        def step(s):
            x, y = data[s % len(data)]
            loss = T.loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in shared:  # by hand, sequence parallel: lesson 17's Step 4
                dist.all_reduce(p.grad)
            opt.step()

        with ModTracker() as tracker, TPA.CountCollectives(tracker, n) as counter:
            x, y = data[0]
            T.loss_fn(model(x), y).backward()
        opt.zero_grad(set_to_none=True)
        calls = counter.calls + [("after backward", None, "all_reduce", p.numel() * 4) for p in shared]
        block = [(k, s) for phase, b, k, s in calls if b == last and phase in ("forward", "backward")]
        kinds: dict = {}
        for k, _ in block:
            kinds[k] = kinds.get(k, 0) + 1
        times = ctx.timed(lambda: [step(s) for s in range(cfg["steps"])], n)
        inner = cfg["replay_inner"]
        block_plan, step_plan = _replay(block, n), _replay([(k, s) for _, _, k, s in calls], n)
        block_ms = ctx.timed(lambda: [f() for _ in range(inner) for f in block_plan], n)
        all_ms = ctx.timed(lambda: [f() for _ in range(inner) for f in step_plan], n)
        rows.append({
            "impl": impl, "sequence_parallel": sp, "world_size": n,
            "block_calls": dict(sorted(kinds.items())),
            "block_data_bytes": sum(s for _, s in block),
            "block_sent_bytes": sum(TPA.SHARE[k](n) * s for k, s in block),
            "step_calls": len(calls),
            "step_sent_bytes": sum(TPA.SHARE[k](n) * s for _, _, k, s in calls),
            "step_ms": summary([t / cfg["steps"] * 1e3 for t in times]),
            "block_comm_ms": summary([t / inner * 1e3 for t in block_ms]),
            "step_comm_ms": summary([t / inner * 1e3 for t in all_ms]),
        })
        del model, opt, shared
        gc.collect()
    return {"rows": rows, "plain_step_ms": plain_step_ms(ctx, n, cfg["steps"])}


# ---------------------------------------------------------------------------------------
# Pipeline schedules
# ---------------------------------------------------------------------------------------

def pipeline(ctx: Ctx, n: int, cfg: dict, lesson) -> dict:
    rows = []
    data = batches(0, 1)
    m = cfg["microbatches"]
    for name in cfg["schedules"]:
        model = T.make_model(T.SEED)
        sched, stages, parts = lesson.build_pipeline(name, model, ctx.rank, n, m, torch.device("cpu"))
        opt = T.make_optimizer(torch.nn.ModuleList(parts))
        x, y = data[0]
        with Recorder(stages) as rec:  # the first step: the actions, and the warm-up
            sched.step(x, target=y)
        every: list = [None] * n
        dist.all_gather_object(every, rec.actions)
        predicted = idle_fraction(timeline(dict(enumerate(every))))

        def window():
            for s in range(cfg["steps"]):
                xs, ys = data[s % len(data)]
                opt.zero_grad(set_to_none=True)
                sched.step(xs, target=ys)
                opt.step()

        times = ctx.timed(window, n)
        rows.append({"schedule": name, "world_size": n, "microbatches": m,
                     "stages": len(stages) * n, "predicted_idle": round(predicted, 4),
                     "formula_idle": (round(bubble_formula(n, m), 4)
                                      if name in ("gpipe", "1f1b") else None),
                     "step_ms": summary([t / cfg["steps"] * 1e3 for t in times])})
        del sched, stages, parts, opt, model
        gc.collect()
    plain = plain_step_ms(ctx, n, cfg["steps"])
    for r in rows:  # idle share if the ranks had split one process's work perfectly
        r["measured_idle"] = round(1 - plain["median"] / (n * r["step_ms"]["median"]), 4)
    return {"rows": rows, "plain_step_ms": plain}


# ---------------------------------------------------------------------------------------
# The processes
# ---------------------------------------------------------------------------------------

def worker(rank: int, world: int, plan: dict, result_path: str) -> None:
    """One CPU rank of a world of 1 or 2: the Part 2 benchmarks that need this world size."""
    torch.set_num_threads(plan["threads_per_rank"])
    # FSDP2 warns that the root returns a view; the loss reads it out of place, as lesson 15
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    ctx = Ctx(rank, world, plan, torch.device("cpu"))
    timeout = datetime.timedelta(seconds=plan["timeout"])
    dist.init_process_group("gloo", store=env_store(rank, world, plan["timeout"]), rank=rank,
                            world_size=world, timeout=timeout)
    ctx.ctl[world] = ctx.work[world] = dist.group.WORLD
    p2, wanted = plan["part2"], plan["benchmarks"]
    results: dict = {}
    if "fsdp" in wanted:
        results["fsdp"] = fsdp(ctx, world, p2["fsdp"])
    if world == 2 and "tp" in wanted:
        results["tp"] = tp(ctx, world, p2["tp"], load_lesson("17", ("parallelize_by_hand",
                                                                    "parallelize_dtensor")))
    if world == 2 and "pipeline" in wanted:
        results["pipeline"] = pipeline(ctx, world, p2["pipeline"],
                                       load_lesson("18", ("build_pipeline",)))
    if rank == 0:
        text = json.dumps(results, indent=1) + "\n"
        atomic_write(result_path, lambda f: f.write(text.encode()))
    gc.collect()
    dist.destroy_process_group()


def run(plan: dict, spawn_ranks, ui) -> dict:
    """Both worlds, one start each; the sections of results.json."""
    out: dict = {}
    for world in (1, 2):
        if world == 1 and "fsdp" not in plan["benchmarks"]:
            continue
        started = time.perf_counter()
        got = spawn_ranks(worker, world, plan)
        for key, value in got.items():
            if key == "fsdp":
                out.setdefault("fsdp", {"config": plan["part2"]["fsdp"],
                                        "model": plan["part2"]["model"], "rows": []})
                out["fsdp"]["rows"] += value
            else:
                out[key] = {"config": plan["part2"][key], "model": plan["part2"]["model"], **value}
        ui.print(f"  part 2 on {world} rank{'s' if world > 1 else ''}: "
                 f"{', '.join(got)} ({time.perf_counter() - started:.0f} s)")
    return out
