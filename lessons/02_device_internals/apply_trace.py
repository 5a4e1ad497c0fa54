"""Watch `nn.Module._apply` at work: every module it enters, every tensor it converts.

Lesson 02 (lessons/02_device_internals.py) opens up `model.to(device)`. This is its
instrument: `trace_apply(model)` records, for the length of a `with` block, each module the
real `_apply` recursion enters and each tensor handed to the conversion function, by name,
with its dtype and device before and after. It records and never changes what `_apply` does.

Doc: docs/02_device_internals.md (Step 2).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {t.device}"


@contextmanager
def trace_apply(model: nn.Module):
    """Record what the real `Module._apply` does, without changing what it does.

    For the length of the `with` block, `nn.Module._apply` is replaced by a wrapper that
    notes "entering module M", then calls the original. The conversion function `fn` is
    wrapped once (at the top call) so every tensor it is applied to is noted, by name.
    The recursion itself is PyTorch's: the original `_apply` calls `child._apply(fn)`,
    which is our wrapper again, so we see each level.
    """
    module_names = {m: name or type(m).__name__ for name, m in model.named_modules()}
    tensor_names: dict[int, tuple[str, str]] = {}
    keep_alive = []  # holding the originals keeps their id()s unique while we trace
    for name, p in model.named_parameters():
        tensor_names[id(p)] = (name, "parameter")
        keep_alive.append(p)
        if p.grad is not None:
            tensor_names[id(p.grad)] = (name + ".grad", "gradient")
            keep_alive.append(p.grad)
    for name, b in model.named_buffers():
        tensor_names[id(b)] = (name, "buffer")
        keep_alive.append(b)

    events: list[dict] = []
    depth = 0
    original_apply = nn.Module._apply

    def traced_apply(self, fn, recurse=True):
        nonlocal depth
        events.append({"event": "module", "depth": depth,
                       "name": module_names.get(self, "?"), "type": type(self).__name__})
        if not getattr(fn, "_traced", False):  # wrap fn once; children get the wrapped one
            inner = fn

            def fn(t):
                out = inner(t)
                name, kind = tensor_names.get(id(t), ("?", "?"))
                events.append({"event": "tensor", "depth": depth, "name": name,
                               "kind": kind, "before": describe(t), "after": describe(out)})
                return out

            fn._traced = True
        depth += 1
        try:
            return original_apply(self, fn, recurse)
        finally:
            depth -= 1

    nn.Module._apply = traced_apply
    try:
        yield events
    finally:
        nn.Module._apply = original_apply  # never leave the class patched
