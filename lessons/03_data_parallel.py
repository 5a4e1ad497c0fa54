"""Lesson 03: nn.DataParallel, one process driving several devices with threads

New since lesson 02: more than one device. `nn.DataParallel` keeps one Python process and,
on every forward, scatters the batch along dim 0, replicates the model onto each device,
runs the replicas in parallel threads, gathers the outputs on the first device, and lets
backward sum the gradients into the original parameters. We follow one batch through
those stages, train lesson 01's recipe with them, and measure why device 0 works hardest.

With 2 or more GPUs the lesson trains with the real `nn.DataParallel`. Without them,
DataParallel's own scatter/replicate/gather refuse CPU tensors, so the lesson runs the
same algorithm by hand on simulated devices (CPU threads) and says so.

Run:
    make lesson-03
    make lesson-03 ARGS="--devices 4"
    .venv/bin/python lessons/03_data_parallel.py --device cpu --devices 3 --out runs/my-try
    .venv/bin/python lessons/03_data_parallel.py --device cuda --devices 2   # 2+ GPUs

Doc: docs/03_data_parallel.md
"""
import copy
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.markup import escape
from torch.utils.data import DataLoader

from common import recipe
from common.cli import fail, lesson_parser, positive_int, run
from common.device import pick_device
from common.results import (make_metrics, max_abs_diff, out_dir, plain_state_dict,
                            save_results, shown)
from common.ui import UI, Timer

STAGES = ["scatter", "replicate", "parallel forward", "gather", "loss", "backward", "optimizer step"]


# The four stages of DataParallel.forward, written for simulated devices on the CPU.
# Each mirrors a function in torch/nn/parallel/ (named in its docstring); on GPUs the
# lesson calls those functions themselves.

def scatter_by_hand(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """scatter_gather.scatter: equal chunks along dim 0, one per device."""
    return x.chunk(n, dim=0)


def replicate_by_hand(network: nn.Module, n: int) -> list[nn.Module]:
    """replicate.replicate: per device, a shallow copy of every module whose parameters are
    *autograd-connected* copies of the originals (not leaves), so that backward sends each
    replica's gradient back to the original parameter, where the copies' gradients add up.

    Replica 0 aliases the originals (view_as shares storage), as DataParallel guarantees
    for device 0; the others get a real copy (clone), as a broadcast to another GPU would.
    """
    modules = list(network.modules())
    replicas = []
    for j in range(n):
        # _replicate_for_data_parallel is what replicate.py calls: a new module object
        # sharing the original's __dict__, but with an empty _parameters dict.
        copies = {m: m._replicate_for_data_parallel() for m in modules}
        for m, r in copies.items():
            for key, child in m._modules.items():
                setattr(r, key, copies[child])
            for key, p in m._parameters.items():
                setattr(r, key, p.view_as(p) if j == 0 else p.clone())  # a plain attribute now
            for key, b in m._buffers.items():  # the recipe's MLP has none; BatchNorm would
                setattr(r, key, b if j == 0 else b.detach().clone())
        replicas.append(copies[network])
    return replicas


def parallel_apply_by_hand(replicas: list[nn.Module], chunks) -> tuple[list, list[float]]:
    """parallel_apply.parallel_apply: one Python thread per replica, results in order."""
    n = len(replicas)
    outputs, seconds, errors = [None] * n, [0.0] * n, [None] * n
    grad_enabled = torch.is_grad_enabled()

    def worker(i: int) -> None:
        torch.set_grad_enabled(grad_enabled)  # grad mode is per thread: copy the caller's
        try:
            start = time.perf_counter()
            outputs[i] = replicas[i](chunks[i])
            seconds[i] = time.perf_counter() - start
        except Exception as exc:  # re-raised in the caller's thread, like ExceptionWrapper
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return outputs, seconds


def gather_by_hand(outputs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """scatter_gather.gather: concatenate along dim 0 on the output device (device 0)."""
    return torch.cat([o.to(device) for o in outputs], dim=0)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = lesson_parser(__doc__)
    parser.add_argument("--devices", type=positive_int, default=2,
                        help="how many devices share each batch (GPUs if there are enough, "
                             "else simulated CPU devices), between 2 and 8")
    args = parser.parse_args()
    if not 2 <= args.devices <= 8:
        fail(f"--devices {args.devices}: data parallelism needs between 2 and 8 devices here")
    ui = UI(step_mode=args.step)
    ui.title("Lesson 03: nn.DataParallel")

    # Step 1: Choose the devices
    # DataParallel is for one machine with several GPUs. It refuses CPU tensors in every
    # stage, so without 2+ GPUs we simulate the devices: same algorithm, CPU threads.
    ui.step(1, "Choose the devices")
    device = pick_device(args.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    real = gpus >= 2
    n = args.devices
    if args.device == "cuda" and gpus < 2:
        fail(f"nn.DataParallel needs at least 2 GPUs and this machine has {gpus}; "
             f"use --device cpu to run the simulated version")
    if real and n > gpus:
        fail(f"--devices {n} needs {n} GPUs but {gpus} are visible; use --devices {gpus}")
    if real:
        names = [f"cuda:{i}" for i in range(n)]
        ui.print(f"{gpus} GPUs: training with the real nn.DataParallel on {', '.join(names)}")
    else:
        device = torch.device("cpu")
        names = [f"sim:{i}" for i in range(n)]
        ui.print(f"{'no GPU' if gpus == 0 else 'only 1 GPU'} here: simulating {n} devices "
                 f"({', '.join(names)}) on the CPU,\none thread per replica, with the stages "
                 f"written out by hand. DataParallel's own functions refuse CPU devices:")
        from torch.nn.parallel import gather, replicate, scatter
        probes = [("scatter(x, ['cpu', 'cpu'])", lambda: scatter(torch.ones(4, 2), ["cpu", "cpu"])),
                  ("replicate(model, ['cpu', 'cpu'])",
                   lambda: replicate(nn.Linear(2, 2), ["cpu", "cpu"])),
                  ("gather([cpu, cpu], 'cpu')", lambda: gather([torch.ones(2)] * 2, "cpu"))]
        for text, probe in probes:
            try:
                probe()
                ui.print(escape(f"  {text}: worked"))
            except Exception as exc:
                ui.print(escape(f"  {text} -> {type(exc).__name__}: {exc}"))
        ids = nn.DataParallel(nn.Linear(2, 2)).device_ids
        ui.print(f"  nn.DataParallel(model).device_ids = {ids}: with "
                 f"{'no device' if not ids else 'one device'} its forward just calls the model")
    dev0 = torch.device("cuda", 0) if real else torch.device("cpu")

    # Step 2: Build the model and the data
    # DataParallel wants the original model on device 0: that copy is the one the optimizer
    # updates, and the one every step's replicas are copied from.
    ui.step(2, "Build the model and the data")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = recipe.EpochShuffle(len(data.train), seed=args.seed)
    loader = DataLoader(data.train, batch_size=recipe.GLOBAL_BATCH, sampler=sampler)
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(dev0)
    optimizer = recipe.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"{data.name}: {len(data.train)} training samples; global batch "
             f"{recipe.GLOBAL_BATCH} -> {len(loader)} steps per epoch")
    ui.print(f"MLP with {n_params:,} parameters on {names[0]}; SGD lr={recipe.LR} "
             f"momentum={recipe.MOMENTUM}")
    if real:
        from torch.nn.parallel import gather, parallel_apply, replicate, scatter
        ids = list(range(n))
        stage_fns = (lambda x: scatter(x, ids), lambda m: replicate(m, ids),
                     lambda reps, xs: (parallel_apply(reps, [(c,) for c in xs], None, ids), None),
                     lambda outs: gather(outs, 0))
    else:
        stage_fns = (lambda x: scatter_by_hand(x, n), lambda m: replicate_by_hand(m, n),
                     parallel_apply_by_hand, lambda outs: gather_by_hand(outs, dev0))
    do_scatter, do_replicate, do_apply, do_gather = stage_fns

    # Step 3: Follow one batch through the five stages
    # One forward and backward, stage by stage, printing shapes. Then two checks: the
    # original parameter's gradient is the sum of the replicas' gradients, and it equals
    # the gradient one device computes on the whole batch. No optimizer step here.
    ui.step(3, "Follow one batch through the five stages")
    x, y = next(iter(loader))
    chunks = do_scatter(x)
    n = len(chunks)  # a batch smaller than the device count gives fewer chunks
    ui.print(f"1 scatter    x {tuple(x.shape)} -> " +
             ", ".join(f"{names[i]} {tuple(c.shape)}" for i, c in enumerate(chunks)) +
             f"; labels y {tuple(y.shape)} stay whole, for device 0")
    replicas = do_replicate(model)
    w = [r.fc1.weight for r in replicas]
    ui.print(f"2 replicate  {n_params:,} parameters copied to each of {len(replicas)} devices; "
             f"replica 1's fc1.weight: leaf={w[1].is_leaf}, grad_fn={type(w[1].grad_fn).__name__}")
    contributions = [[] for _ in replicas]
    for i, t in enumerate(w):
        t.register_hook(lambda g, i=i: contributions[i].append(g.to(dev0)))
    outputs, _ = do_apply(replicas, chunks)
    ui.print(f"3 forward    {len(replicas)} threads -> " +
             ", ".join(f"{names[i]} {tuple(o.shape)}" for i, o in enumerate(outputs)))
    out = do_gather(outputs)
    ui.print(f"4 gather     -> {tuple(out.shape)} on {names[0]}")
    loss = F.cross_entropy(out, y.to(dev0))
    ui.print(f"5 loss       cross-entropy over all {out.shape[0]} samples on {names[0]}: "
             f"{loss.item():.4f}")
    loss.backward()
    summed = sum(c[0] for c in contributions)
    single = copy.deepcopy(model)
    single.zero_grad(set_to_none=True)
    F.cross_entropy(single(x.to(dev0)), y.to(dev0)).backward()
    diff_sum = (model.fc1.weight.grad - summed).abs().max().item()
    diff_single = (model.fc1.weight.grad - single.fc1.weight.grad).abs().max().item()
    ui.print(f"  backward   fc1.weight.grad = sum of the {n} replicas' gradients "
             f"(max diff {diff_sum:.1e}); vs one device on the whole batch: max diff {diff_single:.1e}")
    assert diff_sum <= 1e-6 and diff_single <= 1e-6, (diff_sum, diff_single)
    optimizer.zero_grad(set_to_none=True)  # this was a demonstration: start training clean
    del replicas, outputs, out, loss, single, contributions, w

    # Step 4: Train
    # The loop looks like lesson 01's. In the simulated version each stage is a call we
    # time; with GPUs `dp(x)` does scatter, replicate, parallel forward and gather inside.
    ui.step(4, "Train")
    dp = nn.DataParallel(model, device_ids=list(range(n))) if real else None
    if real:
        for i in range(n):
            torch.cuda.reset_peak_memory_stats(i)
    stage_seconds = {stage: [] for stage in STAGES}
    replica_seconds = [[] for _ in range(n)]
    threads = torch.get_num_threads()
    if not real:
        # One core per simulated device: otherwise every replica thread would start its own
        # pool of intra-op threads, and on a small CPU they would fight over the cores.
        torch.set_num_threads(1)
    losses: list[float] = []
    timer = Timer()
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)

    def timed(stage: str, fn, *a):
        start = time.perf_counter()
        result = fn(*a)
        stage_seconds[stage].append(time.perf_counter() - start)
        return result

    with ui.progress(steps, "training") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                if real:
                    out = dp(x)  # x may stay on the CPU: scatter copies each chunk to its GPU
                else:
                    chunks = timed("scatter", scatter_by_hand, x, n)
                    replicas = timed("replicate", replicate_by_hand, model, n)
                    outputs, seconds = timed("parallel forward", parallel_apply_by_hand,
                                             replicas, chunks)
                    for i, sec in enumerate(seconds):
                        replica_seconds[i].append(sec)
                    out = timed("gather", gather_by_hand, outputs, dev0)
                loss = timed("loss", F.cross_entropy, out, y.to(dev0))
                optimizer.zero_grad(set_to_none=True)
                timed("backward", loss.backward)
                timed("optimizer step", optimizer.step)
                losses.append(loss.item())
                bar.advance()
                if len(losses) % log_every == 0:
                    ui.log(epoch + 1, len(losses), steps, loss.item(),
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 5: Measure each device's load
    # Device 0 holds the real parameters, their gradients and the optimizer state; it
    # gathers every output, computes the whole loss, receives the summed gradients and
    # steps the optimizer. The others only run their replica. That is the "parameter
    # server" shape, and it caps how far DataParallel scales.
    ui.step(5, "Measure each device's load")
    # Medians over the training steps: a busy machine adds spikes, the median ignores them.
    per_step = {k: 1000 * statistics.median(v) if v else 0.0 for k, v in stage_seconds.items()}
    load, load_note = [], {}
    if real:
        for i in range(n):
            peak = torch.cuda.max_memory_allocated(i)
            load.append({"device": names[i], "samples_per_step": len(torch.arange(recipe.GLOBAL_BATCH).chunk(n)[i]),
                         "peak_memory_bytes": peak})
        ui.table("peak GPU memory during training (torch.cuda.max_memory_allocated)",
                 ["device", "samples per step", "peak memory"],
                 [[d["device"], d["samples_per_step"], f"{d['peak_memory_bytes'] / 2**20:.2f} MiB"]
                  for d in load])
        ui.print(f"time per step on the host: loss {per_step['loss']:.2f} ms, backward "
                 f"{per_step['backward']:.2f} ms, optimizer step {per_step['optimizer step']:.2f} ms")
    else:
        # Memory: count the bytes of the tensors each simulated device would hold in one
        # step, from the tensors themselves. Saved activations are counted with autograd's
        # saved-tensor hooks, in each replica's own thread (hooks are per thread).
        x, y = next(iter(loader))
        chunks = scatter_by_hand(x, n)
        replicas = replicate_by_hand(model, n)
        saved = [0] * n

        def counting(replica, chunk, i):
            def pack(t):
                saved[i] += t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return replica(chunk)

        outputs, _ = parallel_apply_by_hand(
            [lambda c, r=r, i=i: counting(r, c, i) for i, r in enumerate(replicas)], chunks)
        params = list(model.parameters())
        momentum = [optimizer.state[p]["momentum_buffer"] for p in params]
        for i in range(n):
            own = nbytes([chunks[i], outputs[i]]) + saved[i]
            if i > 0:
                own += nbytes(params)  # replica i's copy of the weights (replica 0 aliases)
            extra = 0
            if i == 0:  # the originals, their summed grads, SGD momentum, the gathered batch
                extra = nbytes(params) * 3 + nbytes([torch.cat(outputs), y])
            load.append({"device": names[i], "samples_per_step": chunks[i].shape[0],
                         "replica_forward_ms": 1000 * statistics.median(replica_seconds[i]),
                         "bytes_replica": own, "bytes_device0_only": extra})
        assert nbytes(momentum) == nbytes(params)
        device0_ms = per_step["gather"] + per_step["loss"] + per_step["optimizer step"]
        ui.table("one step, per simulated device (times: median over the training steps)",
                 ["device", "samples", "replica forward", "device 0 only: gather+loss+step",
                  "tensors held"],
                 [[d["device"], d["samples_per_step"], f"{d['replica_forward_ms']:.3f} ms",
                   f"{device0_ms:.3f} ms" if i == 0 else "-",
                   f"{(d['bytes_replica'] + d['bytes_device0_only']) / 1024:.1f} KiB"]
                  for i, d in enumerate(load)])
        b0 = load[0]["bytes_replica"] + load[0]["bytes_device0_only"]
        ui.print(f"device 0 holds {b0 / 1024:.1f} KiB, the others {load[1]['bytes_replica'] / 1024:.1f} "
                 f"KiB each: {b0 / load[1]['bytes_replica']:.1f}x, because the weights, their gradients "
                 f"and the optimizer state live only there")
        assert b0 > load[1]["bytes_replica"]
        ui.table("where one step's time goes on the host (median per step)",
                 ["stage", "ms", "runs on"],
                 [[s, f"{per_step[s]:.3f}",
                   {"scatter": "host -> every device", "replicate": "device 0 -> every device",
                    "parallel forward": "every device, one thread each",
                    "gather": "every device -> device 0", "loss": "device 0",
                    "backward": "every device; the sum lands on device 0",
                    "optimizer step": "device 0"}[s]] for s in STAGES])
        # Threads or no threads? Time the same replica forwards both ways, alternating,
        # and keep the fastest of each: other programs can only ever add time.
        threaded, one_thread = [], []
        for _ in range(20):  # with autograd recording, as in training
            start = time.perf_counter()
            parallel_apply_by_hand(replicas, chunks)
            threaded.append(time.perf_counter() - start)
            start = time.perf_counter()
            for r, c in zip(replicas, chunks):
                r(c)
            one_thread.append(time.perf_counter() - start)
        threads_ms, one_thread_ms = 1000 * min(threaded), 1000 * min(one_thread)
        ui.print(f"the {n} replica forwards, fastest of 20: in {n} threads {threads_ms:.3f} ms, "
                 f"one after the other in one thread {one_thread_ms:.3f} ms")
        ui.print(f"replicating the model costs {per_step['replicate']:.3f} ms, at every step")
        load_note = {"threads_forward_ms": round(threads_ms, 4),
                     "one_thread_forward_ms": round(one_thread_ms, 4)}

    torch.set_num_threads(threads)

    # Step 6: Compare with lesson 01 and save
    # The loss is computed on the whole gathered batch and the replicas' gradients are
    # summed, so each step computes lesson 01's gradient up to the order of float additions.
    ui.step(6, "Compare with lesson 01 and save")
    final_accuracy = recipe.accuracy(model, data.test, dev0)
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"test accuracy [bold green]{final_accuracy:.1%}[/bold green]")
    state = plain_state_dict(dp if real else model)
    if data.name == "synthetic":
        reference = recipe.train_reference(args.seed, args.epochs, data)
        diff = max_abs_diff(state, reference)
        ui.print(f"max |w_03 - w_01| = {diff:.1e} (lesson 01's loop, same seed and epochs)")
    else:
        diff = None  # the reference on a real data set takes as long as this lesson: skip it
    folder = out_dir("03", args.out)
    samples = args.epochs * len(data.train)
    save_results(folder, state, make_metrics(
        lesson="03", world_size=1, backend="none", device=str(dev0), losses=losses,
        final_accuracy=final_accuracy, wall_seconds=wall, samples=samples,
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
        devices=n, simulated=not real, device_names=names, max_abs_diff_vs_01=diff,
        stage_ms_per_step={k: round(v, 4) for k, v in per_step.items()}, device_load=load,
        **load_note))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} samples/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
