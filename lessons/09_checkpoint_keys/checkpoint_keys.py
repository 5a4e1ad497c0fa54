"""Lesson 09's instruments: a model whose own children are called `module`, every wrapper's
prefix, the load_into matrix, and what a checkpoint file records about devices and types.

Lesson 09 (lessons/09_checkpoint_keys.py) tells the story of the `module.` prefix: the
error, the three fixes. What only *shows* the rest of the landscape lives here, one
function per step of the lesson, so the lesson file stays the story:

    TinyNet                     keys stem.submodule.*, block.module.*, head.* (Step 7's bug)
    wrapper_prefixes(...)       the first key under plain / DataParallel / DDP / compile (Step 8)
    load_into_matrix(...)       every saved-as x loaded-as pair through load_into (Step 8)
    devices_and_types(...)      map_location's device tags, weights_only=True refusing a
                                dataclass (Step 9)

They run on rank 0 only, with DDP over a process group of rank 0 alone (`solo`), while the
other ranks wait at the lesson's next barrier.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.markup import escape  # error texts hold [brackets] that rich would read as markup
from torch.nn.parallel import DistributedDataParallel as DDP

from common import recipe
from apparatus.state_dicts import CheckpointError, load_into, unwrap
from apparatus.results import max_abs_diff, plain_state_dict, shown


class Residual(nn.Module):
    """x + module(x): a common block whose child is, quite reasonably, called `module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return x + self.module(x)


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.submodule = nn.Linear(recipe.FEATURES, 32)

    def forward(self, x):
        return F.relu(self.submodule(x))


class TinyNet(nn.Module):
    """Keys: stem.submodule.*, block.module.*, head.*: `module.` inside two of them."""

    def __init__(self):
        super().__init__()
        self.stem = Stem()
        self.block = Residual(nn.Linear(32, 32))
        self.head = nn.Linear(32, recipe.CLASSES)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


@dataclasses.dataclass
class TrainConfig:
    lr: float
    epochs: int


def wrap(name: str, model: nn.Module, device: torch.device, group=None) -> nn.Module:
    """`model` wrapped as `name` says; DDP over `group` (None: the default group)."""
    ids = [device.index] if device.type == "cuda" else None
    if name == "plain":
        return model
    if name == "DataParallel":
        return nn.DataParallel(model)  # without GPUs it only wraps: forward calls model
    if name == "DDP":
        return DDP(model, device_ids=ids, process_group=group)
    if name == "torch.compile":
        return torch.compile(model)    # an OptimizedModule; compiles at the first call
    if name == "DDP(torch.compile)":
        return DDP(torch.compile(model), device_ids=ids, process_group=group)
    if name == "torch.compile(DDP)":
        return torch.compile(DDP(model, device_ids=ids, process_group=group))
    raise ValueError(name)


def wrapper_prefixes(ui, make, device, group) -> dict[str, str]:
    """The first key of state_dict() under each wrapper, printed as a table."""
    rows, first_keys = [], {}
    for name in ["plain", "DataParallel", "DDP", "torch.compile", "DDP(torch.compile)",
                 "torch.compile(DDP)"]:
        wrapped = wrap(name, make(0), device, group)
        first_keys[name] = next(iter(wrapped.state_dict()))
        rows.append([name, type(wrapped).__name__, first_keys[name]])
        del wrapped
    ui.table("The first key of model.state_dict() under each wrapper",
             ["wrapped as", "outer class", "first key"], rows)
    return first_keys


def load_into_matrix(ui, make, trained: dict, device, group, bad: dict) -> tuple[dict, float, dict]:
    """Save from each wrapper, load_into each wrapper, check every weight; then load_into
    with each of `bad` ({label: (target model, state)}): one CheckpointError line each."""
    kinds = ["plain", "DataParallel", "DDP", "torch.compile"]
    matrix, rows, worst = {}, [], 0.0
    for source_kind in kinds + ["DDP(torch.compile)"]:
        source = make(0)
        source.load_state_dict(trained)
        saved_state = wrap(source_kind, source, device, group).state_dict()
        row = [source_kind, ""]
        for target_kind in kinds:
            target = wrap(target_kind, make(1), device, group)
            row[1] = load_into(target, saved_state) or "(nothing)"  # returns what it stripped
            # plain_state_dict: CPU copies (DataParallel moves a model to cuda:0 on a 1-GPU machine)
            diff = max_abs_diff(plain_state_dict(unwrap(target)), trained)
            worst = max(worst, diff)
            matrix[f"{source_kind} -> {target_kind}"] = row[1]
            row.append("ok" if diff == 0.0 else f"{diff:.1e}")
            del target
        rows.append(row)
    ui.table("load_into(model wrapped as plain / DP / DDP / compile, state saved from ...)",
             ["saved from", "stripped", "plain", "DP", "DDP", "compile"], rows)
    ui.print(f"{len(matrix)} pairs loaded; largest |loaded - trained| weight: {worst}")
    mistakes = {}
    for label, (target, state) in bad.items():
        try:
            load_into(target, state)
        except CheckpointError as exc:  # one line: what is missing, what is unexpected
            mistakes[label] = str(exc)
            ui.print(f"load_into with {label}: [red]CheckpointError[/red]: {escape(str(exc))}")
    return matrix, worst, mistakes


def devices_and_types(ui, model, plain, module_path, folder, epochs: int) -> list[str]:
    """The device tags a file records (map_location as a function), and weights_only=True
    refusing a dataclass where a plain dict loads. Returns the tags of `module_path`."""
    locations = set()

    def where_saved(storage, location):  # map_location may be a function: (storage, tag)
        locations.add(location)
        return storage                   # keep it where torch.load put it (on the CPU)
    torch.load(module_path, map_location=where_saved, weights_only=True)
    on_cpu = torch.load(module_path, map_location="cpu", weights_only=True)
    ui.print(f"device tags recorded in {shown(module_path)}: {sorted(locations)}; with "
             f"map_location='cpu' the tensors land on {next(iter(on_cpu.values())).device}")
    if torch.cuda.is_available():
        gpu_path = folder / "gpu_model.pt"
        torch.save(recipe.make_model(0).to("cuda").state_dict(), gpu_path)
        tags = set()
        torch.load(gpu_path, map_location=lambda s, tag: tags.add(tag) or s, weights_only=True)
        back = torch.load(gpu_path, map_location="cpu", weights_only=True)
        ui.print(f"a model saved from the GPU: tags {sorted(tags)}; map_location='cpu' -> "
                 f"{next(iter(back.values())).device}")
    else:
        ui.print("no GPU here: a file saved from cuda:0 would say 'cuda:0', and torch.load "
                 "without map_location would refuse it on this machine (see the doc)")
    config_path = folder / "with_config.pt"
    torch.save({"model": model.state_dict(), "config": TrainConfig(recipe.LR, epochs)}, config_path)
    try:
        torch.load(config_path, weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError
        why = next(line.strip() for line in str(exc).splitlines() if "WeightsUnpickler" in line)
        ui.print(f"weights_only=True refuses a dataclass in the file: {escape(why)}")
    torch.save({"model": model.state_dict(),
                "config": dataclasses.asdict(TrainConfig(recipe.LR, epochs))}, config_path)
    checkpoint = torch.load(config_path, weights_only=True)
    try:
        load_into(plain, config_path)
    except CheckpointError as exc:
        ui.print(f"with a plain dict as config it loads; load_into(plain, path) then says: "
                 f"{escape(str(exc))}")
    load_into(plain, checkpoint["model"])
    ui.print(f"load_into(plain, checkpoint['model']) works; config = {checkpoint['config']}")
    return sorted(locations)


def strict_false(ui, plain, path, data, device) -> None:
    """strict=False "succeeds" and loads nothing: every key is unexpected and skipped."""
    result = plain.load_state_dict(torch.load(path, weights_only=True), strict=False)
    ui.print(f"with strict=False: {len(result.missing_keys)} missing and "
             f"{len(result.unexpected_keys)} unexpected keys, no error, and the model is "
             f"still untrained (test accuracy {recipe.accuracy(plain, data.test, device):.1%})")


def strip_by_hand(ui, device, group, seed: int) -> tuple[dict, dict, dict]:
    """DDP(TinyNet())'s keys stripped two ways: k.replace (the bug) and k.removeprefix.
    Returns (replaced, stripped, {saved key: wrong key} for every key k.replace broke)."""
    torch.manual_seed(seed)
    ids = [device.index] if device.type == "cuda" else None
    saved = DDP(TinyNet().to(device), device_ids=ids, process_group=group).state_dict()
    replaced = {k.replace("module.", ""): v for k, v in saved.items()}   # the bug
    stripped = {k.removeprefix("module."): v for k, v in saved.items()}  # prefix only
    ui.table("Keys of DDP(TinyNet()), stripped two ways",
             ["saved key", "k.replace(...)", "k.removeprefix(...)"],
             [[k, r, s] for k, r, s in zip(saved, replaced, stripped)])
    try:
        TinyNet().to(device).load_state_dict(replaced)
    except RuntimeError as exc:
        ui.print(f"k.replace: RuntimeError: {escape(str(exc))}")
    ui.print(f"k.removeprefix: load_state_dict says {TinyNet().to(device).load_state_dict(stripped)}")
    return replaced, stripped, {k: r for k, r in zip(saved, replaced)
                                if r != k.removeprefix("module.")}


def checksum(model: nn.Module) -> float:
    """The sum of all weights: different random weights differ, loaded ones agree."""
    return sum(p.detach().double().sum().item() for p in model.parameters())


def weight_sums(ui, before: float, model: nn.Module) -> dict[str, list[float]]:
    """Every rank's weight sum before and after loading, gathered and printed by rank 0."""
    import torch.distributed as dist

    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, [dist.get_rank(), f"{before:.6f}", f"{checksum(model):.6f}"])
    ui.table("Sum of all weights, per rank", ["rank", "before loading", "after loading"], rows)
    return {"before": [float(r[1]) for r in rows], "after": [float(r[2]) for r in rows]}


def maker(seed: int, data, device):
    """make(k): the recipe's model with seed + k, on `device`."""
    return lambda k: recipe.make_model(seed + k, data.in_features, data.classes).to(device)
