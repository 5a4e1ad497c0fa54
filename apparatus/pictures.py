"""The lessons' pictures: matplotlib without a window (files only), and save_figure, which
writes each PNG beside its place and renames it in, so an interrupted run leaves the old
picture, never half of one. No torch here: the picture scripts only read a run's metrics.json."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no window: files only
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, to: Path, dpi: int = 90) -> str:
    """Lay the figure out, write it to `to` (beside, then renamed), close it: "wrote PATH"."""
    to = Path(to)
    to.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fd, part = tempfile.mkstemp(dir=to.parent, prefix=f".{to.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=dpi, format="png")
        os.chmod(part, 0o644)
        os.replace(part, to)
    finally:
        plt.close(fig)
        if os.path.exists(part):
            os.unlink(part)
    try:
        return f"wrote {to.resolve().relative_to(Path.cwd())}"
    except ValueError:
        return f"wrote {to}"
