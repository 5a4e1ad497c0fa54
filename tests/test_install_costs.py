"""The install sizes README and TEACHING state (en, zh) are this repository's .venv, measured by tools/install_costs.py."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import install_costs  # noqa: E402

PATTERNS = {  # total, CUDA libraries (and torch): as each page states them
    "README.md": r"takes \*\*([\d.]+) GB\*\* on disk: ([\d.]+) GB of CUDA libraries.*?torch\s+([\d.]+) GB",
    "README.zh.md": r"占 \*\*([\d.]+) GB\*\* 磁盘：([\d.]+) GB 是 CUDA 库.*?torch ([\d.]+) GB",
    "docs/TEACHING.md": r"needs ([\d.]+) GB of disk \(([\d.]+) GB of it CUDA",
    "docs/zh/TEACHING.md": r"占 ([\d.]+) GB 磁盘（其中 ([\d.]+) GB 是",
}


@pytest.fixture(scope="module")
def sizes():
    venv = Path(sys.prefix)
    measured = install_costs.measure(venv)
    if not measured["CUDA libraries"]:
        pytest.skip(f"{venv} is a CPU-only install (no CUDA libraries): README's sizes are the default install's")
    return measured


@pytest.mark.parametrize("readme", sorted(PATTERNS))
def test_stated_sizes_are_the_venvs(sizes, readme):
    text = " ".join((ROOT / readme).read_text(encoding="utf-8").split())
    found = re.search(PATTERNS[readme], text)
    assert found, f"{readme}: the install-size sentence moved; update PATTERNS"
    stated = [float(g) for g in found.groups()]
    measured = [sizes["total"] / 1e9, sizes["CUDA libraries"] / 1e9, sizes["torch"] / 1e9]
    for what, s, m in zip(("total", "CUDA libraries", "torch"), stated, measured):
        assert abs(s - m) <= 0.06 + 0.03 * m, (
            f"{readme} says {what} {s} GB, the .venv holds {m:.2f} GB: "
            "rerun .venv/bin/python tools/install_costs.py and update README (en, zh), TEACHING")


def test_groups():
    assert [install_costs.group(n) for n in ("nvidia-cudnn-cu13", "cuda-bindings", "triton", "Torch", "numpy")] == [
        "CUDA libraries", "CUDA libraries", "CUDA libraries", "torch", "the rest"]
