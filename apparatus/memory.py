"""Counting training memory: the instruments behind lesson 13's tables (lessons 15+ reuse them).

* state_bytes(model, optimizer): bytes of parameters, gradients and optimizer state, read
  from the tensors themselves (DTensor shards count their local part only).
* formula_bytes(n): what the textbook formula says for n parameters.
* SavedTensors: a context manager around a forward pass that records every tensor autograd
  saves for backward (torch.autograd.graph.saved_tensors_hooks), each storage once, without
  the parameters themselves: that is what "activation memory" means.
* seconds(fn): the median wall time of a few calls of fn.
"""
from __future__ import annotations

import statistics
import time

import torch


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
            is_copy = t.dtype != torch.float32 and tuple(t.shape) in self._shapes
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
