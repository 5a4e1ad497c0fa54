"""Load a state_dict into a model, whatever wrappers either side was saved or built with.

Lesson 09 shows the problem by hand first: a wrapper puts its own name in front of every
key of the model inside it (DataParallel and DDP keep the model in `.module`, so its keys
start with `module.`; torch.compile keeps it in `._orig_mod`, so `_orig_mod.`), and
wrappers nest: DDP(torch.compile(model)) saves `module._orig_mod.fc1.weight`.

`load_into(model, source)` undoes both sides: it unwraps the target to the model inside,
strips wrapper prefixes from the checkpoint's keys (only as *prefixes*, and only while
every key has the same one), and loads strictly. Anything that does not fit is a
`CheckpointError` whose one-line message lists the missing and the unexpected keys.
"""
from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.nn as nn

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP, torch.compile


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into the model; the message says why in one line."""

    def __init__(self, message: str, missing: list[str] | None = None,
                 unexpected: list[str] | None = None):
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []


def is_compiled(model: nn.Module) -> bool:
    """True for the OptimizedModule that torch.compile(model) returns."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet: no need to import dynamo
        return False
    from torch._dynamo.eval_frame import OptimizedModule
    return isinstance(model, OptimizedModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside any DataParallel / DDP / torch.compile wrappers, however nested."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod
        else:
            return model


def common_wrapper_prefix(keys) -> str | None:
    """The wrapper prefix (`module.` or `_orig_mod.`) that *every* key starts with, if any."""
    keys = list(keys)
    for prefix in WRAPPER_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys):
            return prefix
    return None


def strip_layers(state_dict: Mapping) -> list[tuple[dict, str]]:
    """Every version of the keys, one wrapper layer fewer each: [(state, stripped), ...].

    Only the *start* of a key is touched: `module.encoder.submodule.weight` becomes
    `encoder.submodule.weight`, never `encoder.subweight` as `k.replace("module.", "")`
    would make it. A layer is stripped only when every key has it, because a wrapper
    prefixes every key of the model it wraps.
    """
    state, stripped = _with_metadata(state_dict, dict(state_dict)), ""
    versions = [(state, stripped)]
    while (prefix := common_wrapper_prefix(state)) is not None:
        state = _with_metadata(state, {k[len(prefix):]: v for k, v in state.items()}, prefix)
        stripped += prefix
        versions.append((state, stripped))
    return versions


def _with_metadata(old: Mapping, new: dict, prefix: str = "") -> OrderedDict:
    """`new` as an OrderedDict that keeps `old._metadata`, its keys stripped of `prefix`.

    state_dict() attaches `_metadata` (each module's version number, which some modules
    such as BatchNorm read when loading); torch.save keeps it, and so do we.
    """
    out = OrderedDict(new)
    meta = getattr(old, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            ("" if k == prefix[:-1] else k[len(prefix):], v) for k, v in meta.items()
            if not prefix or k == prefix[:-1] or k.startswith(prefix))
    return out


def strip_wrapper_prefixes(state_dict: Mapping) -> dict:
    """The state_dict with every wrapper layer stripped (e.g. `module._orig_mod.` -> ``)."""
    return strip_layers(state_dict)[-1][0]


def read_state_dict(path, map_location="cpu") -> Mapping:
    """torch.load(path, weights_only=True, map_location=...), with one-line errors."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: the file does not exist")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder, not a checkpoint file")
    try:
        # weights_only=True: unpickle tensors and plain containers only, never run code
        # from the file (the default since torch 2.6; we say it anyway).
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
        text = str(exc)
        if "Weights only load failed" in text:
            why = next((line.strip() for line in text.splitlines()
                        if "WeightsUnpickler error" in line), text.splitlines()[0])
            raise CheckpointError(f"{path} holds Python objects that weights_only=True refuses "
                                  f"to unpickle ({why[:200]}); save only tensors and plain "
                                  f"types (a state_dict), or allow the class with "
                                  f"torch.serialization.add_safe_globals if you trust the file"
                                  ) from exc
        first = text.splitlines()[0][:160] if text.strip() else "no details"
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                              f"({type(exc).__name__}: {first}); it may be truncated or not "
                              f"written by torch.save") from exc


def _listed(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_into(model: nn.Module, source, map_location="cpu") -> str:
    """Load `source` into `model` strictly; returns the wrapper prefix that was stripped.

    model:  a plain model, or one wrapped in DataParallel / DDP / torch.compile (nested too).
    source: a state_dict, or a path to a file saved with torch.save(state_dict, path) from
            a plain, DataParallel, DDP or torch.compile-wrapped model.
    map_location: where torch.load puts the tensors it reads (a path source only). "cpu"
            always works, even for a file saved on a GPU; load_state_dict then copies each
            tensor onto the device of the model's own parameter.
    """
    where = "the state_dict"
    if isinstance(source, (str, os.PathLike)):
        where = os.fspath(source)
        source = read_state_dict(source, map_location)
    if not isinstance(source, Mapping):
        raise CheckpointError(f"{where} holds a {type(source).__name__}, not a state_dict "
                              f"(a dict from parameter names to tensors)")
    nested = [k for k, v in source.items() if isinstance(v, Mapping)]
    if nested:
        raise CheckpointError(f"{where} is not a state_dict but a dict that holds dicts (keys "
                              f"{_listed([str(k) for k in source])}); pass the state_dict inside "
                              f"it, e.g. load_into(model, checkpoint[{nested[0]!r}])")
    if not all(isinstance(k, str) for k in source):
        raise CheckpointError(f"{where} is not a state_dict: its keys are not all parameter names")
    target = unwrap(model)
    wanted = set(target.state_dict())
    # Strip one wrapper layer at a time and take the first version whose keys fit. Trying
    # the unstripped keys first keeps a model whose own child is called `module` working.
    candidates = strip_layers(source)
    fits = [(s, p) for s, p in candidates if set(s) == wanted]
    if not fits:
        # report against the most-stripped version among the closest: the natural reading
        state, stripped = min(reversed(candidates), key=lambda c: len(set(c[0]) ^ wanted))
        missing = sorted(wanted - set(state))
        unexpected = sorted(set(state) - wanted)
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (in the model, not in the checkpoint): "
                         f"{_listed(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (in the checkpoint, not in the model): "
                         f"{_listed(unexpected)}")
        after = f" after stripping {stripped!r}" if stripped else ""
        raise CheckpointError(f"{where} does not fit {type(target).__name__}{after}: "
                              + "; ".join(parts), missing, unexpected)
    state, stripped = fits[0]
    own = target.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
             if isinstance(v, torch.Tensor) and isinstance(own[k], torch.Tensor)
             and v.shape != own[k].shape]
    if wrong:
        raise CheckpointError(f"{where} has the right keys but other shapes than "
                              f"{type(target).__name__} (checkpoint vs model): {_listed(wrong, 4)}")
    target.load_state_dict(state, strict=True)
    return stripped


def _tensors(obj, path=""):
    """(path, tensor) for every tensor inside nested dicts/lists."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def snapshot_problem(snap, template: Mapping, expected: Mapping, total_steps: int,
                     epochs_flag: str) -> str | None:
    """Why lesson 07 must not resume from `snap` (one line), or None when it is sound.

    template: a snapshot this run would write (its keys and its model's shapes);
    expected: format, seed, dataset, global_batch and steps_per_epoch of this run.
    A resumed run must be exact, so every field is checked before anything is loaded:
    a negative or non-integer step, a loss curve or sample ledger of the wrong length,
    NaN or infinite weights, a model of other shapes.
    """
    fmt = expected["format"]
    if not isinstance(snap, Mapping) or snap.get("format") != fmt:
        return f"is not a lesson-07 snapshot of format {fmt}"
    missing = sorted(set(template) - set(snap))
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in ("seed", "dataset", "global_batch"):
        if snap.get(key) != expected[key]:
            return f"was made with {key} {snap.get(key)!r}, this run uses {expected[key]!r}"
    step = snap["global_step"]
    if type(step) is not int or step < 0:
        return f"has global_step {step!r}; expected a whole number of 0 or more"
    if step > total_steps:
        return f"is at step {step}, beyond this run's {total_steps} steps ({epochs_flag})"
    per_epoch = expected.get("steps_per_epoch")
    if per_epoch and (snap["epoch"], snap["step_in_epoch"]) != divmod(step, per_epoch):
        return (f"says epoch {snap['epoch']!r} step {snap['step_in_epoch']!r}, which is not "
                f"global step {step}")
    losses = snap["losses"]
    if not isinstance(losses, list) or len(losses) != step or not all(
            isinstance(x, float) and math.isfinite(x) for x in losses):
        return f"has a loss curve that is not {step} finite numbers"
    samples = snap["samples"]
    if not isinstance(samples, torch.Tensor) or tuple(samples.shape) != (step, expected["global_batch"]):
        return f"has a sample ledger that is not {step} x {expected['global_batch']} ids"
    model, own = snap["model"], template["model"]
    if not isinstance(model, Mapping) or set(model) != set(own):
        keys = sorted(set(model) ^ set(own)) if isinstance(model, Mapping) else ["(not a dict)"]
        return f"does not fit this model (keys differ: {_listed([str(k) for k in keys], 4)})"
    for k, v in model.items():
        if not isinstance(v, torch.Tensor) or v.shape != own[k].shape:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return f"does not fit this model ({k}: {shape}, the model has {tuple(own[k].shape)})"
    for where, part in (("weights", model), ("optimizer state", snap["optimizer"])):
        for name, t in _tensors(part):
            if t.is_floating_point() and not torch.isfinite(t).all():
                return f"holds NaN or infinite {where} ({name}); a run cannot resume from them"
    return None
