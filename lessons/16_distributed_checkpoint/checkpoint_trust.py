"""Lesson 16's checks on what a checkpoint holds: it is whole, it is the one you meant, and
reading it runs no code (checkpointing.py saves and claims; this module checks).

* checkpoint.json, written last by save_beside: what made the checkpoint (made_by: --seed,
  --strategy, the recipe's constants, the step, the world size) and each file's size and
  sha256. problem(folder, args) checks it all before any rank starts.
* load_metadata(path): `.metadata` unpickled with an allow-list (ALLOWED): only DCP's metadata
  classes, torch.Size, torch's dtypes and layouts, and a path; anything else is refused
  before it is called.
* Reader: the FileSystemReader each rank hands dcp.load, making the same checks where it
  reads, and naming the file when torch.load refuses one.
* Planner: the load planner each rank hands dcp.load. DCP's own (DefaultLoadPlanner) reads
  any entry `.metadata` marks as bytes with torch.load(weights_only=False) (torch 2.14.1,
  default_planner.py:383-393): ours reads them with weights_only=True. And load_metadata
  refuses bytes anywhere but where this lesson saves them (the optimizer's param_groups).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.futures import Future

from apparatus.results import sha256  # the digest results.py writes beside final.pt
from common import transformer as T


MANIFEST = "checkpoint.json"
MANIFEST_LIMIT, METADATA_LIMIT = 1 << 20, 64 << 20  # bytes: far above what this lesson writes
RECIPE = ("VOCAB", "SEQ", "DIM", "N_HEADS", "N_BLOCKS", "MLP_DIM", "GLOBAL_BATCH", "LR", "EPS",
          "TABLE_SEED", "SHARPNESS")  # common/transformer.py: what the weights mean


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


BYTES_UNDER = "optim.param_groups."  # the only entries dcp.save writes as bytes here (lr, betas ...)


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


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes, else OSError: a
    FIFO would wait for a writer forever, /dev/zero never ends. O_NONBLOCK: a FIFO opens at
    once (and is refused); fstat: the file opened, not the one a name pointed to before."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory")
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device, a socket or the like"
            raise OSError(22, f"it is {kind}, not a regular file")
        data = b""
        while len(data) <= limit:  # at most limit + 1 bytes, even if the file grows meanwhile
            more = os.read(fd, limit + 1 - len(data))
            if not more:
                return data
            data += more
        raise OSError(27, f"it has more than {limit:,} bytes, more than this lesson writes")
    finally:
        os.close(fd)


def load_metadata(path: Path, where: str | None = None) -> Metadata:
    """DCP's Metadata from `path`, unpickled with the allow-list; CheckpointError if not."""
    where = where or str(path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(read_regular(path, METADATA_LIMIT)), where).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be read ({exc.strerror or exc}); save the checkpoint "
                              f"again") from None
    except Exception as exc:  # a damaged pickle fails in many ways
        raise CheckpointError(f"{where} cannot be read ({_first_line(exc)}); save the checkpoint "
                              f"again") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict) \
            or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata; "
                              f"save the checkpoint again")
    for fqn, entry in metadata.state_dict_metadata.items():  # bytes: only where we save them
        if isinstance(entry, BytesStorageMetadata) and not str(fqn).startswith(BYTES_UNDER):
            raise CheckpointError(
                f"{where} saves {fqn} as bytes, where this lesson saves a tensor (DCP unpickles "
                f"bytes, and a pickle can run any code), so it was not loaded: pass a checkpoint you made")
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

def made_by(args) -> dict:
    """What a resume must share with the run that saved: the seed (the weights, the batches),
    the strategy and the recipe."""
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
        manifest = json.loads(read_regular(path, MANIFEST_LIMIT))  # not a FIFO, not /dev/zero
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


def verify(folder: Path, where: str) -> None:
    """Raise CheckpointError (one sentence) unless every file checkpoint.json lists is the file
    the save wrote and .metadata passes the allow-list: before a reader that unpickles
    .metadata as it is (dcp_to_torch_save), it then reads bytes known to be harmless."""
    manifest = read_manifest(Path(folder), where)
    for name in sorted(manifest["files"]):
        found = file_problem(Path(folder), name, manifest, where)
        if found:
            raise CheckpointError(found)
    load_metadata(Path(folder) / ".metadata", f"{where}: its .metadata")


# --- the resume, checked in the launcher -------------------------------------------------------

def problem(folder: Path, args) -> str | None:
    """None if this run (args) can resume from `folder`, else one sentence naming what is wrong
    and what to do. Reads, never writes."""
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


class Planner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, except that bytes (the optimizer's lr, betas ...) are read with
    torch.load(weights_only=True): its own load_bytes uses weights_only=False (torch 2.14.1,
    default_planner.py:383-393), which runs whatever a crafted piece's pickle names."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)  # refuses anything but plain data
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
