"""Lesson 16's instruments: a checkpoint that is whole, is the one you meant, and runs no code.

DCP (torch 2.14.1) writes its files into the folder you name, in place, and keeps no record
of what made them. So an interrupted save leaves cut shards beside the old `.metadata`, a
shard from another run loads without a word, and `.metadata` is a pickle (filesystem.py:
pickle.load), which can run any code as it loads. This module and checkpoint_trust.py beside
it (the checks: checkpoint.json, the allow-list, Reader) close those three holes:

* claim(args): before any rank starts, `--checkpoint` (and the asynchronous save's folder)
  is checked and locked for this job, as `--out` is (apparatus/results.py: claim_out), and
  what a killed save left beside it is tidied; then the `--resume` folder is checked
  (problem): one line, and nothing changed, for anything wrong.
* save_beside(folder, args, step): DCP writes into `<folder>.saving`; once every rank is done,
  rank 0 writes checkpoint.json (what made the checkpoint, and each file's size and sha256)
  into it, moves the earlier checkpoint aside to `<folder>.old`, renames the new one into
  place and deletes the old. A folder always holds one whole checkpoint: a kill, a full disk
  or a failing rank before the rename leaves the earlier one as it was; tidy() removes what
  is left over (the launcher calls it when the ranks end, claim() at the next start).
* checkpoint.json is written last: a folder without it is not a finished checkpoint. A resume
  checks it first: --seed, --strategy and the recipe (common/transformer.py's constants) must
  be this run's, every file must have its size and sha256. (A digest without a key finds
  damage and mix-ups, not forgery: whoever can write the shards can write the digests.)
* load_metadata(path): `.metadata` unpickled with an allow-list: only DCP's metadata classes,
  torch.Size, torch's dtypes and layouts, and a path. Anything else (builtins.eval,
  os.system, ...) is refused before it is called. The launcher reads `.metadata` this way,
  and so does every rank: Reader, the FileSystemReader each rank hands dcp.load, which also
  checks each file's sha256 before reading it and names the file when torch.load refuses it.
  `.metadata` may mark an entry as bytes, which DCP's own planner unpickles with
  torch.load(weights_only=False): bytes are refused except the optimizer's param_groups, and
  Planner (each rank's) reads those with weights_only=True.
* files, needed_bytes, full_state_bytes, show_files, show_losses, show_resumed,
  show_resharding: what the lesson prints.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from common import fail

from checkpoint_trust import (MANIFEST, CheckpointError, Planner, Reader, _first_line,  # noqa: F401
                              load_metadata, made_by, problem, sha256, verify, write_manifest)  # (the lesson's too)

_held: dict[str, int] = {}  # folder -> fd of its lock, held until this process ends


# --- saving beside, then renaming into place ---------------------------------------------------

def _beside(folder: Path) -> tuple[Path, Path]:
    folder = Path(os.path.abspath(folder))  # "ckpt/." has a name: "ckpt"
    return folder.with_name(folder.name + ".saving"), folder.with_name(folder.name + ".old")


def _is_checkpoint_file(name: str) -> bool:
    return name in (".metadata", MANIFEST) or name.endswith((".distcp", ".metadata.tmp"))


def tidy(*folders: Path) -> None:
    """What a killed save left beside each folder (ours: we hold its lock): an earlier
    checkpoint moved aside and not back goes back; the temporary folders go."""
    for folder in map(Path, folders):
        saving, old = _beside(folder)
        with contextlib.suppress(OSError):
            if old.is_dir() and not folder.exists():
                old.rename(folder)  # killed between the two renames: the earlier one, whole
        for leftover in (saving, old):
            shutil.rmtree(leftover, ignore_errors=True)


def _lock(folder: Path, flag: str) -> None:
    """Hold `.<name>.lock` beside the folder until this process ends (flock: the kernel lets
    go however the process dies). Beside, not inside: the folder itself is replaced."""
    from apparatus.results import hold_fd  # flock, or msvcrt on Windows

    folder = Path(os.path.abspath(folder))
    key = str(folder.resolve())
    if key not in _held:  # (an OSError of open: claim_folder says it cannot be written)
        fd = os.open(folder.with_name(f".{folder.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        _held[key] = hold_fd(fd, f"{flag} {folder}")


def claim_folder(folder: Path, flag: str) -> None:
    """One line now, not after training, if a save into `folder` could not work; then the
    folder is this job's alone, and what a killed save left beside it is tidied."""
    folder = Path(folder)
    where = f"{flag} {folder}"
    if not Path(os.path.abspath(folder)).name:
        fail(f"{where} is the root of the file system; pass a folder for the checkpoint")
    try:
        if folder.exists() and not folder.is_dir():
            fail(f"{where} is a file, not a folder; pass a folder (it is created if missing)")
        folder.parent.mkdir(parents=True, exist_ok=True)
        _lock(folder, flag)
        tidy(folder)
        others = sorted(p.name for p in folder.iterdir() if not _is_checkpoint_file(p.name)) \
            if folder.is_dir() else []
        if others:
            fail(f"{where} holds files that are not a checkpoint's ({', '.join(others[:3])}); a "
                 f"save replaces the whole folder: pass a new or empty folder, or a checkpoint's")
        saving, _ = _beside(folder)
        saving.mkdir()  # can we write beside it? (rmdir: the save makes it again)
        saving.rmdir()
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        fail(f"{where} cannot be written ({exc.strerror or exc}); pass a folder you can write to")


def claim(args, out: Path) -> None:
    """In the launcher, before any rank starts: the folders this run saves into, checked and
    locked; then the --resume folder, checked (problem). One line for anything wrong."""
    claim_folder(args.checkpoint, "--checkpoint")
    claim_folder(Path(out) / "checkpoint-async", "--out")
    if args.resume:
        try:
            found = problem(args.resume, args)
        except OSError as exc:  # a folder or file we may not read, a file where a folder should be
            found = (f"--resume {args.resume} cannot be read ({exc.strerror or exc}"
                     f"{': ' + Path(exc.filename).name if exc.filename else ''}); pass a checkpoint you can read")
        if found:
            fail(found)


@contextlib.contextmanager
def save_beside(folder: Path, args, step: int):
    """Yield `<folder>.saving` for dcp.save or dcp.async_save to write into. When every rank
    has written, rank 0 writes checkpoint.json there and renames the folder into place (the
    earlier checkpoint aside first, deleted last). Any error before that: CheckpointError,
    one line, and `folder` holds what it held before."""
    import torch.distributed as dist

    folder = Path(folder)
    saving, old = _beside(folder)
    try:
        yield saving
        dist.barrier()  # every rank's files are written
        if dist.get_rank() == 0:
            write_manifest(saving, {**made_by(args), "step": step, "world_size": dist.get_world_size()})
            if folder.exists():
                folder.rename(old)  # the earlier checkpoint, whole, out of the way
            saving.rename(folder)  # the new one, whole, in place: a rename is atomic
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()  # nobody reads `folder` before it is in place
    except (Exception, CheckpointException) as exc:
        if dist.get_rank() == 0:
            tidy(folder)
        raise CheckpointError(f"could not save {folder} ({_first_line(exc)}); it still holds "
                              f"what it held before; free some space, or pass another folder") from None


# --- what the lesson prints --------------------------------------------------------------------

def files(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in Path(folder).iterdir() if p.is_file())


def needed_bytes(metadata) -> dict[str, int]:
    """{file: the least size it must have}, from the byte ranges .metadata lists."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():  # MetadataIndex -> _StorageInfo
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def full_state_bytes(n_params: int) -> int:
    """fp32 weights (4 bytes) + AdamW's exp_avg and exp_avg_sq (8 bytes) per parameter."""
    return 12 * n_params


def check(args):
    """Lesson 16's flags, checked in the launcher before anything is read or written; the
    checkpoint goes into --out's folder unless --checkpoint says otherwise."""
    from apparatus.results import out_dir

    if args.stop_at_step and args.stop_at_step >= args.steps:
        fail(f"--stop-at-step {args.stop_at_step} must come before the last step (--steps {args.steps})")
    if args.checkpoint is None:
        args.checkpoint = out_dir("16", args.out) / "checkpoint"
    return args


def show_files(ui, folder: Path, model, seconds: float) -> list[tuple[str, int]]:
    """The files dcp.save wrote and their sizes; what gathering the full state would cost."""
    from apparatus.results import shown

    listing = files(folder)
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    ui.table(f"What dcp.save wrote to {shown(Path(folder))} in {seconds:.2f}s", ["file", "bytes"],
             [[name, f"{size:,}"] for name, size in listing])
    ui.print(f"{MANIFEST}, written last: --seed {manifest['seed']}, {manifest['strategy']}, step "
             f"{manifest['step']} on {manifest['world_size']} ranks, and each file's size and sha256")
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


def show_resharding(ui, model) -> dict[str, bool]:
    """{FSDP group: whether it frees its gathered parameters after forward}, read from FSDP2's
    own state once a forward has run: the root, left at reshard_after_forward=None, gets no
    post-forward mesh at its lazy init (torch 2.14.1, fsdp/_fully_shard/_fsdp_state.py:
    `post_forward_mesh_info = None`), so it is gathered once per step and kept for backward."""
    groups = {name or "root": module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
              for name, module in model.named_modules() if hasattr(module, "_get_fsdp_state")}
    freed, kept = ([k for k, v in groups.items() if v == flag] for flag in (True, False))
    ui.print(f"after forward, resharded (gathered again in backward): {', '.join(freed) or 'none'}; "
             f"kept gathered for backward: {', '.join(kept) or 'none'}")
    return groups
