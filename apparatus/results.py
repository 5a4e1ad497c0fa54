"""What every training lesson leaves behind: runs/lesson-NN/final.pt and metrics.json.

Both are written atomically: first to a temporary file in the same folder, then renamed.
A rename within one file system is atomic, so a reader (or a crash) never sees half a file.
metrics.json is written last and names the sha256 of the final.pt it belongs to, so a
final.pt from one run next to a metrics.json from another is detectable (`matching_pair`).
A job first claims its folder (`claim_out`): a lock held until the process ends, so a
second job on the same --out stops at once instead of mixing files with the first.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from apparatus.state_dicts import unwrap  # lesson 09 explains the wrappers
from common import max_abs_diff  # noqa: F401  (the lessons import it from here, with the rest)
from common.cli import ROOT, fail

try:  # POSIX (Linux, macOS)
    import fcntl
except ImportError:  # native Windows: the standard library's msvcrt locks a byte instead
    fcntl = None
    import msvcrt

LOCK_NAME = ".lock"
LOCK_ENV = "LESSON_OUT_LOCKED"  # a launcher that holds the lock tells its ranks so
_held: dict[str, int] = {}  # folder -> fd of the lock this process holds (until it exits)


def out_dir(lesson: str, out: Path | None) -> Path:
    """--out if given, else runs/lesson-NN under the repository (wherever you run from).
    `--out ""` (which Path reads as ".") is refused: the run's files among your own."""
    if out is not None and Path(out) == Path("."):
        fail('--out is empty (or "."): the run\'s final.pt, metrics.json and lock would land among '
             'the files of the current folder; pass a folder of its own, e.g. --out runs/my-try')
    return Path(out) if out is not None else ROOT / "runs" / f"lesson-{lesson}"


def check_out(folder: Path) -> Path:
    """Create the output folder now, or one clear line: a file in the way, no permission,
    a name too long. Found at start-up, not after training."""
    folder = Path(folder)
    what = f"--out {folder}"
    for part in folder.parts:
        if len(part.encode()) > 255:
            fail(f"{what}: the name {part[:20]}... is longer than 255 bytes; use a shorter one")
    if len(os.fsencode(folder.resolve())) > 4000:
        fail(f"{what}: the path is too long; use a shorter one")
    if folder.exists() and not folder.is_dir():
        fail(f"{what} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        fail(f"{what}: a file is in the way of that folder; pass another --out")
    except OSError as exc:
        fail(f"{what} cannot be created ({exc.strerror}); pass a folder you can write to")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"{what} is not writable; pass a folder you can write to")
    try:  # a full disk still takes an empty file (and root ignores permissions): write data now
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(bytes(1 << 16))
            probe.flush()
    except OSError as exc:
        fail(f"{what} cannot be written ({exc.strerror}); free some space or pass another --out")
    return folder


def claim_out(folder: Path) -> Path:
    """check_out, then take the folder's lock for as long as this process lives.

    flock is released by the kernel when the process dies however it dies, so a lock is
    never left stale; a second job that finds it held fails with one line naming the owner.
    """
    folder = check_out(folder)
    key = str(folder.resolve())
    if key in _held or os.environ.get(LOCK_ENV) == key:
        return folder  # ours already, or held for us by the launcher that started us
    _held[key] = hold_lock(folder / LOCK_NAME, f"--out {folder}")
    os.environ[LOCK_ENV] = key  # the ranks this job starts write here too: held for them
    return folder


def hold_lock(path: Path, what: str) -> int:
    """Lock the file `path` for as long as this process lives (its fd, kept open), or one
    line naming the job that holds it: `what` is the flag and value the learner passed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        fail(f"{what}: cannot create {Path(path).name} ({exc.strerror}); pass a folder you can write to")
    return hold_fd(fd, what)


def hold_fd(fd: int, what: str) -> int:
    """hold_lock for a lock file you opened yourself."""
    flag = what.split()[0]
    try:
        _lock(fd)
    except OSError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        fail(f"{what} is in use by another job (pid {owner}); wait for it to finish, "
             f"or pass another {flag}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _lock(fd: int) -> None:
    """Take fd's lock now or raise OSError; the kernel releases it when the process ends."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_strays(folder: Path, name: str, older_than_s: float = 0.0) -> list[Path]:
    """Delete temporary files `.name.*.tmp` that a killed write left behind."""
    gone = []
    for stray in Path(folder).glob(f".{name}.*.tmp"):
        try:
            if time.time() - stray.stat().st_mtime >= older_than_s:
                stray.unlink()
                gone.append(stray)
        except FileNotFoundError:
            pass
    return gone


class _Recorded:
    """A file's write and flush that remember the OSError they raised: torch.save turns a full
    disk into a C++ message (RuntimeError "[enforce fail at inline_container.cc:672] ...
    unexpected pos", torch 2.14.1), which names neither the disk nor the reason."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        try:
            return self.f.flush()
        except OSError as exc:
            self.error = exc
            raise


def atomic_write(path: Path, write) -> None:
    """Call write(file_object) on a temporary file, then rename it over `path`.

    The file gets the usual mode (0644 with the usual umask), not mkstemp's 0600. A full
    disk or another OS error is one clear line, not a traceback, also when torch.save
    reported it as a RuntimeError.
    """
    os.replace(_written_beside(path, write), path)  # atomic: the old file or the new one, never half


def _written_beside(path: Path, write) -> str:
    """write(file_object) into a temporary file beside `path`, on disk: its name. On any
    error it is removed, and a full disk (or no permission) is one line (exit code 1)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    recorded = None
    try:
        with os.fdopen(fd, "wb") as f:
            recorded = _Recorded(f)
            write(recorded)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        return tmp
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = exc if isinstance(exc, OSError) else getattr(recorded, "error", None)
        if isinstance(exc, Exception) and isinstance(cause, OSError) and cause.errno in (
                errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO, errno.EFBIG):
            fail(f"could not write {shown(path, markup=False)} ({cause.strerror}); free some space or pass another "
                 f"--out (nothing was left half-written)", code=1)
        raise


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the weights without wrapper prefixes (DDP's `module.`, compile's `_orig_mod.`)."""
    model = unwrap(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_results(folder: Path, state_dict: dict[str, torch.Tensor], metrics: dict) -> None:
    """final.pt, then metrics.json naming final.pt's sha256: a pair from one run, or a
    detectable mismatch if a kill fell between the two renames. Both are written in full
    before either is renamed: a full disk leaves the earlier pair as it was."""
    folder = Path(folder)
    for name in ("final.pt", "metrics.json"):
        remove_strays(folder, name)
    weights = _written_beside(folder / "final.pt", lambda f: torch.save(state_dict, f))
    try:
        text = json.dumps({**metrics, "final_pt_sha256": sha256(weights)}, indent=2) + "\n"
        numbers = _written_beside(folder / "metrics.json", lambda f: f.write(text.encode()))
    except BaseException:
        os.unlink(weights)
        raise
    os.replace(weights, folder / "final.pt")
    os.replace(numbers, folder / "metrics.json")


def matching_pair(folder: Path) -> bool:
    """True when metrics.json belongs to the final.pt next to it (same run)."""
    try:
        metrics = json.loads((Path(folder) / "metrics.json").read_text())
        return metrics.get("final_pt_sha256") == sha256(Path(folder) / "final.pt")
    except (OSError, ValueError):
        return False


def make_metrics(*, lesson: str, world_size: int, backend: str, device: str,
                 losses: list[float], final_accuracy: float, wall_seconds: float,
                 samples: int, **extra) -> dict:
    """The fields every lesson's metrics.json has; lessons add their own with **extra."""
    return {
        "lesson": lesson,
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "losses": [round(x, 6) for x in losses],
        "final_accuracy": final_accuracy,
        "wall_seconds": round(wall_seconds, 3),
        "samples_per_second": round(samples / wall_seconds, 1) if wall_seconds > 0 else None,
        **extra,
    }


def shown(path: Path, markup: bool = True) -> str:
    """A path as the learner typed it: relative to the current folder when inside it. For
    rich's print (markup=True) its brackets are escaped: a path is text, and `--out "a[/]b"`
    crashed lesson 13 with rich's MarkupError after it had trained; markup=False for plain
    text (an error line)."""
    try:
        text = str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        text = str(path)
    if not markup:
        return text
    from rich.markup import escape
    return escape(text)
