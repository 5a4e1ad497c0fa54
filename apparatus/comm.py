"""Count the collectives a rank calls, the bytes it sends, and how much of it hid behind backward.

The package's one collective counter: every lesson, check and benchmark that asks "how much
did we communicate, and when?" uses it (lesson 08: DDP's buckets; 14: DDP by hand; 15: ZeRO
and FSDP2; 17: tensor parallel; 19: the 2-D mesh; bench/):

    from apparatus.comm import CommLog
    log = CommLog()
    with log.recording(), log.watching(model):   # model: the plain module whose grads arrive
        for step in range(steps):
            loss = ...
            with log.backward():                 # marks one backward pass
                loss.backward()
            ...                                  # e.g. wait for the gradients' all-reduces
    print(log.summary(steps))                    # calls, bytes sent, overlap, per step
    print(log.tally(lambda c: c.phase, steps))   # calls and bytes per forward/backward/optimizer

Each call is a Collective: its kind, the bytes of its data S and the bytes this rank sends
(OPS and SHARE below: the one table), its process group (name and size: lesson 19 tells the
mesh dimensions apart by it), the phase it ran in (forward, backward, optimizer or between),
when it started and ended, and, with CommLog(modules=True), the modules that were running
(lesson 17 puts each collective in its block).

How it sees the calls: recording() is a TorchDispatchMode, which sees every op that reaches
PyTorch's dispatcher. Every torch.distributed collective does: a `dist.all_reduce(...)` (or
DDP's C++ reducer, or FSDP2) becomes the op c10d.allreduce_, DTensor's collectives are the
functional ops _c10d_functional.all_reduce and friends. (What gloo or NCCL send inside one
collective, its ring's messages, stays in C++: we count by lesson 10's formulas.) One catch, found in torch's own CommDebugMode
(torch/distributed/tensor/debug/_comm_mode.py), which we imitate: a mode runs *before* a
tensor subclass. If it runs a DTensor op itself, DTensor's own dispatch then runs with the mode
switched off, and the collectives DTensor issues inside (a Partial gradient summed each time
AdamW's step reads it: lesson 17's sequence parallel) are never seen. So, for an op on
a DTensor, the mode returns NotImplemented: DTensor runs, and the plain ops it issues, its
collectives among them, come back through the mode and are counted.

Phase: backward while autograd runs a graph (torch._C._current_graph_task_id(), as
ModTracker and CommDebugMode ask), optimizer inside any Optimizer.step (global step hooks),
forward inside any module's forward (global module hooks), between otherwise (lesson 17's
by-hand sum of the sequence-parallel gradients).

Times: start is when the op was called; end, when its Work completed (a callback on the work's
future), for blocking and async_op=True calls alike (the op's async_op argument says which).
On CUDA a collective's future completes when it is *enqueued* on the GPU stream, not when the
GPU has run it: there the times say when the CPU issued the work, and the overlap is a bound.
A functional collective (DTensor's) has no Work to watch: its end stays None and it counts
for calls and bytes, not for time in flight.

Bytes each rank sends, counted as lesson 10 counts a ring (S: the bytes of the data, N: the
group's size): all-reduce 2(N-1)/N * S; all-gather (S = the gathered output) and
reduce-scatter (S = the input before scattering) (N-1)/N * S; broadcast and all-to-all
(N-1)/N * S (on average per rank); a point-to-point send S, a receive nothing (its S is what
arrived). A world of one sends nothing. Not counted: barrier, gather, scatter and reduce.

`log.backwards(param)` marks the backward passes of a loop you cannot edit (exercise 08's
check), as `log.backward()` marks one you can.

Helpers built on it: record_training() runs and records a plain training loop through any
wrapper; compare() does that for several wrappers on fresh models, and table_rows() with
COLUMNS prints them (lesson 14's Step 6); counted_ddp() is torch's DDP with its buckets
through PyTorch's own allreduce_hook (lesson 08's comm hook idea).

The cost: while recording, every tensor op passes through Python (tens of microseconds each
on a busy 2-core machine, for any TorchDispatchMode, CommDebugMode too): a recorded loop of
the Part 2 transformer (about 700 ops a step) runs noticeably slower than a plain one, so
read the throughput of a recorded loop as a lower bound.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value)  # a list (of lists) of tensors


# The formulas: kind -> the share of S one rank sends, for a group of n ranks
SHARE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,   # S: what arrived
}

_S0, _S1 = (lambda a: _nbytes(a[0])), (lambda a: _nbytes(a[1]))  # S: the first / second argument
# The operations: dispatcher op -> (kind, S read from its arguments). c10d.*: torch.distributed's
# calls (dist.all_reduce, DDP's reducer, FSDP2); _c10d_functional.*: DTensor's and funcol's.
OPS = {
    "c10d.allreduce_": ("all_reduce", _S0),
    "c10d.allreduce_coalesced_": ("all_reduce", _S0),
    "c10d.broadcast_": ("broadcast", _S0),
    "c10d._allgather_base_": ("all_gather", _S0),               # S: the output
    "c10d.allgather_": ("all_gather", _S0),                     # a list of outputs
    "c10d.allgather_coalesced_": ("all_gather", _S0),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", _S0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", _S1),      # S: the input
    "c10d.reduce_scatter_": ("reduce_scatter", _S1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", _S1),
    "c10d.alltoall_base_": ("all_to_all", _S1),
    "c10d.alltoall_": ("all_to_all", _S1),
    "c10d.send": ("send", _S0),
    "c10d.recv_": ("recv", _S0),
    "c10d.recv_any_source_": ("recv", _S0),
    "_c10d_functional.all_reduce": ("all_reduce", _S0),
    "_c10d_functional.all_reduce_": ("all_reduce", _S0),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", _S0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),  # input x N
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", _S0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", _S0),
    "_c10d_functional.all_to_all_single": ("all_to_all", _S0),
    "_c10d_functional.broadcast": ("broadcast", _S0),
    "_c10d_functional.broadcast_": ("broadcast", _S0),
    "_c10d_functional_autograd.all_to_all_single": ("all_to_all", _S0),
    "_dtensor.shard_dim_alltoall": ("all_to_all", _S0),
}

# torch.distributed's functions -> (kind, share): what each becomes in the table above
RING = {name: (kind, SHARE[kind]) for name, kind in {
    "all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter", "all_to_all_single": "all_to_all",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}.items()}


def _group(op: str, args) -> tuple[str, int]:
    """(name, size) of the process group a collective op runs on."""
    if not op.startswith("c10d."):  # functional: its group's name is the last argument
        name = args[-1] if isinstance(args[-1], str) else args[-1].group_name
        return name, dist.distributed_c10d._resolve_process_group(name).size()
    for a in args:  # c10d: the ProcessGroup, boxed
        if isinstance(a, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(a)
            except Exception:  # a ReduceOp, not a group
                continue
            return group.group_name, group.size()
    return "", 1


def _argument(func, args, kwargs, name: str, default):
    """The value of argument `name` of a dispatcher op's call: torch leaves out trailing
    arguments equal to their defaults, so the schema supplies what is missing."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) else (a.default_value if a.has_default_value() else default)
    return default  # no such argument: a functional collective (waited for later), a send


@dataclass
class Collective:
    kind: str             # "all_reduce", "all_gather", "reduce_scatter", "broadcast", ...
    data_bytes: int       # S: the tensor reduced, the output gathered, the input scattered
    sent_bytes: float     # what this rank sends, by SHARE
    group_size: int
    start: float          # time.perf_counter() when it was called
    async_op: bool        # False: the caller waited for it to finish
    end: float | None = None  # when it completed (None: not yet, or a functional collective)
    op: str = ""          # the dispatcher op, e.g. "c10d.allreduce_", "_c10d_functional.all_reduce"
    group: str = ""       # the process group's name (DeviceMesh: one per dimension)
    phase: str = ""       # "forward", "backward", "optimizer" or "between"
    modules: tuple = ()   # with CommLog(modules=True): the modules running, e.g. "Transformer.blocks.1"


class _Mode(TorchDispatchMode):
    """The dispatch mode recording() enters: every op passes here; collectives are logged."""

    supports_higher_order_operators = True

    def __init__(self, log: "CommLog"):
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.log, self.dtensor = log, DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, self.dtensor) for t in types):
            return NotImplemented  # DTensor first; its own collectives come back here
        op = str(func._overloadpacket)
        if op not in OPS:
            return func(*args, **kwargs)
        kind, data = OPS[op]
        name, n = _group(op, args)
        size = data(args)
        log = self.log
        async_op = _argument(func, args, kwargs, "async_op", default=True)
        call = Collective(kind, size, SHARE[kind](n) * size, n, time.perf_counter(),
                          bool(async_op), op=op, group=name,
                          phase=log._phase(), modules=log._modules())
        out = func(*args, **kwargs)
        log.calls.append(call)
        work = next((o for o in (out if isinstance(out, (tuple, list)) else (out,))
                     if isinstance(o, torch.ScriptObject)), None)
        if work is not None:  # the future completes when the data has arrived
            try:
                dist.distributed_c10d.Work.unbox(work).get_future().add_done_callback(
                    lambda _: setattr(call, "end", time.perf_counter()))
            except RuntimeError:  # gloo's reduce-scatter: no future; it ran as we called it
                call.end = time.perf_counter()
        return out


class CommLog:
    """Everything one rank communicated while recording(); see the module docstring."""

    def __init__(self, modules: bool = False):
        self.calls: list[Collective] = []
        self.windows: list[list[float]] = []  # per backward: [start, last gradient, end]
        self.track_modules = modules
        self._tracker = None
        self._depth = {"forward": 0, "optimizer": 0}

    # -- recording -----------------------------------------------------------------------
    @contextmanager
    def recording(self):
        """Log every collective called inside: see the module docstring."""
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        def enter(what):
            return lambda *_: self._depth.__setitem__(what, self._depth[what] + 1)

        def leave(what):
            return lambda *_: self._depth.__setitem__(what, max(0, self._depth[what] - 1))

        handles = [nn_module.register_module_forward_pre_hook(enter("forward")),
                   nn_module.register_module_forward_hook(leave("forward"), always_call=True),
                   optim.register_optimizer_step_pre_hook(enter("optimizer")),
                   optim.register_optimizer_step_post_hook(leave("optimizer"))]
        self._tracker = ModTracker() if self.track_modules else None
        try:
            with self._tracker or nullcontext(), _Mode(self):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._tracker, self._depth = None, {"forward": 0, "optimizer": 0}

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"  # autograd is running a graph (recomputed forwards included)
        if self._depth["optimizer"]:
            return "optimizer"
        return "forward" if self._depth["forward"] else "between"

    def _modules(self) -> tuple:
        if self._tracker is None:
            return ()
        return tuple(sorted(p for p in self._tracker.parents if p != "Global"))

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


    def tally(self, key, steps: int = 1, calls: list[Collective] | None = None) -> dict:
        """Calls grouped by key(call), e.g. lambda c: c.phase: {key: {"calls": n, <kind>: n,
        "data_bytes": S, "sent_bytes": sent}}, divided by `steps` (the steps the log holds)."""
        out: dict = {}
        for c in self.calls if calls is None else calls:
            d = out.setdefault(key(c), {"calls": 0, "data_bytes": 0, "sent_bytes": 0.0})
            d["calls"] += 1
            d[c.kind] = d.get(c.kind, 0) + 1
            d["data_bytes"] += c.data_bytes
            d["sent_bytes"] += c.sent_bytes
        return {k: {name: v if steps == 1 else v / steps for name, v in d.items()}
                for k, d in out.items()}

def record_training(wrapped, model, optimizer, batches, loss_fn, finish=None,
                    warmup: int = 1, log: "CommLog | None" = None) -> tuple[dict, dict]:
    """Train one step per (x, y) in `batches` (this rank's share) through `wrapped`, recording
    the gradients' collectives (backward, then `finish`) of every step after the first `warmup`
    ones; returns (CommLog.summary, final weights).

    `finish` runs after backward and before optimizer.step() (a hand-written wrapper's
    finish_gradient_synchronization). warmup=1 leaves out the first step: torch's DDP
    all-reduces it as one bucket and builds its real buckets from the order it saw. The
    forward is not recorded: there torch's DDP broadcasts its rebuilt bucket layout once (two
    small broadcasts in its second forward, measured on torch 2.14.1), which is no gradient.
    `log`: a CommLog already watching(model), as compare() makes one; otherwise a new one.
    """
    steps, watched = 0, log is not None
    log = log or CommLog()
    with nullcontext() if watched else log.watching(model):
        for i, (x, y) in enumerate(batches):
            loss = loss_fn(wrapped(x), y)
            optimizer.zero_grad(set_to_none=True)
            with log.recording() if i >= warmup else nullcontext():
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
        model, log = make_model(), CommLog()
        # Watch before wrapping: a parameter's hooks run in the order they were registered, so
        # the log notes each gradient's arrival before the wrapper's hook launches its
        # all-reduce. The other way round, the last launch's own time counted as backward.
        with log.watching(model):
            wrapped = wrap(model)
            results[name] = record_training(
                wrapped, model, make_optimizer(model), (batch(s) for s in range(n)), loss_fn,
                getattr(wrapped, "finish_gradient_synchronization", None), warmup, log)
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
    """torch's DistributedDataParallel around `model` (on its GPU, if it is on one), its
    buckets all-reduced through PyTorch's own allreduce_hook (lesson 08's comm hook idea;
    lesson 08 and bench/measure.py count them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = next(model.parameters()).device
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    route_ddp_through_python(ddp)
    return ddp


def route_ddp_through_python(ddp_model) -> None:
    """Make torch's DDP all-reduce its buckets with `dist.all_reduce`, from Python.

    PyTorch's own allreduce_hook divides each bucket by the world size and calls
    dist.all_reduce(async_op=True): the same arithmetic as the reducer's built-in path.
    Register it before the first backward (DDP refuses a hook after that). CommLog sees DDP's
    all-reduces with or without it (the C++ reducer's calls pass the dispatcher too, measured
    on gloo); what it adds is a Python frame where a learner can put a breakpoint or a print.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    # its state is the group to all-reduce over: DDP's own (the default group, unless DDP
    # was given a process_group)
    ddp_model.register_comm_hook(ddp_model.process_group, allreduce_hook)


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
