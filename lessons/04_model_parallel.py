"""Lesson 04: model parallel, the layers of one model split across two devices

New since lesson 03: lesson 03 copied the whole model onto every device and split the
batch. Here we split the *model*: fc1 and fc2 live on one device, the head on another,
and `forward` moves the activations from the first to the second. We check that the split
model computes exactly what the whole one does, train lesson 01's recipe with it, and
then measure why naive model parallel leaves one device idle at a time, and how
micro-batch pipelining (GPipe's schedule) fills the gaps.

With two GPUs the stages are cuda:0 and cuda:1. With one GPU, or none, both stages sit on
the one device (two placements, same hardware) and the lesson says so; the stage times are
still measured for real, and the two-device timeline is replayed from those measurements.

Run:
    make lesson-04
    make lesson-04 ARGS="--micro-batches 8"
    .venv/bin/python lessons/04_model_parallel.py --device cpu --pipeline-batch 96
    .venv/bin/python lessons/04_model_parallel.py --device cuda           # cuda:0 + cuda:1 with 2 GPUs

Doc: docs/04_model_parallel.md
"""
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import recipe
from common.cli import fail, lesson_parser, positive_int, run
from common.device import pick_device
from common.results import (make_metrics, max_abs_diff, out_dir, plain_state_dict,
                            save_results, shown)
from common.ui import UI, Timer


class SplitMLP(nn.Module):
    """The recipe's MLP with its layers on two devices.

    It keeps the attribute names fc1, fc2 and head, so its state_dict has lesson 01's keys
    and the two can be compared tensor by tensor. Stage 0 (fc1, fc2) does most of the
    arithmetic; stage 1 (head, then the loss) is small but has more fixed per-op cost:
    measured on a 2-core CPU, this split is closer to even than fc1 | fc2, head.
    """

    def __init__(self, mlp: nn.Module, dev0: torch.device, dev1: torch.device):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.fc1 = mlp.fc1.to(dev0)
        self.fc2 = mlp.fc2.to(dev0)
        self.head = mlp.head.to(dev1)

    def stage0(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1).to(self.dev0)
        return F.relu(self.fc2(F.relu(self.fc1(x))))

    def stage1(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h.to(self.dev1))  # the activation crosses devices here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(x))  # the same operations as MLP.forward, in order


def run_micro_batches(model: SplitMLP, x: torch.Tensor, y: torch.Tensor, m: int,
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


def main() -> None:
    parser = lesson_parser(__doc__)
    parser.add_argument("--micro-batches", type=positive_int, default=4,
                        help="micro-batches per batch in the pipelining part (1 = naive)")
    parser.add_argument("--pipeline-batch", type=positive_int, default=4096,
                        help="rows in the batch used to time the stages (the recipe's is "
                             f"{recipe.GLOBAL_BATCH}; bigger makes compute, not overhead, dominate)")
    parser.add_argument("--repeats", type=positive_int, default=10,
                        help="how many times each task is timed (the fastest counts)")
    args = parser.parse_args()
    if args.micro_batches > 16:
        fail(f"--micro-batches {args.micro_batches}: use 16 or fewer (the timeline shows each one)")
    if args.pipeline_batch < args.micro_batches:
        fail(f"--pipeline-batch {args.pipeline_batch} cannot be split into "
             f"{args.micro_batches} micro-batches; use at least {args.micro_batches} rows")
    ui = UI(step_mode=args.step)
    ui.title("Lesson 04: model parallel")

    # Step 1: Choose two devices
    # Model parallel needs one device per stage. Two GPUs: cuda:0 and cuda:1. Otherwise
    # both stages share the one device: the code path is identical (the same .to() calls
    # in forward), only the copy between devices becomes a no-op.
    ui.step(1, "Choose two devices")
    device = pick_device(args.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus >= 2:
        dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
        ui.print(f"{gpus} GPUs: stage 0 on {dev0}, stage 1 on {dev1}")
    else:
        dev0 = dev1 = device
        ui.print(f"{'one GPU' if gpus == 1 else 'no GPU'} here: both stages are placed on "
                 f"{device}.\nTwo placements on one device, not two devices: the activation "
                 f"'moves' with a .to() that copies nothing,\nand the two stages cannot run at "
                 f"the same time, so Step 7 replays the measured stage times on two devices.")
    sync = (lambda: [torch.cuda.synchronize(d) for d in {dev0, dev1}]) if device.type == "cuda" \
        else (lambda: None)

    def clock() -> float:  # GPU work is asynchronous: wait for it before reading the time
        sync()
        return time.perf_counter()

    # Step 2: Split the model across the two devices
    # Same seed, same initial weights as lesson 01; we only move layers. Each device holds
    # only its own layers' weights, gradients and optimizer state: that is the whole point
    # when a model does not fit on one device.
    ui.step(2, "Split the model across the two devices")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    model = SplitMLP(recipe.make_model(args.seed, data.in_features, data.classes), dev0, dev1)
    optimizer = recipe.make_optimizer(model)
    split = {"stage 0": ["fc1", "fc2"], "stage 1": ["head"]}
    for (stage, layers), dev in zip(split.items(), (dev0, dev1)):
        params = [p for name in layers for p in getattr(model, name).parameters()]
        ui.print(f"{stage} on {dev}: {', '.join(layers):<9} {sum(p.numel() for p in params):>5,} "
                 f"parameters ({sum(p.numel() * p.element_size() for p in params) / 1024:.1f} KiB)"
                 f", all on {', '.join(sorted({str(p.device) for p in params}))}")

    # Step 3: Check the split model against the whole one
    # Splitting must change *where* the arithmetic happens, never *what* it computes:
    # outputs and gradients must match the unsplit model's.
    ui.step(3, "Check the split model against the whole one")
    whole = recipe.make_model(args.seed, data.in_features, data.classes).to(dev1)
    x, y = data.train.tensors[0][:recipe.GLOBAL_BATCH], data.train.tensors[1][:recipe.GLOBAL_BATCH]
    out_split, out_whole = model(x), whole(x.to(dev1))
    F.cross_entropy(out_split, y.to(dev1)).backward()
    F.cross_entropy(out_whole, y.to(dev1)).backward()
    diff_out = (out_split - out_whole).abs().max().item()
    whole_grads = dict(whole.named_parameters())
    diff_grad = max((p.grad.to(dev1) - whole_grads[n].grad).abs().max().item()
                    for n, p in model.named_parameters())
    ui.print(f"outputs {tuple(out_split.shape)}: max |split - whole| = {diff_out:.1e}; "
             f"gradients of all {len(whole_grads)} tensors: max diff = {diff_grad:.1e}")
    assert diff_out <= 1e-6 and diff_grad <= 1e-6, (diff_out, diff_grad)
    optimizer.zero_grad(set_to_none=True)
    del whole, out_split, out_whole

    # Step 4: Train the split model
    # Lesson 01's loop, unchanged: the split is invisible outside forward. The labels go
    # to the device that holds the output (stage 1), where the loss is computed.
    ui.step(4, "Train the split model")
    sampler = recipe.EpochShuffle(len(data.train), seed=args.seed)
    loader = DataLoader(data.train, batch_size=recipe.GLOBAL_BATCH, sampler=sampler)
    losses: list[float] = []
    timer = Timer()
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    with ui.progress(steps, "training") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(model(x), y.to(dev1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # autograd follows the activation back across the devices
                optimizer.step()
                losses.append(loss.item())
                bar.advance()
                if len(losses) % log_every == 0:
                    ui.log(epoch + 1, len(losses), steps, loss.item(),
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 5: Compare with lesson 01 and save
    # The same operations in the same order on the same numbers: the weights should equal
    # lesson 01's (exactly, when both stages share a device).
    ui.step(5, "Compare with lesson 01 and save")
    final_accuracy = recipe.accuracy(model, data.test, dev1)
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"test accuracy [bold green]{final_accuracy:.1%}[/bold green]")
    state = plain_state_dict(model)
    diff = None
    if data.name == "synthetic":
        diff = max_abs_diff(state, recipe.train_reference(args.seed, args.epochs, data))
        ui.print(f"max |w_04 - w_01| = {diff:.1e} (lesson 01's loop, same seed and epochs)")

    # Step 6: Time each stage on micro-batches
    # First prove that micro-batching changes nothing: m micro-batches give the gradient of
    # the whole batch. Then time every task: forward and backward of each stage, for the
    # whole batch (naive) and for each micro-batch, keeping the fastest of a few repeats.
    ui.step(6, "Time each stage on micro-batches")
    m = args.micro_batches
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
    if device.type == "cpu":
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
        rows_per = len(xt.chunk(mb)[0])
        per = measured[mb]
        mean = {key: 1000 * statistics.mean(v for (kind, s, _), v in per.items() if (kind, s) == key)
                for key in (("F", 0), ("F", 1), ("B", 1), ("B", 0))}
        rows.append([f"{mb} x {rows_per} rows", *(f"{mean[k]:.3f}" for k in mean),
                     f"{1000 * sum(per.values()):.3f}"])
    ui.table(f"ms per task on {device}, fastest of {args.repeats} (batch of {args.pipeline_batch} rows)",
             ["micro-batches", "F stage 0", "F stage 1", "B stage 1", "B stage 0", "all tasks"],
             rows)

    # Step 7: Naive versus pipelined timeline
    # Replay the measured times on two devices that work at the same time. Naive: one
    # batch, so stage 1 waits for stage 0 and then stage 0 waits for stage 1. Pipelined:
    # stage 0 starts micro-batch k+1 while stage 1 works on micro-batch k.
    ui.step(7, "Naive versus pipelined timeline")
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
              [f"ideal, equal stages", "", "", "", f"{1 / (m + 1):.0%}"]])
    speedup = naive["makespan"] / piped["makespan"]
    ui.print(f"pipelining cut the idle fraction from {naive['idle_overall']:.0%} to "
             f"{piped['idle_overall']:.0%}; the replayed step is {speedup:.2f}x as fast as naive "
             f"(below 1 means the per-micro-batch overhead costs more than the overlap saves)")
    ui.print(f"(each task was timed alone on {'its own GPU' if gpus >= 2 else device}; the "
             f"two-device timeline is computed from those times, not observed)")

    folder = out_dir("04", args.out)
    samples = args.epochs * len(data.train)

    def plan_summary(plan: dict) -> dict:
        return {"makespan_ms": round(1000 * plan["makespan"], 4),
                "idle": [round(i, 4) for i in plan["idle"]],
                "idle_overall": round(plan["idle_overall"], 4)}

    save_results(folder, state, make_metrics(
        lesson="04", world_size=1, backend="none", device=f"{dev0}+{dev1}", losses=losses,
        final_accuracy=final_accuracy, wall_seconds=wall, samples=samples,
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
        stage_devices=[str(dev0), str(dev1)], split=split, max_abs_diff_vs_01=diff,
        check={"output_max_diff": diff_out, "grad_max_diff": diff_grad,
               "micro_batch_grad_max_diff": diff_micro},
        pipeline={"micro_batches": m, "batch": args.pipeline_batch,
                  "task_ms": {str(mb): {f"{kind}{s}/{k}": round(1000 * v, 4)
                                        for (kind, s, k), v in measured[mb].items()}
                              for mb in measured},
                  "naive": plan_summary(naive), "pipelined": plan_summary(piped),
                  "replayed_from_measured_tasks": True}))
    ui.print(f"\nwrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"(training: {samples / wall:,.0f} samples/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
