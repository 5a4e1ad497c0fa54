"""What an install costs on disk, measured: a virtual environment's size, split into the CUDA
libraries (PyPI's torch wheel depends on nvidia-*, cuda-* and triton), torch itself,
torchvision and the rest. README's "Installing for a classroom" gives these numbers, and
tests/test_install_costs.py checks them against this repository's own .venv.

    .venv/bin/python tools/install_costs.py              # this repository's .venv
    .venv/bin/python tools/install_costs.py /tmp/cpuvenv # any other venv (e.g. a CPU-only one)

Sizes are the files' own sizes (what `du --apparent-size` counts), in GB of 10^9 bytes, read
from each installed distribution's RECORD (importlib.metadata), so a package is counted with
everything it installed, wherever it put it.
"""
from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def group(name: str) -> str:
    """The CUDA libraries, torch, torchvision, or the rest (numpy, sympy, matplotlib, ...)."""
    name = name.lower()
    if name.startswith(("nvidia-", "cuda-")) or name == "triton":
        return "CUDA libraries"
    return name if name in ("torch", "torchvision") else "the rest"


def measure(venv: Path) -> dict[str, int]:
    """Bytes per group, and "total": every file under the venv (pip, the interpreter links...)."""
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    if not sites:
        raise SystemExit(f"error: {venv} has no lib/python3*/site-packages; is it a virtual environment?")
    out = {"CUDA libraries": 0, "torch": 0, "torchvision": 0, "the rest": 0}
    for dist in metadata.distributions(path=[str(s) for s in sites]):
        base, name = Path(dist.locate_file("")), group(dist.metadata["Name"])
        for f in dist.files or []:
            try:
                out[name] += (base / f).lstat().st_size
            except OSError:  # RECORD lists .pyc files that were never written
                pass
    out["total"] = sum(os.lstat(os.path.join(d, f)).st_size
                       for d, _, files in os.walk(venv) for f in files)
    return out


def main(argv: list[str]) -> int:
    venv = Path(argv[0]) if argv else ROOT / ".venv"
    sizes = measure(venv)
    print(f"{venv}: {sizes['total'] / 1e9:.1f} GB on disk")
    for name, size in sizes.items():
        if name != "total":
            print(f"  {name:<15} {size / 1e9:5.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
