"""Each device's load under DataParallel: time per stage, bytes held, threads or no threads.

Lesson 03's Step 5 (lessons/03_data_parallel.py) calls `measure_load` after training. It
trains a *copy* of the model (and of its optimizer's state) for `steps` more steps on one
batch, stage by stage, so the lesson's own weights are untouched:

* every stage is timed; the table shows the median per step (a busy machine adds spikes,
  the median ignores them);
* with GPUs: each GPU's `torch.cuda.max_memory_allocated` during those steps;
* simulated: the bytes of the tensors each device would hold in one step (its input chunk,
  its replica's weights, its output, the activations autograd saves for backward, counted
  with saved_tensors_hooks in each replica's own thread), plus device 0's extras (the
  original weights, their summed gradients, SGD's momentum, the gathered batch); and the
  replicas' forwards timed in threads and in one thread (fastest of 20 each).

Returns the metrics.json fields: stage_ms_per_step, device_load, and (simulated)
threads_forward_ms, one_thread_forward_ms. Doc: docs/03_data_parallel.md, Step 5.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from simulated_dp import (SimulatedDataParallel, parallel_apply_by_hand, replicate_by_hand,
                                    scatter_by_hand, stages)
from common import recipe

STAGES = ["scatter", "replicate", "parallel forward", "gather", "loss", "backward", "optimizer step"]
RUNS_ON = {"scatter": "host -> every device", "replicate": "device 0 -> every device",
           "parallel forward": "every device, one thread each", "gather": "every device -> device 0",
           "loss": "device 0", "backward": "every device; the sum lands on device 0",
           "optimizer step": "device 0"}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_load(dp, optimizer, batch, names, ui, steps: int = 20) -> dict:
    """Train a copy of dp.module (and optimizer) `steps` steps on `batch`, stage by stage."""
    n, real = len(names), not isinstance(dp, SimulatedDataParallel)
    model = copy.deepcopy(dp.module)
    dev0 = next(model.parameters()).device
    stage = stages(dp)
    state = optimizer.state_dict()
    optimizer = recipe.make_optimizer(model)
    optimizer.load_state_dict(state)
    x, y = batch
    if real:
        for i in range(n):
            torch.cuda.reset_peak_memory_stats(i)
    seconds = {s: [] for s in STAGES}
    replica_seconds = [[] for _ in range(n)]

    def timed(stage, fn, *args):
        if real:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args)
        if real:
            torch.cuda.synchronize()
        seconds[stage].append(time.perf_counter() - start)
        return result

    for _ in range(steps):
        chunks = timed("scatter", stage.scatter, x)
        replicas = timed("replicate", stage.replicate, model)
        if real:
            outputs = timed("parallel forward", stage.parallel_apply, replicas, chunks)
        else:
            outputs, each = timed("parallel forward", parallel_apply_by_hand, replicas, chunks)
            for i, sec in enumerate(each):
                replica_seconds[i].append(sec)
        out = timed("gather", stage.gather, outputs)
        loss = timed("loss", F.cross_entropy, out, y.to(dev0))
        optimizer.zero_grad(set_to_none=True)
        timed("backward", loss.backward)
        timed("optimizer step", optimizer.step)
    per_step = {k: 1000 * statistics.median(v) for k, v in seconds.items()}
    result = {"stage_ms_per_step": {k: round(v, 4) for k, v in per_step.items()}}
    if real:
        load = [{"device": names[i], "samples_per_step": len(torch.arange(len(x)).chunk(n)[i]),
                 "peak_memory_bytes": torch.cuda.max_memory_allocated(i)} for i in range(n)]
        ui.table(f"peak GPU memory over {steps} steps (torch.cuda.max_memory_allocated)",
                 ["device", "samples per step", "peak memory"],
                 [[d["device"], d["samples_per_step"], f"{d['peak_memory_bytes'] / 2**20:.2f} MiB"]
                  for d in load])
        ui.print(f"time per step on the host: loss {per_step['loss']:.2f} ms, backward "
                 f"{per_step['backward']:.2f} ms, optimizer step {per_step['optimizer step']:.2f} ms")
        return result | {"device_load": load}

    # Bytes each simulated device holds in one step, from the tensors themselves.
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
    assert nbytes(optimizer.state[p]["momentum_buffer"] for p in params) == nbytes(params)
    load = []
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
    device0_ms = per_step["gather"] + per_step["loss"] + per_step["optimizer step"]
    ui.table(f"one step, per simulated device (times: median over {steps} steps)",
             ["device", "samples", "replica forward", "device 0 only: gather+loss+step", "tensors held"],
             [[d["device"], d["samples_per_step"], f"{d['replica_forward_ms']:.3f} ms",
               f"{device0_ms:.3f} ms" if i == 0 else "-",
               f"{(d['bytes_replica'] + d['bytes_device0_only']) / 1024:.1f} KiB"]
              for i, d in enumerate(load)])
    b0 = load[0]["bytes_replica"] + load[0]["bytes_device0_only"]
    ui.print(f"device 0 holds {b0 / 1024:.1f} KiB, the others {load[1]['bytes_replica'] / 1024:.1f} "
             f"KiB each: {b0 / load[1]['bytes_replica']:.1f}x, because the weights, their gradients "
             f"and the optimizer state live only there")
    ui.table("where one step's time goes on the host (median per step)", ["stage", "ms", "runs on"],
             [[s, f"{per_step[s]:.3f}", RUNS_ON[s]] for s in STAGES])
    # Threads or no threads? The same replica forwards both ways, alternating, fastest of
    # each: other programs can only ever add time.
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
    return result | {"device_load": load, "threads_forward_ms": round(threads_ms, 4),
                     "one_thread_forward_ms": round(one_thread_ms, 4)}
