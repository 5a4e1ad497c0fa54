"""Check exercise 23: the bytes of parameters rank 0 holds, from the shapes alone.

The learner's rank0_bytes(shapes, dp, tp) for lesson 23's tiny model, on a 2 x 2 mesh (where
the parameters tensor parallel leaves whole matter) and on a 256 x 4 one (1,024 ranks, where
FSDP2's ceil(rows / dp) matters), against what lesson 23 measures on rank 0 of a fake process
group: the lesson itself runs (once per mesh; later checks in the same process reuse it).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

STARTER = "exercises/23_rank_bytes.py"
MESHES = ((2, 2), (256, 4))  # (dp, tp)
_measured: dict = {}


def _measure(dp: int, tp: int) -> int:
    """Lesson 23's own measurement: metrics.json's per_rank held_bytes parameters."""
    if (dp, tp) not in _measured:
        from check_exercise import ROOT
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, str(ROOT / "lessons" / "23_cluster_on_a_laptop.py"), "--model", "tiny",
                            "--world-size", str(dp * tp), "--tp", str(tp), "--out", out],
                           cwd=ROOT, capture_output=True, check=True, timeout=300, stdin=subprocess.DEVNULL)
            metrics = json.loads((Path(out) / "metrics.json").read_text())
        _measured[dp, tp] = metrics["per_rank"]["held_bytes"]["parameters"]
    return _measured[dp, tp]


def _shapes() -> dict:
    import torch

    import fake_cluster  # lessons/23_cluster_on_a_laptop/fake_cluster.py

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in fake_cluster.make_model(fake_cluster.SIZES["tiny"]).named_parameters()}


def _answers(module) -> list:
    """In the answer's process: rank0_bytes for each mesh (lesson 23's measurement is the check's)."""
    from check_exercise import NotYet

    out = []
    for dp, tp in MESHES:
        try:
            got = module.rank0_bytes(_shapes(), dp, tp)
        except Exception as exc:  # noqa: BLE001 - the learner's error, in one line
            raise NotYet(f"rank0_bytes(shapes, {dp}, {tp}) raised {type(exc).__name__}: {exc}")
        out.append(got if isinstance(got, (int, float)) and not isinstance(got, bool) else repr(got))
    return out


def check(path: Path) -> str:
    """rank0_bytes(shapes, dp, tp) equals lesson 23's measurement on 2 x 2 and 256 x 4 meshes."""
    import torch

    from check_exercise import NotYet, answer

    shapes = _shapes()
    for (dp, tp), got in zip(MESHES, answer(path, _answers), strict=True):
        want = _measure(dp, tp)
        if got == want:
            continue
        if not isinstance(got, (int, float)):
            raise NotYet(f"rank0_bytes(shapes, {dp}, {tp}) returned {got}; return a number of bytes")
        even = round(4 * sum(torch.Size(s).numel() for s in shapes.values()) / (dp * tp))
        if (dp, tp) == MESHES[0]:
            raise NotYet(f"on a {dp} x {tp} mesh (dp x tp) you said {got:,} bytes, rank 0 holds {want:,}"
                         + (" (parameters x 4 / (dp x tp): an even split over every rank)" if got == even else "") +
                         ": tensor parallel leaves the embeddings, norms, the head and the proj biases whole")
        raise NotYet(f"on a {dp} x {tp} mesh (1,024 ranks) you said {got:,} bytes, rank 0 holds {want:,}: "
                     f"a tensor of 64 rows on {dp} dp ranks still costs rank 0 one whole row "
                     f"(FSDP2: ceil(rows / dp), padded)")
    return (f"rank 0's parameters, {', '.join(f'{_measure(d, t):,} bytes on {d} x {t}' for d, t in MESHES)}, "
            f"equal lesson 23's measurement under the fake process group")
