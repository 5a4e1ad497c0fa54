"""Lesson 16's instruments: check a DCP checkpoint before any rank starts, list its files.

* problem(folder, model): None if `folder` is a DCP checkpoint this model can resume from,
  else one sentence naming what is wrong and what to do. It reads `.metadata` with DCP's own
  FileSystemReader.read_metadata, checks that every file the metadata names exists and is
  long enough for every byte range it lists, and that the model's keys and shapes are the
  ones saved. Run in the launcher, before spawning: a rank that meets a bad shard raises
  FileNotFoundError or "PytorchStreamReader failed reading zip archive" on every rank, and
  DCP wraps it in CheckpointException, which derives from BaseException (torch 2.14.1,
  distributed/checkpoint/api.py), so `except Exception` would not even catch it.
  Nothing here writes: the checkpoint is left as it was. Caution: read_metadata unpickles
  `.metadata` (filesystem.py: pickle.load), so only resume from checkpoints you made.
* files(folder): [(name, bytes)] of the checkpoint's files, sorted by name.
* full_state_bytes(n_params): bytes of fp32 weights + AdamW state (4 + 8 per parameter).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

# The lesson saves into the same folder each time you run it, on purpose. torch 2.14.1 then
# warns on every rank that a future default may refuse to overwrite (filesystem.py,
# FileSystemWriter.prepare_local_plan); the doc says so once, under Common mistakes.
# Importing this module (the lesson does, in every rank) silences that one warning.
warnings.filterwarnings("ignore", message="Detected an existing checkpoint in")


def files(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in Path(folder).iterdir() if p.is_file())


def needed_bytes(metadata) -> dict[str, int]:
    """{file: the least size it must have}, from the byte ranges .metadata lists."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():  # MetadataIndex -> _StorageInfo
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def damaged_items(folder: Path, metadata) -> str | None:
    """The first file holding a damaged piece, or None. Each piece DCP 2.14.1 writes in its
    default format (SerializationFormat.TORCH_SAVE, as the lesson does) is a small torch.save zip archive (filesystem.py, _write_item): it starts with the zip signature
    "PK" 03 04 and ends with the 22-byte end-of-archive record, "PK" 05 06. Reading those bytes
    catches a damaged header or end without reading the tensors; DCP keeps no checksums, so
    bytes changed inside a tensor's data are not caught here."""
    for info in metadata.storage_data.values():
        with open(Path(folder) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            head = f.read(4)
            f.seek(info.offset + info.length - 22)
            tail = f.read(4)
        if head != b"PK\x03\x04" or tail != b"PK\x05\x06":
            return info.relative_path
    return None


def problem(folder: Path, model: torch.nn.Module) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    where = f"--resume {folder}"
    if not (folder / ".metadata").is_file():
        return (f"{where} holds no DCP checkpoint (no .metadata file); pass the folder a run "
                f"with --stop-at-step K --checkpoint DIR wrote")
    try:
        metadata = FileSystemReader(folder).read_metadata()
        need = needed_bytes(metadata)
    except Exception as exc:  # a damaged .metadata: unpickling fails in many ways
        return (f"{where}: its .metadata cannot be read ({type(exc).__name__}); the checkpoint "
                f"is damaged: save it again")
    for name, size in sorted(need.items()):
        path = folder / name
        if not path.is_file():
            return (f"{where}: the shard {name} is missing (its .metadata lists {len(need)} "
                    f"files); the checkpoint is incomplete: copy every file, or save it again")
        if os.path.getsize(path) < size:
            return (f"{where}: the shard {name} is {os.path.getsize(path):,} bytes, shorter than "
                    f"the {size:,} its .metadata needs (truncated: an interrupted copy?); save it again")
    bad = damaged_items(folder, metadata)
    if bad:
        return (f"{where}: the shard {bad} is damaged (a piece .metadata points to is not where "
                f"it says, or was overwritten); save the checkpoint again")
    saved = {k[len("model."):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if saved != wanted:
        odd = sorted(set(saved) ^ set(wanted)) or [k for k in wanted if saved[k] != wanted[k]]
        return (f"{where} is a checkpoint of another model ({len(saved)} saved weights, this "
                f"model has {len(wanted)}; first difference: {odd[0]}); resume with the "
                f"model that saved it")
    if "step" not in metadata.state_dict_metadata:
        return f"{where} has no training step saved; it was not written by this lesson"
    return None


def full_state_bytes(n_params: int) -> int:
    """fp32 weights (4 bytes) + AdamW's exp_avg and exp_avg_sq (8 bytes) per parameter."""
    return 12 * n_params


def check(args):
    """Lesson 16's flags and its --resume checkpoint, checked in the launcher before any rank
    starts: one line (common.cli.fail) and nothing written. Returns args."""
    from common import transformer as T
    from common.cli import fail

    if args.stop_at_step and args.stop_at_step >= args.steps:
        fail(f"--stop-at-step {args.stop_at_step} must come before the last step (--steps {args.steps})")
    if args.resume:
        found = problem(args.resume, T.make_model(args.seed))
        if found:
            fail(found)
        step = saved_step(args.resume)
        if step >= args.steps:
            fail(f"--resume {args.resume} was saved after step {step}; pass --steps above {step}")
    return args


def saved_step(folder: Path) -> int:
    """The step a checkpoint was saved after: dcp.load with no process group reads it here."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"step": torch.tensor(0)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    return int(state["step"])


def show_files(ui, folder: Path, model, seconds: float) -> list[tuple[str, int]]:
    """The files dcp.save wrote and their sizes; what gathering the full state would cost."""
    from apparatus.results import shown

    from torch.distributed.checkpoint import FileSystemReader

    listing = files(folder)
    named = set(needed_bytes(FileSystemReader(folder).read_metadata())) | {".metadata"}
    listing = [(name, size) for name, size in listing if name in named]
    stale = sorted(name for name, _ in files(folder) if name not in named)
    ui.table(f"What dcp.save wrote to {shown(Path(folder))} in {seconds:.2f}s", ["file", "bytes"],
             [[name, f"{size:,}"] for name, size in listing])
    if stale:  # an earlier save at a larger world size left these; .metadata no longer names them
        ui.print(f"also in the folder, from an earlier save and not part of this checkpoint: {', '.join(stale)}")
    n = sum(p.numel() for p in model.parameters())
    full = full_state_bytes(n)
    shards = [size for name, size in listing if name.endswith(".distcp")]
    big, ranks = full_state_bytes(70e9), 512
    ui.print(f"{len(shards)} shard files, the largest {max(shards):,} bytes; the full state (weights "
             f"+ AdamW) is {full:,} bytes. Gathered on rank 0 it must fit there whole: at 70e9 "
             f"parameters {big / 2**30:,.0f} GiB in one process, against {big / ranks / 2**30:.2f} "
             f"GiB per rank written by each of {ranks} ranks")
    ui.print(f"continue from it at any --world-size: --resume {shown(Path(folder))}")
    return listing


def show_losses(ui, losses: list[float], start: int, end: int, seed: int, steps: int,
                every: int) -> list[float]:
    """This run's losses beside the uninterrupted run's (lesson 13's reference), every
    `every` steps, on rank 0; returns the reference's losses for these steps."""
    from common import transformer as T
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return []
    ref = T.train_reference(seed, steps)["losses"].tolist()
    shown_steps = sorted({start, *range(start + every - 1, end, every), end - 1})
    ui.table("Loss by step: this run beside the uninterrupted one (lesson 13)",
             ["step", "this run", "uninterrupted", "difference"],
             [[s + 1, f"{losses[s - start]:.6f}", f"{ref[s]:.6f}", f"{losses[s - start] - ref[s]:+.1e}"]
              for s in shown_steps])
    return ref[start:end]


def show_resumed(ui, state: dict, optimizer) -> int:
    """Print where a resumed run starts; returns the step."""
    import torch.distributed as dist

    step = int(state["step"])
    counter = next(iter(optimizer.state.values()))["step"]
    world = dist.get_world_size()
    ui.print(f"resumed after step {step} on {world} rank{'s' if world > 1 else ''}; AdamW's step counter "
             f"(restored from the checkpoint): {int(counter)}")
    return step
