"""Count the collectives a rank calls, the bytes it sends, and how much of it hid behind backward.

One instrument for every Part 2 lesson that asks "how much did we communicate, and when?"
(lesson 14: DDP by hand; 15: ZeRO and FSDP2; 17 and 20 after them):

    from apparatus.comm import CommLog
    log = CommLog()
    with log.recording(), log.watching(model):   # model: the plain module whose grads arrive
        for step in range(steps):
            loss = ...
            with log.backward():                 # marks one backward pass
                loss.backward()
            ...                                  # e.g. wait for the gradients' all-reduces
    print(log.summary(steps))                    # calls, bytes sent, overlap, per step

`log.backwards(param)` marks the backward passes of a loop you cannot edit (exercise 08's
check), as `log.backward()` marks one you can.

Helpers built on it: record_training() runs and records a plain training loop through any
wrapper; compare() does that for several wrappers on fresh models, and table_rows() with
COLUMNS prints them (lesson 14's Step 10); counted_ddp() is torch's DDP, made visible.

How it sees the calls: inside `recording()`, the collective functions of `torch.distributed`
(all_reduce, broadcast, all_gather*, reduce_scatter*, all_to_all_single) are wrapped, so every
call made through the module attribute (`dist.all_reduce(...)`, which is how the lessons,
DDP's Python comm hooks, ZeroRedundancyOptimizer and FSDP2 call them) is logged with its
kind, its bytes and its start time. Its end time is when the work really completed: for
`async_op=True` a callback on the work's future, otherwise when the call returned. On CUDA
a collective's future completes when it is *enqueued* on the GPU stream, not when the GPU
has run it: there the times say when the CPU issued the work, and the overlap is a bound.

torch's DDP does not call `dist.all_reduce`: its C++ reducer talks to the process group
directly. `route_ddp_through_python(ddp_model)` registers PyTorch's own `allreduce_hook`
(divide by N, then `dist.all_reduce`, exactly what the reducer does by default), so its
buckets pass through `dist.all_reduce` and get logged. That is lesson 08's counting comm
hook idea, with the counting moved here, so there is one counter for every strategy.

Bytes each rank sends, counted as lesson 10 counts a ring (S: the bytes of the data, N: the
group's size): all-reduce 2(N-1)/N * S; all-gather (S = the gathered output) and
reduce-scatter (S = the input before scattering) (N-1)/N * S; broadcast and all-to-all
(N-1)/N * S (on average per rank). A world of one sends nothing.

Not seen: functional collectives (torch.distributed._functional_collectives, used by DTensor
and tensor parallelism) and calls made from C++. For those, torch's own
`torch.distributed.tensor.debug.CommDebugMode` counts calls per op: measured on torch 2.14.1
(gloo) it counts `c10d.allreduce_` and `c10d.broadcast_` calls, DDP's reducer included, but
records neither bytes nor times, and it intercepts every tensor op while it is on.
"""
from __future__ import annotations

import inspect
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

# name -> (how to read "S" from the bound arguments, bytes sent per rank as a share of S)
RING = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value)  # a list of tensors


def _group_size(group) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:  # a backend object instead of a ProcessGroup
        return group.size()


@dataclass
class Collective:
    kind: str             # "all_reduce", "all_gather_into_tensor", ...
    data_bytes: int       # S: the tensor reduced, the output gathered, the input scattered
    sent_bytes: float     # what this rank sends, by the ring formulas above
    group_size: int
    start: float          # time.perf_counter() when it was called
    async_op: bool        # False: the caller waited for it to finish
    end: float | None = None  # when it completed (None: not yet)


class CommLog:
    """Everything one rank communicated while recording(); see the module docstring."""

    def __init__(self):
        self.calls: list[Collective] = []
        self.windows: list[list[float]] = []  # per backward: [start, last gradient, end]
        self._inside = threading.local()      # a wrapped collective calling another: count once

    # -- recording -----------------------------------------------------------------------
    @contextmanager
    def recording(self):
        """Log every torch.distributed collective called (through `dist.<name>`) inside."""
        originals = {name: getattr(dist, name) for name in RING if hasattr(dist, name)}
        for name, fn in originals.items():
            setattr(dist, name, self._wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        signature = _signature(fn)
        what, share = RING[name]

        def logged(*args, **kwargs):
            if getattr(self._inside, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            n = _group_size(bound.arguments.get("group"))
            size = _nbytes(bound.arguments[what])
            if name == "all_gather":
                size = _nbytes(bound.arguments["tensor"]) * n
            call = Collective(name, size, share(n) * size, n, time.perf_counter(),
                              bool(bound.arguments.get("async_op", False)))
            self._inside.depth = 1
            try:
                work = fn(*args, **kwargs)
            finally:
                self._inside.depth = 0
            self.calls.append(call)
            if work is None:  # a blocking call: it has completed
                call.end = time.perf_counter()
            else:             # async: the future completes when the data has arrived
                work.get_future().add_done_callback(
                    lambda _: setattr(call, "end", time.perf_counter()))
            return work

        return logged

    # -- backward windows ----------------------------------------------------------------
    @contextmanager
    def watching(self, model: torch.nn.Module):
        """Note when each gradient of `model` is accumulated: the last one ends the compute."""
        def arrived(_param):
            if self.windows:
                self.windows[-1][1] = time.perf_counter()

        handles = [p.register_post_accumulate_grad_hook(arrived)
                   for p in model.parameters() if p.requires_grad]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def backwards(self, first: torch.Tensor):
        """Mark every backward pass as backward() does, in a loop you cannot edit (a learner's):
        one starts when `first` gets its gradient (pick the one backward reaches first, the
        last layer's bias) and ends when autograd has run the whole graph (a final callback),
        after every hook of that backward, DDP's bucket launches included."""
        from torch.autograd import Variable

        def started(_param):
            now = time.perf_counter()
            window = [now, now, now]
            self.windows.append(window)

            def ended():  # an autograd callback: runs once this backward is complete
                window[1] = window[2] = time.perf_counter()
            Variable._execution_engine.queue_callback(ended)

        handle = first.register_post_accumulate_grad_hook(started)
        try:
            yield self
        finally:
            handle.remove()

    @contextmanager
    def backward(self):
        """Mark one backward pass. Its compute ends with the last gradient (under watching())
        or when the block ends; torch's DDP waits for its buckets inside backward()."""
        now = time.perf_counter()
        self.windows.append([now, now, now])
        try:
            yield
        finally:
            window = self.windows[-1]
            window[2] = time.perf_counter()
            if window[1] == window[0]:  # nothing watched: the whole block was compute
                window[1] = window[2]

    # -- results -------------------------------------------------------------------------
    def summary(self, steps: int, kinds: tuple[str, ...] | None = None) -> dict:
        """Per step: calls, bytes of data, bytes this rank sent; over the whole log: how much
        of the time any collective was in flight fell inside a backward's compute."""
        calls = [c for c in self.calls if kinds is None or c.kind in kinds]
        done = [(c.start, c.end) for c in calls if c.end is not None]
        busy = _union(done)
        compute = _union([(w[0], w[1]) for w in self.windows])
        overlap = _intersection(busy, compute)
        in_flight = sum(e - s for s, e in busy)
        # started inside loss.backward() (before it returned), not after it as a plain loop would
        launched_early = sum(1 for c in calls if any(w[0] <= c.start < w[2] for w in self.windows))
        return {
            "calls_per_step": len(calls) / steps,
            "data_bytes_per_step": sum(c.data_bytes for c in calls) / steps,
            "sent_bytes_per_step": sum(c.sent_bytes for c in calls) / steps,
            "launched_during_backward": launched_early / max(1, len(calls)),
            "async_fraction": sum(c.async_op for c in calls) / max(1, len(calls)),
            "comm_seconds_per_step": in_flight / steps,
            "overlapped_fraction": overlap / in_flight if in_flight > 0 else 0.0,
            "exposed_seconds_per_step": (in_flight - overlap) / steps,
            "backward_windows": len(self.windows),
        }


def record_training(wrapped, model, optimizer, batches, loss_fn, finish=None,
                    warmup: int = 1) -> tuple[dict, dict]:
    """Train one step per (x, y) in `batches` (this rank's share) through `wrapped`, recording
    every step after the first `warmup` ones; returns (CommLog.summary, final weights).

    `finish` runs after backward and before optimizer.step() (a hand-written wrapper's
    finish_gradient_synchronization). warmup=1 leaves out the first step: torch's DDP
    all-reduces it as one bucket and builds its real buckets from the order it saw.
    """
    log, steps = CommLog(), 0
    with log.watching(model):
        for i, (x, y) in enumerate(batches):
            recording = log.recording() if i >= warmup else nullcontext()
            with recording:
                loss = loss_fn(wrapped(x), y)
                optimizer.zero_grad(set_to_none=True)
                with log.backward() if i >= warmup else nullcontext():
                    loss.backward()
                if finish is not None:
                    finish()
            optimizer.step()
            steps += i >= warmup
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return log.summary(max(1, steps)), state


def compare(strategies: dict, make_model, make_optimizer, batch, loss_fn, steps,
            warmup: int = 1) -> dict:
    """{name: (summary, final weights)}: for each name -> wrap(model) in `strategies`, a fresh
    make_model() wrapped, trained on batch(0), batch(1), ... by record_training(), for
    `steps` steps (one number for all, or a list: one per strategy, in order)."""
    results = {}
    counts = steps if isinstance(steps, (list, tuple)) else [steps] * len(strategies)
    for (name, wrap), n in zip(strategies.items(), counts):
        model = make_model()
        wrapped = wrap(model)
        results[name] = record_training(
            wrapped, model, make_optimizer(model), (batch(s) for s in range(n)), loss_fn,
            getattr(wrapped, "finish_gradient_synchronization", None), warmup)
        del wrapped  # a DDP reducer holds the process group: free it before the next one
    return results


COLUMNS = ["strategy", "calls", "MiB sent", "started in backward", "in flight ms",
           "of it during backward"]


def table_rows(results: dict) -> list[list[str]]:
    """compare()'s results as rows under COLUMNS, per step (this rank's view)."""
    return [[name, f"{s['calls_per_step']:g}", f"{s['sent_bytes_per_step'] / 2**20:.3f}",
             f"{s['launched_during_backward']:.0%}", f"{s['comm_seconds_per_step'] * 1e3:.1f}",
             f"{s['overlapped_fraction']:.0%}"] for name, (s, _) in results.items()]


def counted_ddp(model: torch.nn.Module, **ddp_kwargs):
    """torch's DistributedDataParallel around `model` (on its GPU, if it is on one), with its
    buckets routed through dist.all_reduce so that CommLog sees them (lesson 08's counter, and
    bench/measure.py's)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = next(model.parameters()).device
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    route_ddp_through_python(ddp)
    return ddp


def route_ddp_through_python(ddp_model) -> None:
    """Make torch's DDP all-reduce its buckets with `dist.all_reduce`, where CommLog sees them.

    PyTorch's own allreduce_hook divides each bucket by the world size and calls
    dist.all_reduce(async_op=True): the same arithmetic as the reducer's built-in path.
    Register it before the first backward (DDP refuses a hook after that).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    # its state is the group to all-reduce over: DDP's own (the default group, unless DDP
    # was given a process_group)
    ddp_model.register_comm_hook(ddp_model.process_group, allreduce_hook)


_SIGNATURES: dict = {}


def _signature(fn) -> inspect.Signature:
    """inspect.signature, once per function: recording() may start and stop every step."""
    if fn not in _SIGNATURES:
        _SIGNATURES[fn] = inspect.signature(fn)
    return _SIGNATURES[fn]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted lists of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
