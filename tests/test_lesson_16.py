"""Lesson 16: distributed checkpoints, run as a learner would.

One run on 2 ranks stops after step 3 of 6 and leaves a DCP checkpoint; one run on 3 ranks
resumes from it (DCP reshards 2 -> 3) and must end with the uninterrupted run's weights
(lesson 13's reference, within 1e-3) and print its losses beside the reference's. The bad
checkpoints (a missing shard, a truncated or overwritten one, another model's) are caught in the launcher
before any rank starts, so they are checked in-process: one line, exit 2, nothing changed.
"""
import hashlib
import shutil
import warnings

import pytest
import torch

from common import transformer as T
from apparatus.state_dicts import load_into
from conftest import import_lesson, load_run, max_abs_diff, parse_error, run_lesson

STEPS, STOP = 6, 3


@pytest.fixture(scope="module")
def reference():
    return T.train_reference(T.SEED, STEPS)  # computed (or read) once, before the ranks need it


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference):
    base = tmp_path_factory.mktemp("lesson16")
    ckpt = base / "ckpt"
    stopped = run_lesson("16", "--device", "cpu", "--world-size", 2, "--steps", STEPS,
                         "--stop-at-step", STOP, "--checkpoint", ckpt, "--out", base / "stopped",
                         timeout=240)
    saved = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    resumed = run_lesson("16", "--device", "cpu", "--world-size", 3, "--steps", STEPS,
                         "--resume", ckpt, "--checkpoint", base / "ckpt3", "--out", base / "resumed",
                         timeout=240)
    return {"base": base, "ckpt": ckpt, "saved": saved, "stopped": stopped.stdout,
            "resumed": resumed.stdout}


def test_stopped_run_leaves_one_shard_per_rank_and_no_results(runs):
    names = sorted(runs["saved"])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"], names  # 2 ranks, 2 files
    out = runs["stopped"]
    for name, data in runs["saved"].items():  # the lesson lists each file with its size
        assert name in out and f"{len(data):,}" in out
    assert not (runs["base"] / "stopped" / "final.pt").exists()
    assert f"--resume {runs['ckpt']}" in out and "Step 7" not in out  # saved, and exited


def test_resumed_at_three_ranks_ends_with_the_uninterrupted_weights(runs, reference):
    state, metrics = load_run(runs["base"] / "resumed")
    diff = max_abs_diff(state, reference["state"])
    assert diff <= 1e-3 and metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff)
    assert metrics["world_size"] == 3 and metrics["start_step"] == STOP
    # the losses of steps 4-6, beside the uninterrupted run's, printed and kept
    ref = reference["losses"][STOP:].tolist()
    assert metrics["losses"] == pytest.approx(ref, abs=1e-4)
    assert metrics["reference_losses"] == pytest.approx(ref, abs=1e-12)
    assert not {"memory_bytes", "per_rank_bytes", "activations_bf16_bytes"} & set(metrics)  # lessons 13, 15's
    out = runs["resumed"]
    assert "resumed after step 3 on 3 ranks" in out and "AdamW's step counter" in out
    assert ": 3" in out.split("AdamW's step counter")[1].splitlines()[0]  # restored, not 0
    for loss in ref:
        assert f"{loss:.6f}" in out
    assert sorted(p.name for p in (runs["base"] / "ckpt3").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert "returned a Future" in out


def test_converted_checkpoint_loads_into_a_plain_model(runs):
    state, _ = load_run(runs["base"] / "resumed")
    converted = torch.load(runs["base"] / "resumed" / "from-dcp.pt", weights_only=True)
    assert set(converted) == {"model", "optim", "step"} and int(converted["step"]) == STEPS
    model = T.make_model(seed=1)
    load_into(model, converted["model"])
    assert max_abs_diff(model.state_dict(), state) == 0.0
    assert "max |w - final| = 0.0e+00" in runs["resumed"]


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("damage", ["missing", "truncated", "overwritten", "other model"])
def test_bad_checkpoint_is_one_line_and_left_as_it_was(runs, tmp_path, monkeypatch, capsys, damage):
    folder = tmp_path / "ckpt"
    if damage == "other model":
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": torch.nn.Linear(4, 4).state_dict(), "step": torch.tensor(1)},
                     checkpoint_id=folder, no_dist=True)
    else:
        shutil.copytree(runs["ckpt"], folder)
        shard = folder / "__1_0.distcp"
        if damage == "missing":
            shard.unlink()
        elif damage == "truncated":
            shard.write_bytes(runs["saved"]["__1_0.distcp"][:1000])
        else:  # the same length, its first bytes overwritten
            shard.write_bytes(b"x" * 64 + runs["saved"]["__1_0.distcp"][64:])
    before = _digest(folder)
    lesson = import_lesson("16")
    line = parse_error(lesson, ["--steps", str(STEPS), "--resume", str(folder)], monkeypatch, capsys)
    expected = {"missing": "__1_0.distcp is missing", "truncated": "__1_0.distcp is 1,000 bytes",
                "overwritten": "__1_0.distcp is damaged", "other model": "a checkpoint of another model"}[damage]
    assert expected in line, line
    assert _digest(folder) == before


def test_bad_checkpoint_from_the_command_line_has_no_traceback(runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    (folder / "__0_0.distcp").unlink()
    proc = run_lesson("16", "--resume", folder, check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "__0_0.distcp is missing" in proc.stderr


def test_stop_at_step_must_come_before_the_end(monkeypatch, capsys):
    line = parse_error(import_lesson("16"), ["--steps", "5", "--stop-at-step", "5"], monkeypatch, capsys)
    assert "--stop-at-step 5" in line


def test_world_size_follows_part_2s_rule(monkeypatch, capsys):
    line = parse_error(import_lesson("16"), ["--world-size", "5"], monkeypatch, capsys)
    assert "--world-size must divide the global batch of 48 rows" in line and "1, 2, 3, 4, 6, 8" in line
