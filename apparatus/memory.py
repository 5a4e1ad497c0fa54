"""Counting training memory: the instruments behind lesson 13's tables (lessons 15+ reuse them).

* state_bytes(model, optimizer): bytes of parameters, gradients and optimizer state, read
  from the tensors themselves (DTensor shards count their local part only).
* formula_bytes(n): what the textbook formula says for n parameters.
* SavedTensors: a context manager around a forward pass that records every tensor autograd
  saves for backward (torch.autograd.graph.saved_tensors_hooks), each storage once, without
  the parameters themselves: that is what "activation memory" means.
* StepPeak: torch's MemTracker (FSDPMemTracker for an FSDP2 model) around one training
  step, and report_peak: that step's peak beside what the process holds at rest, every
  rank's (lessons 13, 14 and 16; lesson 15's StepRecorder does the same beside its CommLog).
* seconds(fn): the median wall time of a few calls of fn.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state"} in bytes, as this process holds them.

    optimizer_state counts the per-parameter tensors (AdamW's exp_avg and exp_avg_sq); the
    one-number `step` counters (4 bytes per parameter tensor) are left out, as the formula does.
    """
    params = list(model.parameters())
    state = [t for p in params for t in optimizer.state.get(p, {}).values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": sum(_nbytes(p) for p in params),
            "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_state": sum(_nbytes(t) for t in state)}


def formula_bytes(n: int, mixed: bool = False) -> dict[str, int]:
    """fp32 AdamW: 4 + 4 + 8 bytes per parameter. Mixed precision, as the ZeRO paper counts
    it: 2 (bf16/fp16 weights) + 2 (their gradients) + 12 (fp32 master weights, exp_avg,
    exp_avg_sq)."""
    per = (2, 2, 12) if mixed else (4, 4, 8)
    return dict(zip(("parameters", "gradients", "optimizer_state"), (x * n for x in per)))


class SavedTensors:
    """with SavedTensors(model) as saved: loss = ...  ->  saved.bytes, saved.weight_copy_bytes

    Every tensor autograd keeps for backward passes through pack_hook. A tensor saved by
    several operations (x feeds q, k and v) is one storage in memory, so each storage is
    counted once. The parameters' own storages are not activations and are skipped; copies
    of the weights made inside the forward pass (autocast's bf16 weights) are reported
    apart, in weight_copy_bytes, recognised by a parameter's shape (or its transpose).
    """

    def __init__(self, model: torch.nn.Module):
        params = list(model.parameters())
        self._skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self._shapes = {tuple(p.shape) for p in params} | {tuple(p.shape[::-1]) for p in params}
        self._seen: dict[int, tuple[int, bool]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self._skip:
            # a weight copy is floating point: an int64 index of a bias's shape is an activation
            is_copy = t.is_floating_point() and t.dtype != torch.float32 and tuple(t.shape) in self._shapes
            self._seen[storage.data_ptr()] = (storage.nbytes(), is_copy)
        return t

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        """Activations: saved bytes that are not (copies of) weights."""
        return sum(n for n, copy in self._seen.values() if not copy)

    @property
    def weight_copy_bytes(self) -> int:
        return sum(n for n, copy in self._seen.values() if copy)


class StepPeak:
    """peak = StepPeak(model, optimizer, step); for s in steps: peak.at(s); ...; peak.stop()
    ->  peak.bytes, peak.breakdown  (or `with StepPeak(...) as peak:`, which stops at its end)

    torch's MemTracker (torch/distributed/_tools/mem_tracker.py) is a TorchDispatchMode: it
    sees every tensor an op makes and frees, and keeps the highest total it saw. It follows
    training step `step` (0-based), from at(step) to the next at() or stop(): forward,
    backward and the optimizer step. It slows every op it watches, so one step only.
    What exists before the step (the weights, last step's gradients, AdamW's state) is
    registered first. An FSDP2 model gets FSDPMemTracker, which registers its own sharded
    state and also sees the all-gather and reduce-scatter buffers.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int):
        self.model, self.step = model, step
        self.optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO-1's: the inner one holds the state
        self.stack, self.tracker = contextlib.ExitStack(), None

    def at(self, step: int) -> None:
        """Stop following the previous step; follow this one if it is the chosen one."""
        self.stack.close()
        if step != self.step:
            return
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker

        if hasattr(self.model, "reshard"):  # an FSDPModule: it registers its own state
            self.tracker = FSDPMemTracker(self.model, self.optimizer)
        else:
            self.tracker = MemTracker()
            self.tracker.track_external(self.model, self.optimizer)
        self.stack.enter_context(self.tracker)

    def stop(self) -> None:
        """Stop following (after the loop: the followed step is usually the last)."""
        self.stack.close()

    def another_forward(self) -> None:
        """Before each forward after the first in the followed step (micro-batches): MemTracker
        refuses a second forward of the root in one session unless its per-module stats are
        reset (torch 2.14.1, mem_tracker.py: reset_mod_stats). The peak so far stays."""
        if self.tracker is not None:
            self.tracker.reset_mod_stats()

    def __enter__(self) -> "StepPeak":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes by kind at the peak ("PARAM", "GRAD", "OPT", "ACT", "TEMP", ..., "Total"), each
        device's peak added up (CPU and GPU: a CPU-offloaded model)."""
        out: dict[str, int] = {}
        for snap in self.tracker.get_tracker_snapshot("peak").values():
            for kind, n in snap.items():
                name = str(kind).split(".")[-1]
                out[name] = out.get(name, 0) + n
        return out

    @property
    def per_device(self) -> dict[str, int]:
        """{device: bytes at its peak in the followed step}."""
        return {str(device): snap["Total"] for device, snap in self.tracker.get_tracker_snapshot("peak").items()}

    @property
    def bytes(self) -> int:
        return self.breakdown["Total"]


def report_peak(ui, peak: StepPeak, at_rest: int) -> dict:
    """The peak of the followed step beside `at_rest` (what the process holds between steps):
    one line in a world of one; under torch.distributed, every rank's, gathered to rank 0
    (a collective: every rank calls it), one table row each. The metrics.json keys."""
    mine = (peak.bytes, at_rest, peak.breakdown.get("ACT", 0))
    out = {"peak_memory_bytes": mine[0], "peak_memory_step": peak.step + 1,
           "peak_memory_breakdown": peak.breakdown, "at_rest_bytes": at_rest}
    if not (dist.is_available() and dist.is_initialized()):
        ui.print(f"peak of training step {peak.step + 1} (torch's MemTracker): {mine[0]:,} bytes, "
                 f"{mine[0] / at_rest:.1f}x the {at_rest:,} held at rest; {mine[2]:,} of it activations")
        return out
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ui.table(f"Peak of training step {peak.step + 1}, per rank (torch's {type(peak.tracker).__name__})",
             ["rank", "held at rest", "peak in the step", "peak / at rest", "of it: activations"],
             [[r, f"{rest:,}", f"{top:,}", f"{top / rest:.1f}x", f"{act:,}"]
              for r, (top, rest, act) in enumerate(everyone)])
    return {**out, "peak_memory_bytes_all": [e[0] for e in everyone],
            "at_rest_bytes_all": [e[1] for e in everyone]}


def seconds(fn, repeats: int = 5) -> float:
    """Median wall-clock seconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # GPU work is queued: wait for it before reading the clock
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"
