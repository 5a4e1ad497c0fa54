"""Part 2's benchmarks on the transformer recipe (common/transformer.py): what the ranks run.

    fsdp      DDP, FSDP2 ZeRO-3 and FSDP2 ZeRO-2-like (reshard_after_forward=False on the
              blocks; the root at FSDP2's default, as in lesson 15) on 1 and 2 ranks:
              sequences/s, bytes each rank sends per step (apparatus/comm.py's CommLog), bytes
              of parameters, gradients and optimizer state it holds (apparatus/sharding.py)
    tp        tensor parallel on 2 ranks, lesson 17's two implementations (by hand, DTensor's
              plan as the lesson builds it), with and without sequence parallel: the
              collectives of one training step and of one block, counted by
              apparatus/comm.py's CommLog (DTensor's own and the optimizer step's included) and
              split by phase and block by lesson 17's own report(), then replayed alone to time
              them, beside the time of a whole step and of one unsplit process

The methods a section compares are timed in turn (bench/measure.py's Ctx.timed_in_turn): one
repetition of each per round, the order reversed every other round.
    pipeline  lesson 18's four schedules on 2 ranks: time per step beside the idle share the
              schedule's own timeline predicts (lessons/18_pipeline_schedules/pipeline.py)

The ranks start the suite's one way (bench/run.py spawn_ranks, which is common/distributed.py's
run_ranks); this world is the whole job, so
the lessons' code, which uses the default group, runs as the lessons run it. The model, the
layers that split it and the schedules are the lessons' own, imported and not copied.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus import sharding
from apparatus.comm import CommLog, route_ddp_through_python
from bench.measure import Ctx, summary
from common import transformer as T
from common import lesson_module
from common.cli import ROOT

sys.path[1:1] = [str(ROOT / "lessons" / d) for d in ("17_tensor_parallel", "18_pipeline_schedules")]
from pipeline import Recorder, bubble_formula, idle_fraction, timeline  # noqa: E402  (lesson 18's)

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
    try:
        module = lesson_module(number)
    except ImportError as exc:
        raise RuntimeError(f"{exc}: bench/sharded_transformer.py imports it") from None
    missing = [n for n in needed if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"{Path(module.__file__).name} no longer defines {', '.join(missing)}, "
                           f"which bench/sharded_transformer.py imports; update it")
    return module


def batches(rank: int, n: int, count: int = 3, shard: bool = True) -> list:
    out = []
    for step in range(count):
        x, y = T.batch(step, T.SEED)
        out.append((T.shard(x, rank, n), T.shard(y, rank, n)) if shard else (x, y))
    return out


def plain_window(steps: int):
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

    window()  # warm-up
    return window


def ms_per_step(times: list[float], steps: int) -> dict:
    return summary([t / steps * 1e3 for t in times])


# ---------------------------------------------------------------------------------------
# FSDP2 vs DDP
# ---------------------------------------------------------------------------------------

def fsdp(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    """DDP, ZeRO-3 and ZeRO-2-like, each on its own model, timed in turn (Ctx.timed_in_turn)."""
    from torch.distributed.fsdp import fully_shard

    data = batches(ctx.rank, n)
    built, windows, comm = {}, {}, {}
    for strategy in cfg["strategies"]:
        model = T.make_model(T.SEED)
        if strategy == "ddp":
            net = DDP(model, gradient_as_bucket_view=True)
            route_ddp_through_python(net)  # PyTorch's allreduce_hook: CommLog sees the buckets
        else:  # lesson 15: each block one FSDP group, resharded after forward (ZeRO-3) or not
            mesh = dist.init_device_mesh("cpu", (n,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=strategy == "fsdp-zero3")
            # the root (embeddings, last norm, head) at FSDP2's default, as lesson 15 and
            # torch advise: not resharded after forward, since backward needs it first
            fully_shard(model, mesh=mesh)
            net = model
        opt = T.make_optimizer(model)

        def train(steps, net=net, opt=opt):
            for s in range(steps):
                x, y = data[s % len(data)]
                loss = T.loss_fn(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        train(2)  # warm-up: DDP rebuilds its buckets (and broadcasts them) in its second step
        log = CommLog()
        with log.recording():  # untimed: counting costs a little
            train(cfg["count_steps"])
        comm[strategy] = log.summary(cfg["count_steps"])
        built[strategy] = (model, opt)
        windows[strategy] = lambda train=train: train(cfg["steps"])
    times, places = ctx.timed_in_turn(windows, n)
    rows = []
    for strategy, (model, opt) in built.items():
        held = sharding.held_bytes(model, opt)
        most = torch.tensor([held[k] for k in sharding.KEYS], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the rank that holds the most
        rows.append({
            "strategy": strategy, "world_size": n, "steps_per_rep": cfg["steps"],
            "sequences_per_s": summary([cfg["steps"] * T.GLOBAL_BATCH / t for t in times[strategy]]),
            "step_ms": ms_per_step(times[strategy], cfg["steps"]),
            "timed_in_turn": places[strategy],
            "calls_per_step": comm[strategy]["calls_per_step"],
            "sent_bytes_per_step": comm[strategy]["sent_bytes_per_step"],
            "held_bytes": {k: int(v) for k, v in zip(sharding.KEYS, most.tolist())},
        })
    del built, windows, model, opt, net
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


class _Quiet:
    """A UI that prints nothing: lesson 17's report() counts for us without printing its table."""

    def print(self, *args, **kwargs):
        pass

    def table(self, *args, **kwargs):
        pass


AFTER = ("between", "optimizer")  # CommLog's phases after backward: the sum by hand, AdamW's step


def _block_replay(block_calls: list, counts: dict) -> list[tuple[str, int]]:
    """The last block's collectives of one step as (kind, bytes of data): those its modules
    issued in forward and backward, then its share of the sums after backward and in AdamW's
    step, as lesson 17's report() counts it (calls of equal size, one per summed parameter)."""
    calls = [(c.kind, c.data_bytes) for c in block_calls]
    for phase in AFTER:
        kinds = counts["per_block"].get(phase, {})
        total = sum(kinds.values())
        for kind, k in kinds.items():
            calls += [(kind, round(counts["data_bytes_per_block"][phase] / total))] * round(k)
    return calls


def tp(ctx: Ctx, n: int, cfg: dict, lesson) -> dict:
    """Every variant built, warmed up and counted (lesson 17's own report()), then the steps of
    all variants and of one unsplit process timed in turn, and so are the replays."""
    import tensor_parallel  # lesson 17's companion (lessons/17_tensor_parallel/)

    data = batches(0, 1)  # tensor parallel splits the model, not the data: the whole batch
    last = f".blocks.{T.N_BLOCKS - 1}"
    found, steps, blocks, wholes = {}, {}, {}, {}
    for impl, sp in cfg["variants"]:
        split = lesson.parallelize_by_hand if impl == "manual" else lesson.parallelize_dtensor
        model = split(T.make_model(T.SEED), ctx.rank, n, sp)  # DTensor: lesson 17's plan as is
        opt = T.make_optimizer(model)
        shared = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]

        def step(s, model=model, opt=opt, shared=shared):  # lesson 17's Step 4, one batch
            x, y = data[s % len(data)]
            loss = T.loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in shared:  # by hand, sequence parallel: the sum of lesson 17's Step 4
                dist.all_reduce(p.grad)
            opt.step()

        step(0)  # warm-up
        log = CommLog(modules=True)  # one whole step: forward, backward, the sum, AdamW's step
        with log.recording():
            step(1)
        counts = tensor_parallel.report(log, 1, model, _Quiet())  # lesson 17's Step 6, by phase and per block
        block = [c for c in log.calls if any(m.endswith(last) for m in c.modules)]
        name = _name({"impl": impl, "sequence_parallel": sp})
        found[name] = (impl, sp, counts, log.calls)
        steps[name] = lambda step=step: [step(s) for s in range(cfg["steps"])]
        inner = cfg["replay_inner"]
        block_plan = _replay(_block_replay(block, counts), n)
        step_plan = _replay([(c.kind, c.data_bytes) for c in log.calls], n)
        blocks[name] = lambda plan=block_plan: [f() for _ in range(inner) for f in plan]
        wholes[name] = lambda plan=step_plan: [f() for _ in range(inner) for f in plan]
    plain = plain_window(cfg["steps"])
    step_s, places = ctx.timed_in_turn({**steps, "plain": plain}, n)
    block_s, _ = ctx.timed_in_turn(blocks, n)
    whole_s, _ = ctx.timed_in_turn(wholes, n)
    rows = []
    for name, (impl, sp, counts, calls) in found.items():
        per_block = {p: counts["per_block"].get(p, {}) for p in ("forward", "backward")}
        per_block["after"] = {k: v for p in AFTER for k, v in counts["per_block"].get(p, {}).items()}
        sent = {p: counts["sent_bytes_per_block"].get(p, 0.0) for p in ("forward", "backward")}
        sent["after"] = sum(counts["sent_bytes_per_block"].get(p, 0.0) for p in AFTER)
        rows.append({
            "impl": impl, "sequence_parallel": sp, "world_size": n,
            # lesson 17's per_block: its modules' calls, and its share of the sums after them
            "block_calls": {p: {k: round(v, 3) for k, v in sorted(c.items())}
                            for p, c in per_block.items()},
            "block_after_in": [p for p in AFTER if counts["per_block"].get(p)],
            "block_sent_bytes_by_phase": sent,
            "block_sent_bytes": sum(sent.values()),
            "step_calls": len(calls),
            "step_sent_bytes": counts["sent_bytes_per_step"],
            "step_ms": ms_per_step(step_s[name], cfg["steps"]),
            "timed_in_turn": places[name],
            "block_comm_ms": summary([t / cfg["replay_inner"] * 1e3 for t in block_s[name]]),
            "step_comm_ms": summary([t / cfg["replay_inner"] * 1e3 for t in whole_s[name]]),
        })
    del found, steps, blocks, wholes, plain
    gc.collect()
    return {"rows": rows, "plain_step_ms": ms_per_step(step_s["plain"], cfg["steps"])}


# ---------------------------------------------------------------------------------------
# Pipeline schedules
# ---------------------------------------------------------------------------------------

def pipeline(ctx: Ctx, n: int, cfg: dict, lesson) -> dict:
    """Every schedule built and run once (its actions, and the warm-up), then all of them and
    one unsplit process timed in turn (Ctx.timed_in_turn)."""
    data = batches(0, 1)
    m = cfg["microbatches"]
    found, windows = {}, {}
    for name in cfg["schedules"]:
        model = T.make_model(T.SEED)
        sched, stages, parts = lesson.build_pipeline(name, model, ctx.rank, n, m, torch.device("cpu"))
        opt = T.make_optimizer(torch.nn.ModuleList(parts))
        x, y = data[0]
        with Recorder(stages) as rec:  # the first step: the actions, and the warm-up
            sched.step(x, target=y)
        every: list = [None] * n
        dist.all_gather_object(every, rec.actions)
        found[name] = (len(stages) * n, idle_fraction(timeline(dict(enumerate(every)))))

        def window(sched=sched, opt=opt):
            for s in range(cfg["steps"]):
                xs, ys = data[s % len(data)]
                opt.zero_grad(set_to_none=True)
                sched.step(xs, target=ys)
                opt.step()

        windows[name] = window
    times, places = ctx.timed_in_turn({**windows, "plain": plain_window(cfg["steps"])}, n)
    plain = ms_per_step(times["plain"], cfg["steps"])
    rows = []
    for name, (stages, predicted) in found.items():
        step_ms = ms_per_step(times[name], cfg["steps"])
        rows.append({"schedule": name, "world_size": n, "microbatches": m,
                     "stages": stages, "predicted_idle": round(predicted, 4),
                     "formula_idle": (round(bubble_formula(n, m), 4)
                                      if name in ("gpipe", "1f1b") else None),
                     "step_ms": step_ms, "timed_in_turn": places[name],
                     # idle share if the ranks had split one process's work perfectly
                     "measured_idle": round(1 - plain["median"] / (n * step_ms["median"]), 4)})
    del windows
    gc.collect()
    return {"rows": rows, "plain_step_ms": plain}


# ---------------------------------------------------------------------------------------
# The processes
# ---------------------------------------------------------------------------------------

def worker(rank: int, world: int, plan: dict) -> dict | None:
    """One CPU rank of a world of 1 or 2: the Part 2 benchmarks that need this world size;
    rank 0 returns the sections. bench/run.py starts it in a gloo group (the plan's timeout)."""
    # FSDP2 warns that the root returns a view; the loss reads it out of place, as lesson 15
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    ctx = Ctx(rank, world, plan, torch.device("cpu"))
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
    return results if rank == 0 else None


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


# ---------------------------------------------------------------------------------------
# Tables (the same in both languages) and the page's sections, every sentence from the data
# ---------------------------------------------------------------------------------------

def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def _ms(s: dict) -> str:
    from bench.words import spread
    return spread(s)


def fsdp_table(sec: dict):
    rows = [[r["strategy"], r["world_size"], _ms(r["sequences_per_s"]), _ms(r["step_ms"]),
             f"{r['calls_per_step']:g}", _kib(r["sent_bytes_per_step"]),
             *(_kib(r["held_bytes"][k]) for k in sharding.KEYS)] for r in sec["rows"]]
    return ("FSDP2 vs DDP on the transformer (CPU, gloo)",
            ["strategy", "ranks", "sequences/s (min-max)", "step ms (min-max)", "calls/step",
             "KiB sent/step", "KiB params", "KiB grads", "KiB optimizer"], rows)


def _calls(kinds: dict) -> str:
    return ", ".join(f"{n:g} {k}" for k, n in kinds.items()) or "-"


def tp_table(sec: dict):
    where = {"between": "sum", "optimizer": "AdamW's step"}
    rows = []
    for r in sec["rows"]:
        calls, sent = r["block_calls"], r["block_sent_bytes_by_phase"]
        after = _calls(calls["after"])
        if calls["after"]:
            after += f" ({', '.join(where[p] for p in r['block_after_in'])})"
        rows.append([_name(r), f"{_calls(calls['forward'])} / {_calls(calls['backward'])} / {after}",
                     *(f"{sent[p]:,.0f}" for p in ("forward", "backward", "after")),
                     _ms(r["block_comm_ms"]), _ms(r["step_comm_ms"]), _ms(r["step_ms"])])
    rows.append(["one process, whole model", "-", "-", "-", "-", "-", "-", _ms(sec["plain_step_ms"])])
    return ("Tensor parallel on 2 ranks (CPU, gloo): collectives per block and per step",
            ["variant", "calls per block: forward / backward / after backward",
             "bytes sent per block: forward", "backward", "after backward",
             "block's collectives ms", "step's collectives ms", "step ms (min-max)"], rows)


def pipeline_table(sec: dict):
    rows = [[r["schedule"], r["stages"], f"{r['predicted_idle']:.0%}",
             "-" if r["formula_idle"] is None else f"{r['formula_idle']:.0%}",
             _ms(r["step_ms"]), f"{r['measured_idle']:.0%}"] for r in sec["rows"]]
    rows.append(["one process, whole model", 1, "-", "-", _ms(sec["plain_step_ms"]), "-"])
    return (f"Pipeline schedules on 2 ranks (CPU, gloo), {sec['config']['microbatches']} micro-batches",
            ["schedule", "stages", "idle predicted (timeline)", "(p-1)/(m+p-1)",
             "step ms (min-max)", "idle measured"], rows)


def all_tables(b: dict) -> list:
    return ([("fsdp", fsdp_table(b["fsdp"]))] if "fsdp" in b else []) + \
           ([("tp", tp_table(b["tp"]))] if "tp" in b else []) + \
           ([("pipeline", pipeline_table(b["pipeline"]))] if "pipeline" in b else [])


def _row(rows, strategy, n):
    return next((r for r in rows if r["strategy"] == strategy and r["world_size"] == n), None)


def fsdp_lines(sec: dict) -> list[str]:
    from bench.words import L, compare, order, real
    rows, out = sec["rows"], []
    ddp1, ddp2 = _row(rows, "ddp", 1), _row(rows, "ddp", 2)
    z3, z2 = _row(rows, "fsdp-zero3", 2), _row(rows, "fsdp-zero2", 2)
    if ddp2 and z3:
        r = sum(z3["held_bytes"].values()) / sum(ddp2["held_bytes"].values())
        if r <= 0.6:
            out.append(L(f"* Memory: on 2 ranks each FSDP2 rank held {r:.0%} of what a DDP rank "
                         f"held: parameters, gradients and optimizer state are all divided by "
                         f"the ranks, where DDP keeps a whole copy of each on every rank.",
                         f"* 内存：在 2 个秩上，FSDP2 每个秩持有的字节数是 DDP 每个秩的 {r:.0%}："
                         f"参数、梯度和优化器状态都按秩切分，而 DDP 在每个秩上都保留完整的一份。"))
        elif r < 0.95:
            out.append(L(f"* Memory: each FSDP2 rank held {r:.0%} of a DDP rank's bytes: less, "
                         f"but not the 50% that an even split would give.",
                         f"* 内存：FSDP2 每个秩持有 DDP 每个秩的 {r:.0%}：更少，但没有达到均匀切分"
                         f"应有的 50%。"))
        else:
            out.append(L(f"* Memory: each FSDP2 rank held {r:.0%} of a DDP rank's bytes: "
                         f"sharding saved nothing here.",
                         f"* 内存：FSDP2 每个秩持有 DDP 每个秩的 {r:.0%}：在这里切分没有节省内存。"))
    if ddp2 and z3 and ddp2["sent_bytes_per_step"]:
        s3 = z3["sent_bytes_per_step"] / ddp2["sent_bytes_per_step"]
        if s3 > 1.05:
            out.append(L(f"* Bytes: ZeRO-3 sent {s3:.2f}x DDP's bytes per step: it all-gathers "
                         f"the blocks' parameters for forward, again for backward (the root's "
                         f"only once: it is not resharded after forward), and reduce-scatters "
                         f"the gradients, where DDP only all-reduces the gradients.",
                         f"* 字节：ZeRO-3 每步发送的字节是 DDP 的 {s3:.2f} 倍：它为前向收集一次各块的参数，"
                         f"为反向再收集一次（根模块的参数只收集一次：前向之后不再切分），再对梯度做规约-散播；"
                         f"DDP 只对梯度做全局规约。"))
        elif s3 >= 0.95:
            out.append(L(f"* Bytes: ZeRO-3 sent {s3:.2f}x DDP's bytes per step: about the same.",
                         f"* 字节：ZeRO-3 每步发送的字节是 DDP 的 {s3:.2f} 倍：大致相同。"))
        else:
            out.append(L(f"* Bytes: ZeRO-3 sent only {s3:.2f}x DDP's bytes per step.",
                         f"* 字节：ZeRO-3 每步只发送了 DDP 的 {s3:.2f} 倍字节。"))
        if z2 and z3["sent_bytes_per_step"]:
            s2 = z2["sent_bytes_per_step"] / z3["sent_bytes_per_step"]
            if s2 < 0.95:
                out.append(L(f"* reshard_after_forward=False (ZeRO-2-like) sent {1 - s2:.0%} less "
                             f"than ZeRO-3: it keeps the gathered parameters from forward to "
                             f"backward, so it skips the second all-gather, and holds them in "
                             f"memory in between.",
                             f"* reshard_after_forward=False（类 ZeRO-2）比 ZeRO-3 少发送 {1 - s2:.0%}："
                             f"它把前向收集到的参数保留到反向，省掉第二次全收集，代价是这段时间里要在内存中持有它们。"))
            else:
                out.append(L("* reshard_after_forward=False (ZeRO-2-like) sent no less than "
                             "ZeRO-3 in this run.",
                             "* 在这次运行中，reshard_after_forward=False（类 ZeRO-2）发送的字节不比 ZeRO-3 少。"))
    if ddp2 and z3:
        o = order(z3["sequences_per_s"], ddp2["sequences_per_s"])
        line = L(f"* Speed on 2 ranks: ZeRO-3's throughput was "
                 f"{compare(z3['sequences_per_s'], ddp2['sequences_per_s'], 'DDP')}.",
                 f"* 2 个秩上的速度：ZeRO-3 的吞吐量"
                 f"{compare(z3['sequences_per_s'], ddp2['sequences_per_s'], 'DDP')}。")
        if o < 0:
            line += L(" On a model this small the extra collectives and FSDP2's bookkeeping "
                      "cost more than sharding saves: FSDP pays when memory, not speed, is "
                      "the limit.",
                      "在这么小的模型上，多出来的集合通信和 FSDP2 的管理开销超过了切分带来的好处："
                      "当限制在于内存而不是速度时，FSDP 才划算。")
        elif o > 0:
            line += L(" Here FSDP2 was also faster than DDP.", "在这里 FSDP2 还比 DDP 更快。")
        out.append(line)
    if ddp1 and ddp2:
        x = ddp2["sequences_per_s"]["median"] / ddp1["sequences_per_s"]["median"]
        out.append(L(f"* DDP on 2 ranks trained {x:.2f}x the sequences/s of 1 rank; "
                     f"{real(ddp2['sequences_per_s'], ddp1['sequences_per_s'])}.",
                     f"* 2 个秩上的 DDP 每秒训练的序列数是 1 个秩的 {x:.2f} 倍；"
                     f"{real(ddp2['sequences_per_s'], ddp1['sequences_per_s'])}。"))
    return out


def _name(r: dict) -> str:
    return r["impl"] + (" + SP" if r["sequence_parallel"] else "")


def tp_lines(sec: dict) -> list[str]:
    from bench.words import L, compare, order
    rows, out = sec["rows"], []
    if not rows:
        return out
    shares = {_name(r): r["step_comm_ms"]["median"] / r["step_ms"]["median"] for r in rows}
    big = [n for n, s in shares.items() if s > 0.5]
    listed = ", ".join(f"{n} {s:.0%}" for n, s in shares.items())
    if len(big) == len(shares):
        out.append(L(f"* The collectives of a step, replayed alone, took more than half of the "
                     f"step's time in every variant ({listed}): at width {sec['model']['dim']} "
                     f"a block has little arithmetic to set against the collectives inside it.",
                     f"* 把一步中的集合通信单独重放，在每个变体里都占了该步一半以上的时间（{listed}）："
                     f"宽度为 {sec['model']['dim']} 时，一个块里的计算量很少，抵不过块内的集合通信。"))
    elif not big:
        out.append(L(f"* The collectives of a step, replayed alone, took less than half of the "
                     f"step's time in every variant ({listed}): computation, not communication, "
                     f"was most of a step.",
                     f"* 把一步中的集合通信单独重放，在每个变体里都不到该步时间的一半（{listed}）："
                     f"一步的大部分是计算，而不是通信。"))
    else:
        out.append(L(f"* The collectives of a step, replayed alone, took more than half of the "
                     f"step in {', '.join(big)}, less in the others ({listed}).",
                     f"* 把一步中的集合通信单独重放，在 {', '.join(big)} 中占了该步一半以上的时间，"
                     f"在其他变体中不到一半（{listed}）。"))
    best = min(rows, key=lambda r: r["step_ms"]["median"])
    o = order(best["step_ms"], sec["plain_step_ms"])
    line = L(f"* The fastest split ({_name(best)}) took a step in a time "
             f"{compare(best['step_ms'], sec['plain_step_ms'], 'one process with the whole model')}.",
             f"* 最快的切分方式（{_name(best)}）完成一步所用的时间"
             f"{compare(best['step_ms'], sec['plain_step_ms'], '拥有整个模型的单进程')}。")
    if o > 0:
        line += L(" Splitting a model this small made it slower: tensor parallel is for layers "
                  "too big for one device, and it needs a fast link (NVLink), because it "
                  "communicates inside every block, forward and backward.",
                  "把这么小的模型切开反而更慢：张量并行是为单个设备放不下的层准备的，而且它需要"
                  "高速互联（NVLink），因为它在每个块的前向和反向中都要通信。")
    elif o < 0:
        line += L(" Here splitting the layers over 2 ranks paid off.",
                  "在这里把层切到 2 个秩上是划算的。")
    out.append(line)
    by = {(r["impl"], r["sequence_parallel"]): r for r in rows}
    both_ways = lambda r: r["block_sent_bytes_by_phase"]["forward"] + r["block_sent_bytes_by_phase"]["backward"]  # noqa: E731
    for sp in (False, True):
        hand, dt = by.get(("manual", sp)), by.get(("dtensor", sp))
        if not (hand and dt and both_ways(hand)):
            continue
        h, d = hand["block_sent_bytes_by_phase"], dt["block_sent_bytes_by_phase"]
        with_sp = L(" with sequence parallel", "（使用序列并行）") if sp else ""
        if all(abs(d[p] - h[p]) <= 0.01 * h[p] for p in ("forward", "backward")):
            out.append(L(f"* DTensor's plan{with_sp} sent what the by-hand plan sent per block: "
                         f"{h['forward']:,.0f} bytes in forward and {h['backward']:,.0f} in "
                         f"backward. The same split of the same layers needs the same "
                         f"collectives, whichever code issues them.",
                         f"* DTensor 的方案{with_sp}每个块发送的字节与手写方案相同：前向 {h['forward']:,.0f} "
                         f"字节，反向 {h['backward']:,.0f} 字节。同样的层、同样的切分，需要的集合通信也相同，"
                         f"无论由哪段代码发起。"))
        else:
            out.append(L(f"* DTensor's plan{with_sp} sent {d['forward'] / max(h['forward'], 1):.2f}x "
                         f"the by-hand plan's bytes per block in forward and "
                         f"{d['backward'] / max(h['backward'], 1):.2f}x in backward.",
                         f"* DTensor 的方案{with_sp}每个块在前向发送的字节是手写方案的 "
                         f"{d['forward'] / max(h['forward'], 1):.2f} 倍，在反向是 "
                         f"{d['backward'] / max(h['backward'], 1):.2f} 倍。"))
        k_h, k_d = sum(hand["block_calls"]["after"].values()), sum(dt["block_calls"]["after"].values())
        if bool(k_h) != bool(k_d):
            out.append(L(f"* After backward{with_sp}: by hand {k_h:g} all-reduces per block "
                         f"({h['after']:,.0f} bytes), DTensor {k_d:g} ({d['after']:,.0f} bytes).",
                         f"* 反向之后{with_sp}：手写方案每个块 {k_h:g} 次全局规约（{h['after']:,.0f} 字节），"
                         f"DTensor {k_d:g} 次（{d['after']:,.0f} 字节）。"))
        elif k_h and k_d:
            out.append(L(f"* After backward{with_sp}: by hand, {k_h:g} small all-reduces per block "
                         f"sum the gradients of the parameters whole on every rank (lesson 17, "
                         f"Step 4), {h['after']:,.0f} bytes; DTensor leaves the LayerNorms' gradients "
                         f"Partial (a sum still to do) and sums them inside AdamW's step, {k_d:g} "
                         f"calls, {d['after']:,.0f} bytes (lesson 17, Step 6: a Partial gradient "
                         f"is summed each time the step reads it). Few bytes either way.",
                         f"* 反向之后{with_sp}：手写方案每个块用 {k_h:g} 次小的全局规约，对每个秩上都完整保存的"
                         f"参数的梯度求和（第 17 课第 4 步），{h['after']:,.0f} 字节；DTensor 让各 LayerNorm 的梯度保持 "
                         f"Partial（还有一次求和没做），在 AdamW 的更新步中才求和，{k_d:g} 次调用，{d['after']:,.0f} 字节"
                         f"（第 17 课第 6 步：更新步每读取一次 Partial 梯度就求和一次）。两种做法的字节都很少。"))
    for impl in ("manual", "dtensor"):
        tp_row, sp_row = by.get((impl, False)), by.get((impl, True))
        if tp_row and sp_row and both_ways(tp_row):
            x = both_ways(sp_row) / both_ways(tp_row)
            same = abs(x - 1) < 0.02
            out.append(L(f"* {impl}: with sequence parallel a block sent {x:.2f}x the bytes of "
                         f"plain tensor parallel in forward and backward"
                         + (" (a reduce-scatter plus an all-gather moves what one all-reduce "
                            "moves)" if same else "")
                         + f"; its collectives took a time "
                         f"{compare(sp_row['block_comm_ms'], tp_row['block_comm_ms'], 'plain TP')}.",
                         f"* {impl}：使用序列并行时，一个块在前向和反向发送的字节是普通张量并行的 {x:.2f} 倍"
                         + ("（一次规约-散播加一次全收集，传输量与一次全局规约相同）" if same else "")
                         + f"；它的集合通信所用时间"
                         f"{compare(sp_row['block_comm_ms'], tp_row['block_comm_ms'], '普通张量并行')}。"))
    return out


def pipeline_lines(sec: dict) -> list[str]:
    from bench.words import L, compare, order
    rows, out = sec["rows"], []
    if not rows:
        return out
    pred = min(rows, key=lambda r: r["predicted_idle"])
    fast = min(rows, key=lambda r: r["step_ms"]["median"])
    clear = all(order(fast["step_ms"], r["step_ms"]) < 0 for r in rows if r is not fast)
    if fast is pred and clear:
        out.append(L(f"* The schedule whose timeline predicts the smallest bubble "
                     f"({pred['schedule']}, {pred['predicted_idle']:.0%} idle) was also the "
                     f"fastest, beyond the spread.",
                     f"* 时间线预测气泡最小的调度（{pred['schedule']}，空闲 {pred['predicted_idle']:.0%}）"
                     f"也确实最快，超出了波动范围。"))
    elif clear:
        out.append(L(f"* The prediction did not hold: {pred['schedule']} has the smallest "
                     f"predicted bubble ({pred['predicted_idle']:.0%}), but {fast['schedule']} "
                     f"(predicted {fast['predicted_idle']:.0%}) was the fastest, beyond the "
                     f"spread.",
                     f"* 预测没有成立：{pred['schedule']} 的预测气泡最小（{pred['predicted_idle']:.0%}），"
                     f"但 {fast['schedule']}（预测 {fast['predicted_idle']:.0%}）最快，超出了波动范围。"))
    else:
        out.append(L(f"* No schedule was faster than all the others beyond the spread, so this "
                     f"run cannot confirm that {pred['schedule']}'s smaller predicted bubble "
                     f"({pred['predicted_idle']:.0%}) makes it faster.",
                     f"* 没有哪个调度超出波动范围地快于其他所有调度，所以这次运行无法证实 "
                     f"{pred['schedule']} 较小的预测气泡（{pred['predicted_idle']:.0%}）能让它更快。"))
    worse = [r for r in rows if r["measured_idle"] > r["predicted_idle"] + 0.05]
    if len(worse) == len(rows):
        out.append(L("* Every schedule lost more time than its timeline predicts. The timeline "
                     "counts a forward as 1 unit, a backward as 2, and communication as free; "
                     "the measured idle share (1 - one process's step / (2 x the pipeline's "
                     "step)) also holds the sends and receives between stages and each "
                     "micro-batch's fixed cost, which grow with the number of stages.",
                     "* 每个调度损失的时间都比它的时间线预测的多。时间线把一次前向算作 1 个单位、一次反向"
                     "算作 2 个单位，并认为通信不花时间；而实测的空闲比例（1 - 单进程一步的时间 / (2 x "
                     "流水线一步的时间)）还包含阶段之间的发送和接收，以及每个微批次的固定开销，它们随阶段数增加。"))
    else:
        better = [r for r in rows if r["measured_idle"] < r["predicted_idle"] - 0.05]
        close = [r for r in rows if r not in worse and r not in better]
        names = lambda rs: ", ".join(r["schedule"] for r in rs)  # noqa: E731
        if worse:
            out.append(L(f"* {names(worse)} lost more time than predicted (by more than 5 points).",
                         f"* {names(worse)} 损失的时间比预测多（超过 5 个百分点）。"))
        if better:
            out.append(L(f"* {names(better)} lost less than predicted (by more than 5 points): "
                         f"the one process they are measured against took longer than 2 ranks' "
                         f"perfect share of its work (a whole batch at once, or other programs on "
                         f"the cores), so the measured idle share is only an estimate.",
                         f"* {names(better)} 损失的时间比预测少（超过 5 个百分点）：作为比较基准的单进程，"
                         f"所用时间超过了 2 个秩完美分摊其工作时应有的时间（一次处理整个批次，或者有其他程序"
                         f"占用核心），所以实测的空闲比例只是一个估计。"))
        if close:
            out.append(L(f"* {names(close)} came within 5 points of the timeline's prediction.",
                         f"* {names(close)} 与时间线的预测相差不到 5 个百分点。"))
    o = order(fast["step_ms"], sec["plain_step_ms"])
    out.append(L(f"* The fastest pipeline ({fast['schedule']}) took a step in a time "
                 f"{compare(fast['step_ms'], sec['plain_step_ms'], 'one process with the whole model')}"
                 + (": the pipeline used its 2 ranks to go faster." if o < 0 else
                    ": on this small model 2 stages did not buy speed; a pipeline is for a model "
                    "that does not fit on one device." if o > 0 else "."),
                 f"* 最快的流水线（{fast['schedule']}）完成一步所用的时间"
                 f"{compare(fast['step_ms'], sec['plain_step_ms'], '拥有整个模型的单进程')}"
                 + ("：流水线用它的 2 个秩跑得更快。" if o < 0 else
                    "：在这个小模型上，2 个阶段没有换来速度；流水线是为一个设备放不下的模型准备的。"
                    if o > 0 else "。")))
    return out


def sections(b: dict) -> list[str]:
    """Sections 6-8 of PERFORMANCE.md, in the language bench.doc is writing."""
    from bench.words import API, L, TEACHES, md_table
    out = []
    if "fsdp" in b:
        sec, m = b["fsdp"], b["fsdp"]["model"]
        out += [L("## 6. FSDP2 vs DDP on the transformer", "## 6. Transformer 上的 FSDP2 与 DDP"), "",
                L(f"Lesson 15: the Part 2 recipe ({m['blocks']} blocks, width {m['dim']}, "
                  f"{m['params']:,} parameters, global batch {m['global_batch']} sequences of "
                  f"{m['seq']} tokens) trained with DDP and with FSDP2's "
                  f"[`fully_shard`]({API}/distributed.fsdp.fully_shard.html) on every block, "
                  f"resharded after forward (ZeRO-3) or not (`reshard_after_forward=False`, "
                  f"ZeRO-2-like), on 1 and 2 ranks. As in lesson 15, the root (embeddings, last "
                  f"norm, head) gets `fully_shard` at its default, as torch advises: a root is "
                  f"not resharded after forward, because backward needs it first, so its "
                  f"parameters are gathered once per step. Bytes sent are counted per call by lesson 14's CommLog "
                  f"(apparatus/comm.py, ring formulas); bytes held are read from each rank's own "
                  f"tensors (apparatus/sharding.py), the largest over the ranks.",
                  f"第 15 课：Part 2 的配方模型（{m['blocks']} 个块，宽度 {m['dim']}，{m['params']:,} 个参数，"
                  f"全局批次 {m['global_batch']} 条、每条 {m['seq']} 个词元的序列），分别用 DDP，以及在每个块上"
                  f"调用 FSDP2 的 [`fully_shard`]({API}/distributed.fsdp.fully_shard.html)、前向之后重新切分"
                  f"（ZeRO-3）或不切分（`reshard_after_forward=False`，类 ZeRO-2），在 1 个和 2 个秩上训练。"
                  f"与第 15 课一样，根模块（嵌入、最后的归一化层、输出头）按 torch 的建议以默认参数调用 "
                  f"`fully_shard`：根模块在前向之后不重新切分，因为反向一开始就要用到它，所以它的参数每步只收集一次。发送的字节由第 14 课的 "
                  f"CommLog（apparatus/comm.py，环形公式）逐次调用计数；持有的字节从每个秩自己的张量读出"
                  f"（apparatus/sharding.py），取各秩中的最大值。"), "",
                md_table(*fsdp_table(sec)), L(*TEACHES), ""] + fsdp_lines(sec) + [""]
    if "tp" in b:
        sec = b["tp"]
        out += [L("## 7. Tensor parallel: the cost of its collectives", "## 7. 张量并行：集合通信的代价"), "",
                L("Lesson 17's split of every block on 2 ranks, by hand and with DTensor's "
                  f"[`parallelize_module`]({API}/distributed.tensor.parallel.html) (the lesson's "
                  "plan as it is: one `PrepareModuleInput` with `use_local_output=False` per "
                  "sublayer, so q, k and v share one input and its gradient is summed once), "
                  "with and without sequence parallel (SP). apparatus/comm.py's CommLog counts "
                  "every collective of one training step, DTensor's own and the optimizer "
                  "step's included, and lesson 17's own count (its Step 6) gives the last "
                  "block's: what its modules issue in forward and in backward, and its share of "
                  "the small sums after backward (by hand: lesson 17's Step 4; DTensor: inside "
                  "AdamW's step). The collectives of one block, and of the whole step, are then "
                  "replayed alone with `torch.distributed` calls of the same kinds and sizes, "
                  "and timed. Beside them: a whole step, and one process training the whole "
                  "model on the whole batch; the variants' steps and that process are timed in "
                  "turn, one repetition of each per round.",
                  "第 17 课在 2 个秩上切分每个块，分别用手写方式和 DTensor 的 "
                  f"[`parallelize_module`]({API}/distributed.tensor.parallel.html)（即课上的方案：每个子层一个 "
                  "`use_local_output=False` 的 `PrepareModuleInput`，q、k、v 共用一个输入，它的梯度只求和一次），"
                  "并分别开启和不开启序列并行（SP）。apparatus/comm.py 的 CommLog 统计一个训练步中的每次集合通信，"
                  "包括 DTensor 自己发起的和优化器步骤中的；第 17 课自己的计数（它的第 6 步）给出最后一个块的部分："
                  "它的模块在前向和反向中发起的集合通信，以及它在反向之后那些小求和中所占的份额（手写：第 17 课第 4 步；"
                  "DTensor：在 AdamW 的更新步中）。然后用同样种类和大小的 `torch.distributed` 调用单独重放一个块的、"
                  "以及整步的集合通信并计时。旁边列出完整一步的时间，以及单个进程用整个批次训练整个模型的时间；"
                  "各变体的一步和这个单进程轮流计时，每轮各重复一次。"), "",
                md_table(*tp_table(sec)), L(*TEACHES), ""] + tp_lines(sec) + [""]
    if "pipeline" in b:
        sec = b["pipeline"]
        out += [L("## 8. Pipeline schedules: measured time beside the predicted bubble",
                  "## 8. 流水线调度：实测时间与预测的气泡"), "",
                L(f"Lesson 18's schedules from "
                  f"[`torch.distributed.pipelining`]({API}/distributed.pipelining.html) on 2 "
                  f"ranks, {sec['config']['microbatches']} micro-batches. *Idle predicted* is "
                  f"the share of rank-time the schedule's own timeline leaves idle (its recorded "
                  f"actions, a forward 1 unit, a backward 2, communication free: "
                  f"lessons/18_pipeline_schedules/pipeline.py); *idle measured* is 1 - (one process's step) / "
                  f"(2 x the pipeline's step), what the 2 ranks lost against splitting one "
                  f"process's work perfectly.",
                  f"第 18 课中 [`torch.distributed.pipelining`]({API}/distributed.pipelining.html) 的调度，"
                  f"2 个秩，{sec['config']['microbatches']} 个微批次。*预测空闲*是调度自己的时间线中空闲的秩时间"
                  f"比例（按记录的动作，一次前向 1 个单位、一次反向 2 个单位、通信不计时间：lessons/18_pipeline_schedules/pipeline.py）；"
                  f"*实测空闲*是 1 - （单进程一步的时间）/（2 x 流水线一步的时间），即 2 个秩相对于完美分摊单进程"
                  f"工作所损失的部分。"), "",
                md_table(*pipeline_table(sec)), L(*TEACHES), ""] + pipeline_lines(sec) + [""]
    return out
