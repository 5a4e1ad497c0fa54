"""What every training lesson leaves behind: runs/lesson-NN/final.pt and metrics.json.

Both are written atomically: first to a temporary file in the same folder, then renamed.
A rename within one file system is atomic, so a reader (or a crash) never sees half a file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from common.cli import ROOT


def out_dir(lesson: str, out: Path | None) -> Path:
    """--out if given, else runs/lesson-NN under the repository (wherever you run from)."""
    return Path(out) if out is not None else ROOT / "runs" / f"lesson-{lesson}"


def atomic_write(path: Path, write) -> None:
    """Call write(file_object) on a temporary file, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the weights without wrapper prefixes (DDP's `module.`, compile's `_orig_mod.`)."""
    from common.checkpoint import unwrap  # lesson 09 explains the wrappers

    model = unwrap(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def save_results(folder: Path, state_dict: dict[str, torch.Tensor], metrics: dict) -> None:
    atomic_write(folder / "final.pt", lambda f: torch.save(state_dict, f))
    text = json.dumps(metrics, indent=2) + "\n"
    atomic_write(folder / "metrics.json", lambda f: f.write(text.encode()))


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


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state_dicts with the same keys."""
    if a.keys() != b.keys():
        raise KeyError(f"different keys: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def shown(path: Path) -> str:
    """A path as the learner typed it: relative to the current folder when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
