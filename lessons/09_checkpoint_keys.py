"""Lesson 09: the `module.` prefix in checkpoints, and one loader for every wrapper.

New since lesson 08: saving and loading. Lessons 05-08 saved `ddp_model.module.state_dict()`
without saying why. Here you save the DDP model itself, watch the plain model refuse the
file (`module.fc1.weight` is not `fc1.weight`), fix it three ways, see why
`k.replace("module.", "")` is a bug, meet torch.compile's `_orig_mod.` prefix and nested
wrappers, and then use `common/checkpoint.py`'s `load_into`, which loads any of them into
any of them. Last: `map_location`, `weights_only=True`, and rank 0 saving while the other
ranks wait at a barrier before they load.

Run:
    make lesson-09
    make lesson-09 ARGS="--world-size 3"
    .venv/bin/python lessons/09_checkpoint_keys.py --epochs 1 --out runs/my-try

Doc: docs/09_checkpoint_keys.md
"""
import dataclasses
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from rich.markup import escape  # error texts hold [brackets] that rich would read as markup
from torch.utils.data import DataLoader

from common import recipe
from common.checkpoint import CheckpointError, load_into, unwrap
from common.cli import fail, lesson_parser, run
from common.device import backend_for, pick_device, plan_device, rank_device, share_cpu
from common.distributed import choose_port, init_from_env, spawn, teardown
from common.results import (atomic_write, make_metrics, max_abs_diff, out_dir,
                            plain_state_dict, save_results, shown)
from common.ui import UI, Timer

MAX_WORLD = 8  # step 9 only starts processes that load one small file


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    args = parser.parse_args()
    if args.world_size > MAX_WORLD:
        fail(f"--world-size {args.world_size}: step 9 needs only a few ranks to make its point; "
             f"use {MAX_WORLD} or fewer")
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title("Lesson 09: the module. prefix in checkpoints")
    folder = out_dir("09", args.out)

    # Step 1: Train with DDP and save its state_dict
    # A world of one (init_from_env makes one under plain python) is enough to get a real
    # DDP model. DDP keeps your model as its child `module`, and state_dict() names every
    # tensor by its path from the object you call it on: so `module.fc1.weight`.
    ui.step(1, "Train with DDP and save its state_dict")
    device = pick_device(args.device)
    backend = backend_for(device)
    init_from_env(backend, args.timeout, device)
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = recipe.make_optimizer(ddp_model)
    sampler = recipe.EpochShuffle(len(data.train), seed=args.seed)
    loader = DataLoader(data.train, batch_size=recipe.GLOBAL_BATCH, sampler=sampler)
    losses: list[float] = []
    timer = Timer()
    with ui.progress(args.epochs * len(loader), "training") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(ddp_model(x.to(device)), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                bar.advance()
    wall = timer.seconds
    trained = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    accuracy_trained = recipe.accuracy(model, data.test, device)
    ddp_path = folder / "ddp_model.pt"
    ddp_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ddp_model.state_dict(), ddp_path)  # the tempting line
    ddp_keys = list(ddp_model.state_dict())
    ui.print(f"{args.epochs} epoch(s) on a world of 1 over {backend}: test accuracy "
             f"{accuracy_trained:.1%}; saved ddp_model.state_dict() to {shown(ddp_path)}")
    ui.print(f"its keys: {ddp_keys}")

    # Step 2: Load it into a plain model: the error
    # A plain MLP expects `fc1.weight`. load_state_dict is strict by default: it refuses a
    # file whose keys differ and lists both sides. This is the real message:
    ui.step(2, "Load it into a plain model: the error")
    plain = recipe.make_model(args.seed + 1, data.in_features, data.classes).to(device)
    try:
        plain.load_state_dict(torch.load(ddp_path, weights_only=True))
    except RuntimeError as exc:
        first_error = str(exc)
        ui.print(f"RuntimeError: {escape(first_error)}")
    # strict=False would "succeed" and load nothing: every key is unexpected and skipped
    result = plain.load_state_dict(torch.load(ddp_path, weights_only=True), strict=False)
    ui.print(f"with strict=False: {len(result.missing_keys)} missing and "
             f"{len(result.unexpected_keys)} unexpected keys, no error, and the model is "
             f"still untrained (test accuracy {recipe.accuracy(plain, data.test, device):.1%})")

    # Step 3: Fix 1: save model.module.state_dict()
    # The best fix is at save time: save the model inside the wrapper, and the file has
    # the keys of a plain model, loadable anywhere (with or without DDP). This is what
    # lessons 05-08 (and common.results.plain_state_dict) do.
    ui.step(3, "Fix 1: save model.module.state_dict()")
    module_path = folder / "model.pt"
    torch.save(ddp_model.module.state_dict(), module_path)
    result = plain.load_state_dict(torch.load(module_path, weights_only=True))
    ui.print(f"keys in {shown(module_path)}: {list(torch.load(module_path, weights_only=True))[:2]} ...; "
             f"load_state_dict says {result}")

    # Step 4: Fix 2: strip the prefix with consume_prefix_in_state_dict_if_present
    # For a file that already has the prefix. PyTorch's own helper strips it from every
    # key that *starts with* it, in place: it returns None, so do not assign its result.
    ui.step(4, "Fix 2: strip the prefix with consume_prefix_in_state_dict_if_present")
    state = torch.load(ddp_path, weights_only=True)
    returned = consume_prefix_in_state_dict_if_present(state, "module.")
    plain = recipe.make_model(args.seed + 1, data.in_features, data.classes).to(device)
    result = plain.load_state_dict(state)
    ui.print(f"it returned {returned} and changed the dict in place: {list(state)[:2]} ...; "
             f"load_state_dict says {result}")

    # Step 5: Fix 3: strip by hand, as a prefix only
    # A model whose own children are called `module` or `submodule` (a residual block
    # that wraps `self.module` is a common pattern) shows why `k.replace("module.", "")`
    # is a bug: it rewrites `module.` wherever it appears, not only at the start.
    ui.step(5, "Fix 3: strip by hand, as a prefix only")
    torch.manual_seed(args.seed)
    net = TinyNet().to(device)
    ddp_net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    saved = ddp_net.state_dict()
    replaced = {k.replace("module.", ""): v for k, v in saved.items()}   # the bug
    stripped = {k.removeprefix("module."): v for k, v in saved.items()}  # prefix only
    ui.table("Keys of DDP(TinyNet()), stripped two ways", ["saved key", "k.replace(...)",
                                                           "k.removeprefix(...)"],
             [[k, r, s] for k, r, s in zip(saved, replaced, stripped)])
    try:
        TinyNet().to(device).load_state_dict(replaced)
    except RuntimeError as exc:
        ui.print(f"k.replace: RuntimeError: {escape(str(exc))}")
    result = TinyNet().to(device).load_state_dict(stripped)
    ui.print(f"k.removeprefix: load_state_dict says {result}")
    replace_bug = {k: r for k, r in zip(saved, replaced) if r != k.removeprefix("module.")}
    del ddp_net

    # Step 6: DataParallel, torch.compile and wrappers in wrappers
    # DataParallel keeps the model in `.module` too. torch.compile returns an
    # OptimizedModule that keeps it in `._orig_mod`; building one compiles nothing (that
    # happens at the first call), so this step is fast. Wrappers nest, and so do prefixes.
    ui.step(6, "DataParallel, torch.compile and wrappers in wrappers")
    rows = []
    first_keys = {}
    for name in ["plain", "DataParallel", "DDP", "torch.compile", "DDP(torch.compile)",
                 "torch.compile(DDP)"]:
        wrapped = wrap(name, recipe.make_model(args.seed, data.in_features, data.classes).to(device),
                       device)
        first_keys[name] = next(iter(wrapped.state_dict()))
        rows.append([name, type(wrapped).__name__, first_keys[name]])
        del wrapped
    ui.table("The first key of model.state_dict() under each wrapper",
             ["wrapped as", "outer class", "first key"], rows)

    # Step 7: One loader for every wrapper: load_into
    # common/checkpoint.py's load_into(model, source) unwraps the target to the model
    # inside, strips wrapper prefixes from the checkpoint (only at the start of a key,
    # only while every key has one) and loads strictly. Every pair, checked weight by weight:
    ui.step(7, "One loader for every wrapper: load_into")
    kinds = ["plain", "DataParallel", "DDP", "torch.compile"]
    matrix, rows, worst = {}, [], 0.0
    for source_kind in kinds + ["DDP(torch.compile)"]:
        source = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
        source.load_state_dict(trained)
        saved_state = wrap(source_kind, source, device).state_dict()
        row = [source_kind, ""]
        for target_kind in kinds:
            fresh = recipe.make_model(args.seed + 1, data.in_features, data.classes).to(device)
            target = wrap(target_kind, fresh, device)
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
    for label, bad_source in (("a TinyNet checkpoint", stripped), ("the k.replace keys", replaced)):
        try:
            load_into(TinyNet().to(device) if bad_source is replaced else plain, bad_source)
        except CheckpointError as exc:  # one line: what is missing, what is unexpected
            mistakes[label] = str(exc)
            ui.print(f"load_into with {label}: [red]CheckpointError[/red]: {escape(str(exc))}")

    # Step 8: Across devices: map_location and weights_only=True
    # torch.save records each tensor's device in the file, and torch.load puts it back
    # there unless map_location says otherwise. weights_only=True (torch.load's default
    # since 2.6) unpickles only tensors and plain containers: a file cannot run code.
    ui.step(8, "Across devices: map_location and weights_only=True")
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
        torch.save(recipe.make_model(args.seed).to("cuda").state_dict(), gpu_path)
        tags = set()
        torch.load(gpu_path, map_location=lambda s, tag: tags.add(tag) or s, weights_only=True)
        back = torch.load(gpu_path, map_location="cpu", weights_only=True)
        ui.print(f"a model saved from the GPU: tags {sorted(tags)}; map_location='cpu' -> "
                 f"{next(iter(back.values())).device}")
    else:
        ui.print("no GPU here: a file saved from cuda:0 would say 'cuda:0', and torch.load "
                 "without map_location would refuse it on this machine (see the doc)")
    config_path = folder / "with_config.pt"
    torch.save({"model": model.state_dict(), "config": TrainConfig(recipe.LR, args.epochs)},
               config_path)
    try:
        torch.load(config_path, weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError
        why = next(line.strip() for line in str(exc).splitlines() if "WeightsUnpickler" in line)
        ui.print(f"weights_only=True refuses a dataclass in the file: {escape(why)}")
    torch.save({"model": model.state_dict(), "config": dataclasses.asdict(TrainConfig(recipe.LR, args.epochs))},
               config_path)
    checkpoint = torch.load(config_path, weights_only=True)
    try:
        load_into(plain, config_path)
    except CheckpointError as exc:
        ui.print(f"with a plain dict as config it loads; load_into(plain, path) then says: "
                 f"{escape(str(exc))}")
    load_into(plain, checkpoint["model"])
    ui.print(f"load_into(plain, checkpoint['model']) works; config = {checkpoint['config']}")

    # Step 9: Rank 0 saves, a barrier, then every rank loads
    # In a real job every rank holds the model. One writer is enough (and two writers on
    # one path race), but a reader must not open the file before it is complete: rank 0
    # writes, *then* everybody meets at dist.barrier(), *then* the others read.
    ui.step(9, "Rank 0 saves, a barrier, then every rank loads")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    os.environ["MASTER_PORT"] = str(choose_port(args.master_port))  # a new group, a new port
    shared = folder / "resume.pt"
    if shared.exists():
        shared.unlink()  # so that no rank can read an old copy
    spawn(resume_worker, args=(args.world_size, args, kind, str(ddp_path), str(shared)),
          nprocs=args.world_size)
    checksums = torch.load(folder / "checksums.pt", weights_only=True)

    # Step 10: Save the results and leave the process group
    # final.pt holds the plain keys (plain_state_dict unwraps), loaded through load_into
    # from the DDP file of step 1, so its accuracy must be the trained model's.
    ui.step(10, "Save the results and leave the process group")
    reloaded = recipe.make_model(args.seed + 1, data.in_features, data.classes).to(device)
    load_into(reloaded, ddp_path)
    accuracy = recipe.accuracy(reloaded, data.test, device)
    reference = recipe.train_reference(args.seed, args.epochs, data)
    save_results(folder, plain_state_dict(reloaded), make_metrics(
        lesson="09", world_size=1, backend=backend, device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=args.epochs * len(data.train),
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
        accuracy_before_saving=accuracy_trained, ddp_keys=ddp_keys,
        plain_load_error=first_error.splitlines()[0], first_keys=first_keys,
        replace_bug=replace_bug, load_into=matrix, load_into_max_abs_diff=worst,
        load_into_errors=mistakes, checkpoint_locations=sorted(locations),
        resume_checksums=checksums,
        max_abs_diff_vs_single_device=max_abs_diff(plain_state_dict(reloaded), reference)))
    ui.print(f"reloaded from {shown(ddp_path)}: test accuracy {accuracy:.1%} "
             f"(before saving: {accuracy_trained:.1%}); wrote {shown(folder / 'final.pt')} "
             f"and metrics.json")
    del ddp_model, optimizer
    teardown()
    ui.print("done: left the process group cleanly")


def resume_worker(rank: int, world_size: int, args, kind: str, trained_path: str,
                  shared_path: str) -> None:
    """Step 9 on every rank: different weights before, rank 0's weights after."""
    ui = UI(rank, world_size)
    share_cpu(world_size)
    device = rank_device(kind, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method="env://", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    # a different seed per rank: as if each rank had started from its own random weights
    model = recipe.make_model(args.seed + 100 + rank, data.in_features, data.classes).to(device)
    before = checksum(model)
    if rank == 0:
        load_into(model, trained_path, map_location=device)   # the DDP file of step 1
        atomic_write(Path(shared_path), lambda f: torch.save(model.state_dict(), f))
    dist.barrier()  # nobody passes until rank 0 has written the whole file
    if rank != 0:
        # map_location=device: each rank reads onto its *own* device. Without it, a file
        # saved from cuda:0 would put every rank's copy on GPU 0 first.
        load_into(model, shared_path, map_location=device)
    after = checksum(model)
    rows: list = [None] * world_size
    dist.all_gather_object(rows, [rank, f"{before:.6f}", f"{after:.6f}"])
    ui.table("Sum of all weights, per rank", ["rank", "before loading", "after loading"], rows)
    if rank == 0:
        torch.save({"before": [float(r[1]) for r in rows], "after": [float(r[2]) for r in rows]},
                   Path(shared_path).parent / "checksums.pt")
    dist.barrier()
    teardown()


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


def wrap(name: str, model: nn.Module, device: torch.device) -> nn.Module:
    """`model` wrapped as `name` says; DDP needs the process group of step 1."""
    ids = [device.index] if device.type == "cuda" else None
    if name == "plain":
        return model
    if name == "DataParallel":
        return nn.DataParallel(model)  # without GPUs it only wraps: forward calls model
    if name == "DDP":
        return DDP(model, device_ids=ids)
    if name == "torch.compile":
        return torch.compile(model)    # an OptimizedModule; compiles at the first call
    if name == "DDP(torch.compile)":
        return DDP(torch.compile(model), device_ids=ids)
    if name == "torch.compile(DDP)":
        return torch.compile(DDP(model, device_ids=ids))
    raise ValueError(name)


def checksum(model: nn.Module) -> float:
    return sum(p.detach().double().sum().item() for p in model.parameters())


if __name__ == "__main__":
    run(main)
