"""Naive model parallel versus micro-batch pipelining, timed for real and replayed.

Lesson 04 (lessons/04_model_parallel.py) splits lesson 01's MLP into two stages
(`SplitMLP`). This module holds what only checks and measures that split:

* `two_devices`: the stages' devices (cuda:0 and cuda:1 with 2 GPUs, else both on one
  device, said plainly) and the checks of the pipelining flags;
* `check_split`: the split model's outputs and gradients against the unsplit model's;
* `run_micro_batches`: one step's forward and backward in m micro-batches, GPipe order,
  with the graph cut between the stages so that each task can be timed on its own;
* `time_stages` (Step 6): micro-batching gives the whole batch's gradient, then every
  task timed for 1 and for m micro-batches, fastest of --repeats;
* `schedule` and `timeline` (Step 7): the measured times replayed on two devices that work
  at the same time, and drawn; `show_timelines` prints both schedules' idle fractions.

Doc: docs/04_model_parallel.md (Steps 3, 6 and 7).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from common import recipe
from common.cli import fail

SPLIT = {"stage 0": ["fc1", "fc2"], "stage 1": ["head"]}  # lesson 04's SplitMLP, by layer name


def two_devices(args, device: torch.device, ui) -> tuple[torch.device, torch.device]:
    """(stage 0's device, stage 1's device); also checks the pipelining flags."""
    if not 1 <= args.micro_batches <= 16:
        fail(f"--micro-batches {args.micro_batches}: use 1 to 16 (the timeline shows each one)")
    if args.pipeline_batch < args.micro_batches:
        fail(f"--pipeline-batch {args.pipeline_batch} cannot be split into "
             f"{args.micro_batches} micro-batches; use at least {args.micro_batches} rows")
    if args.repeats < 1:
        fail(f"--repeats {args.repeats}: time each task at least once (--repeats 1 or more)")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus >= 2:
        dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
        ui.print(f"{gpus} GPUs: stage 0 on {dev0}, stage 1 on {dev1}")
        return dev0, dev1
    ui.print(f"{'one GPU' if gpus == 1 else 'no GPU'} here: both stages are placed on "
             f"{device}.\nTwo placements on one device, not two devices: the activation "
             f"'moves' with a .to() that copies nothing,\nand the two stages cannot run at "
             f"the same time, so Step 7 replays the measured stage times on two devices.")
    return device, device


def check_split(model, seed: int, data, ui) -> dict:
    """Same batch through the split model and an unsplit one from the same seed: outputs and
    all gradients must match (the split moves the arithmetic, never changes it). First, what
    each device holds: only its own layers' weights (and later their gradients and state)."""
    for (stage, layers), dev in zip(SPLIT.items(), (model.dev0, model.dev1)):
        params = [p for name in layers for p in getattr(model, name).parameters()]
        ui.print(f"{stage} on {dev}: {', '.join(layers):<9} {sum(p.numel() for p in params):>5,} "
                 f"parameters ({sum(p.numel() * p.element_size() for p in params) / 1024:.1f} KiB)"
                 f", all on {', '.join(sorted({str(p.device) for p in params}))}")
    model = copy.deepcopy(model)  # leave the lesson's model without gradients
    whole = recipe.make_model(seed, data.in_features, data.classes).to(model.dev1)
    x, y = data.train.tensors[0][:recipe.GLOBAL_BATCH], data.train.tensors[1][:recipe.GLOBAL_BATCH]
    out_split, out_whole = model(x), whole(x.to(model.dev1))
    F.cross_entropy(out_split, y.to(model.dev1)).backward()
    F.cross_entropy(out_whole, y.to(model.dev1)).backward()
    diff_out = (out_split - out_whole).abs().max().item()
    whole_grads = dict(whole.named_parameters())
    diff_grad = max((p.grad.to(model.dev1) - whole_grads[n].grad).abs().max().item()
                    for n, p in model.named_parameters())
    ui.print(f"split vs whole, outputs {tuple(out_split.shape)}: max |split - whole| = {diff_out:.1e}; "
             f"gradients of all {len(whole_grads)} tensors: max diff = {diff_grad:.1e}")
    assert diff_out <= 1e-6 and diff_grad <= 1e-6, (diff_out, diff_grad)
    return {"output_max_diff": diff_out, "grad_max_diff": diff_grad}


def run_micro_batches(model, x: torch.Tensor, y: torch.Tensor, m: int,
                      clock=time.perf_counter) -> tuple[float, dict]:
    """One training step's forward and backward in m micro-batches, GPipe order.

    Every forward first (F0 then F1 for micro-batch 0, 1, ...), then every backward in
    reverse. The activation between the stages is cut with detach(): stage 1's backward
    stops at its copy `h_in`, and stage 0's backward starts from `h_in.grad`, exactly what
    a pipeline across processes does. Each micro-batch's loss is a sum divided by the whole
    batch size, so the m gradients add up to the full batch's mean-loss gradient.
    Returns the loss and the seconds each task (kind, stage, micro-batch) took.
    """
    seconds = {}
    saved = []
    total = len(y)
    for k, (xk, yk) in enumerate(zip(x.chunk(m), y.chunk(m))):
        t = clock()
        h = model.stage0(xk)
        seconds["F", 0, k] = clock() - t
        h_in = h.detach().requires_grad_()
        t = clock()
        loss = F.cross_entropy(model.stage1(h_in), yk.to(model.dev1), reduction="sum") / total
        seconds["F", 1, k] = clock() - t
        saved.append((h, h_in, loss))
    for k in reversed(range(m)):
        h, h_in, loss = saved[k]
        t = clock()
        loss.backward()
        seconds["B", 1, k] = clock() - t
        t = clock()
        h.backward(h_in.grad.to(model.dev0))
        seconds["B", 0, k] = clock() - t
    return sum(loss.item() for _, _, loss in saved), seconds


def time_stages(model, data, args, ui) -> tuple[dict, float]:
    """Step 6: ({1: task seconds, m: task seconds}, micro-batch gradient difference)."""
    dev0, dev1, m = model.dev0, model.dev1, args.micro_batches
    sync = (lambda: [torch.cuda.synchronize(d) for d in {dev0, dev1}]) if dev0.type == "cuda" \
        else (lambda: None)

    def clock() -> float:  # GPU work is asynchronous: wait for it before reading the time
        sync()
        return time.perf_counter()

    probe = copy.deepcopy(model)  # timing runs accumulate gradients: keep the trained model clean
    xb, yb = data.train.tensors[0][:recipe.GLOBAL_BATCH], data.train.tensors[1][:recipe.GLOBAL_BATCH]
    F.cross_entropy(probe(xb), yb.to(dev1)).backward()
    full = {n: p.grad.clone() for n, p in probe.named_parameters()}
    probe.zero_grad(set_to_none=True)
    run_micro_batches(probe, xb, yb, m)
    diff_micro = max((p.grad - full[n]).abs().max().item() for n, p in probe.named_parameters())
    ui.print(f"{m} micro-batches of the recipe's batch vs the whole batch: max gradient "
             f"difference {diff_micro:.1e}")
    assert diff_micro <= 1e-6, diff_micro
    gen = torch.Generator().manual_seed(args.seed)
    # Inputs start on the stage that reads them, so no host-to-device copy is timed.
    xt = torch.randn(args.pipeline_batch, data.in_features, generator=gen).to(dev0)
    yt = torch.randint(0, data.classes, (args.pipeline_batch,), generator=gen).to(dev1)
    threads = torch.get_num_threads()
    if dev0.type == "cpu":
        torch.set_num_threads(1)  # one core per simulated device, as if each were its own chip
    measured = {}
    for mb in (1, m):
        samples = [run_micro_batches(probe, xt, yt, mb, clock)[1] for _ in range(args.repeats)]
        # Other programs can only ever *add* time to a task, so the fastest of a few
        # repeats is the best estimate of the task's own cost (timeit's advice too).
        measured[mb] = {task: min(s[task] for s in samples) for task in samples[0]}
        probe.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    rows = []
    for mb in (1, m):
        per = measured[mb]
        mean = {key: 1000 * statistics.mean(v for (kind, s, _), v in per.items() if (kind, s) == key)
                for key in (("F", 0), ("F", 1), ("B", 1), ("B", 0))}
        rows.append([f"{mb} x {len(xt.chunk(mb)[0])} rows", *(f"{mean[k]:.3f}" for k in mean),
                     f"{1000 * sum(per.values()):.3f}"])
    ui.table(f"ms per task on {dev0 if dev0 == dev1 else f'{dev0} and {dev1}'}, fastest of "
             f"{args.repeats} (batch of {args.pipeline_batch} rows)",
             ["micro-batches", "F stage 0", "F stage 1", "B stage 1", "B stage 0", "all tasks"], rows)
    return measured, diff_micro


def schedule(seconds: dict, m: int, stages: int = 2) -> dict:
    """Replay measured task times on `stages` devices that run at the same time.

    Each device runs its own tasks in GPipe order (forwards 0..m-1, then backwards m-1..0).
    A task starts when its device is free *and* its input exists: F(s, k) needs F(s-1, k)
    (the activation), B(s, k) needs B(s+1, k) (the gradient). Returns start/end per task.
    """
    order = {s: [("F", s, k) for k in range(m)] + [("B", s, k) for k in reversed(range(m))]
             for s in range(stages)}
    end, start, free, nxt = {}, {}, [0.0] * stages, [0] * stages
    while any(nxt[s] < len(order[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if nxt[s] == len(order[s]):
                continue
            kind, _, k = task = order[s][nxt[s]]
            dep = ("F", s - 1, k) if kind == "F" and s > 0 else \
                  ("B", s + 1, k) if kind == "B" and s < stages - 1 else None
            if dep is not None and dep not in end:
                continue  # its input is not ready yet: try the other device
            start[task] = max(free[s], end[dep] if dep else 0.0)
            end[task] = free[s] = start[task] + seconds[task]
            nxt[s] += 1
            progressed = True
        assert progressed, "the schedule is stuck: a task waits on one that never runs"
    makespan = max(end.values())
    idle = [1 - sum(seconds[t] for t in order[s]) / makespan for s in range(stages)]
    return {"start": start, "end": end, "makespan": makespan, "idle": idle,
            "idle_overall": sum(idle) / stages}


def timeline(plan: dict, m: int, scale: float, width: int = 60, stages: int = 2) -> list[str]:
    """One text row per device: digit k = forward of micro-batch k, letter = its backward."""
    rows = []
    for s in range(stages):
        cells = ["."] * width
        for (kind, stage, k), t0 in plan["start"].items():
            if stage != s:
                continue
            a = round(t0 / scale * width)
            b = max(a + 1, round(plan["end"][kind, stage, k] / scale * width))
            mark = str(k % 10) if kind == "F" else "abcdefghijklmnopqrstuvwxyz"[k % 26]
            for i in range(a, min(b, width)):
                cells[i] = mark
        rows.append("".join(cells))
    return rows


def show_timelines(measured: dict, model, args, ui) -> dict:
    """Step 7: replay naive (1 batch) and pipelined (m micro-batches); returns the
    metrics.json `pipeline` entry."""
    m, two_gpus = args.micro_batches, model.dev0 != model.dev1
    naive, piped = schedule(measured[1], 1), schedule(measured[m], m)
    scale = max(naive["makespan"], piped["makespan"])
    for title, plan, mb in (("naive: 1 batch", naive, 1),
                            (f"pipelined: {m} micro-batches", piped, m)):
        ui.print(f"{title:<28} {1000 * plan['makespan']:7.3f} ms, idle {plan['idle_overall']:.0%}")
        for s, row in enumerate(timeline(plan, mb, scale)):
            ui.print(f"  stage {s} |{row}|")
    ui.print("  digits: forward of micro-batch k; letters: its backward (a = 0); dots: idle")
    ui.table("idle fraction = time a device waits / time until the last task ends",
             ["schedule", "ms", "stage 0 idle", "stage 1 idle", "overall"],
             [["naive", f"{1000 * naive['makespan']:.3f}", *(f"{i:.0%}" for i in naive["idle"]),
               f"{naive['idle_overall']:.0%}"],
              [f"pipelined, {m}", f"{1000 * piped['makespan']:.3f}",
               *(f"{i:.0%}" for i in piped["idle"]), f"{piped['idle_overall']:.0%}"],
              ["ideal, equal stages", "", "", "", f"{1 / (m + 1):.0%}"]])
    speedup = naive["makespan"] / piped["makespan"]
    ui.print(f"pipelining cut the idle fraction from {naive['idle_overall']:.0%} to "
             f"{piped['idle_overall']:.0%}; the replayed step is {speedup:.2f}x as fast as naive "
             f"(below 1 means the per-micro-batch overhead costs more than the overlap saves)")
    ui.print(f"(each task was timed alone on {'its own GPU' if two_gpus else model.dev0}; the "
             f"two-device timeline is computed from those times, not observed)")

    def summary(plan: dict) -> dict:
        return {"makespan_ms": round(1000 * plan["makespan"], 4),
                "idle": [round(i, 4) for i in plan["idle"]],
                "idle_overall": round(plan["idle_overall"], 4)}

    return {"micro_batches": m, "batch": args.pipeline_batch,
            "task_ms": {str(mb): {f"{kind}{s}/{k}": round(1000 * v, 4)
                                  for (kind, s, k), v in measured[mb].items()} for mb in measured},
            "naive": summary(naive), "pipelined": summary(piped),
            "replayed_from_measured_tasks": True}
