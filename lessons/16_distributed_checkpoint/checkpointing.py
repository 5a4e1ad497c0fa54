"""Lesson 16's instruments: a checkpoint that is whole, is the one you meant, and runs no code.

DCP (torch 2.14.1) writes its files into the folder you name, in place, and keeps no record
of what made them. So an interrupted save leaves cut shards beside the old `.metadata`, a
shard from another run loads without a word, and `.metadata` is a pickle (filesystem.py:
pickle.load), which can run any code as it loads. This module closes those three holes:

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
* files, needed_bytes, full_state_bytes, show_files, show_losses, show_resumed: what the
  lesson prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from common import fail

MANIFEST = "checkpoint.json"
RECIPE = ("VOCAB", "SEQ", "DIM", "N_HEADS", "N_BLOCKS", "MLP_DIM", "GLOBAL_BATCH", "LR", "EPS",
          "TABLE_SEED", "SHARPNESS")  # common/transformer.py: what the weights mean
_held: dict[str, int] = {}  # folder -> fd of its lock, held until this process ends


class CheckpointError(Exception):
    """A checkpoint we will not read or could not write; the message is the one line."""


# --- .metadata: a pickle, read with an allow-list ----------------------------------------------

_DCP = "torch.distributed.checkpoint"
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
ALLOWED = {  # module -> names: what torch 2.14.1's dcp.save puts in .metadata (plus the paths)
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                         "StorageMeta", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.filesystem": {"_StorageInfo"},  # where each piece lies: file, offset, length
    "torch": {"Size"},  # and every dtype (torch.float32 ...), below
    "torch.serialization": {"_get_layout"},  # torch.strided, looked up by name
    "pathlib": _PATHS, "pathlib._local": _PATHS,  # StorageMeta.checkpoint_id (Python 3.13: _local)
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict what a pickle may name ("Restricting Globals"):
    every class or function a pickle calls goes through find_class first."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.where} names {module}.{name}, which is not one of DCP's metadata classes; a "
            f"pickle can run any code as it loads, so it was not loaded: pass a checkpoint you made")


def load_metadata(path: Path, where: str | None = None) -> Metadata:
    """DCP's Metadata from `path`, unpickled with the allow-list; CheckpointError if not."""
    where = where or str(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged pickle fails in many ways
        raise CheckpointError(f"{where} cannot be read ({_first_line(exc)}); save the checkpoint "
                              f"again") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata; "
                              f"save the checkpoint again")
    return metadata


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # DCP gathers each rank's error: name the first
        exc = next(iter(exc.failures.values()))[0]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    refused = re.search(r"WeightsUnpickler error: (.*?\.)(?: |$)", str(exc), re.M)
    if refused:  # torch.load(weights_only=True)'s reason, without its six lines of advice
        return f"torch.load with weights_only=True refused it: {refused[1]}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --- checkpoint.json: what made the checkpoint, and each file's digest -------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def made_by(args) -> dict:
    """What a resume must share with the run that saved: the seed (the weights, the batches),
    the strategy and the recipe."""
    from common import transformer as T

    return {"seed": args.seed, "strategy": args.strategy,
            "recipe": {name: getattr(T, name) for name in RECIPE}}


def write_manifest(folder: Path, manifest: dict) -> None:
    """checkpoint.json, after every other file of the folder: their sizes and sha256."""
    folder = Path(folder)
    manifest["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                         for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    with open(folder / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())  # on disk before the folder is renamed into place


def read_manifest(folder: Path, where: str) -> dict:
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{where} has no {MANIFEST}, so it is not a finished checkpoint of "
                              f"this lesson (a save that was interrupted, or one made elsewhere); "
                              f"pass a folder that a run with --checkpoint DIR saved")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert all(isinstance(manifest[k], int) for k in ("seed", "step", "world_size"))
        assert isinstance(manifest["recipe"], dict) and isinstance(manifest["strategy"], str)
        assert all(_plain_name(name) and isinstance(v["bytes"], int) and isinstance(v["sha256"], str)
                   for name, v in files.items())
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not the JSON this lesson writes"
        raise CheckpointError(f"{where}: its {MANIFEST} cannot be read ({why}); save the "
                              f"checkpoint again") from None
    return manifest


def _plain_name(name: str) -> bool:  # a file of the folder itself, no path into another one
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name \
        and "\\" not in name


def file_problem(folder: Path, name: str, manifest: dict, where: str) -> str | None:
    """None if `name` is the file the save wrote (its size and sha256), else one sentence."""
    want = manifest["files"].get(name) if _plain_name(name) else None
    path = Path(folder) / name
    if want is None:
        return f"{where}: {name} is not one of the files its {MANIFEST} lists; save the checkpoint again"
    if not path.is_file():
        return (f"{where}: {name} is missing ({MANIFEST} lists {len(manifest['files'])} "
                f"files); the checkpoint is incomplete: copy every file, or save it again")
    size = path.stat().st_size
    if size != want["bytes"]:
        why = "cut short: an interrupted copy?" if size < want["bytes"] else "not the file that was saved"
        return (f"{where}: {name} is {size:,} bytes, not the {want['bytes']:,} its {MANIFEST} "
                f"lists ({why}); copy it again, or save the checkpoint again")
    if sha256(path) != want["sha256"]:
        return (f"{where}: {name} is not the file that was saved (its sha256 differs from "
                f"{MANIFEST}'s: damaged, or swapped in from another checkpoint); copy it "
                f"again, or save the checkpoint again")
    return None


# --- the resume, checked in the launcher -------------------------------------------------------

def problem(folder: Path, args) -> str | None:
    """None if this run (args) can resume from `folder`, else one sentence naming what is wrong
    and what to do. Reads, never writes."""
    from common import transformer as T

    folder = Path(folder)
    where = f"--resume {folder}"
    if not folder.is_dir():
        return f"{where} is not a folder; pass the folder a run with --checkpoint DIR saved"
    try:
        manifest = read_manifest(folder, where)
    except CheckpointError as exc:
        return str(exc)
    for key, flag in (("seed", "--seed"), ("strategy", "--strategy")):
        if manifest[key] != getattr(args, key):
            return (f"{where} was made with {flag} {manifest[key]}; this run has {flag} "
                    f"{getattr(args, key)}: pass {flag} {manifest[key]}, or another checkpoint")
    mine = made_by(args)["recipe"]
    for key in RECIPE:
        if manifest["recipe"].get(key) != mine[key]:
            return (f"{where} was made with another recipe ({key} = {manifest['recipe'].get(key)}; "
                    f"common/transformer.py now has {mine[key]}): resume it with the code that "
                    f"saved it, or pass another checkpoint")
    step = manifest["step"]
    if step >= args.steps:
        return f"{where} was saved after step {step}; pass --steps above {step}"
    if args.stop_at_step and args.stop_at_step <= step:
        return (f"{where} was saved after step {step}, so --stop-at-step {args.stop_at_step} "
                f"has passed already; pass a --stop-at-step above {step}, or none")
    for name in sorted(manifest["files"]):
        found = file_problem(folder, name, manifest, where)
        if found:
            return found
    if ".metadata" not in manifest["files"]:
        return f"{where} has no .metadata in its {MANIFEST}; save the checkpoint again"
    try:
        metadata = load_metadata(folder / ".metadata", f"{where}: its .metadata")
    except CheckpointError as exc:
        return str(exc)
    for info in metadata.storage_data.values():  # every piece lies in a file the manifest names
        if getattr(info, "relative_path", None) not in manifest["files"]:
            return (f"{where}: its .metadata points to {getattr(info, 'relative_path', info)!r}, "
                    f"which is not one of its files; save the checkpoint again")
    saved = {k[len("model."):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    wanted = {k: tuple(v.shape) for k, v in T.make_model(args.seed).state_dict().items()}
    if saved != wanted:
        odd = sorted(set(saved) ^ set(wanted)) or [k for k in wanted if saved[k] != wanted[k]]
        return (f"{where} is a checkpoint of another model ({len(saved)} saved weights, this "
                f"model has {len(wanted)}; first difference: {odd[0]}); resume with the "
                f"model that saved it")
    if "step" not in metadata.state_dict_metadata:
        return f"{where} has no training step saved; it was not written by this lesson"
    return None


class Reader(FileSystemReader):
    """DCP's FileSystemReader, as each rank hands it to dcp.load, with the launcher's checks
    made again where it reads (a file may have changed since): checkpoint.json first,
    .metadata through the allow-list, each file's sha256 before torch.load reads it
    (weights_only=True, filesystem.py), and an error that names the file."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.folder, self.where = Path(folder), f"--resume {folder}"
        self.manifest = read_manifest(self.folder, self.where)

    def verify(self, name: str) -> None:
        found = file_problem(self.folder, name, self.manifest, self.where)
        if found:
            raise CheckpointError(found)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.verify(".metadata")
        metadata = load_metadata(self.folder / ".metadata", f"{self.where}: its .metadata")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):  # one file at a time, so a failure names it
            self.verify(name)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise CheckpointError(f"{self.where}: the shard {name} could not be loaded "
                                      f"({_first_line(exc)}); pass a checkpoint you made") from None
        done: Future = Future()
        done.set_result(None)
        return done


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
