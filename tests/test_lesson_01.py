"""Lesson 01: run it as a learner would and check what it claims."""
import re

import torch

from common import recipe
from conftest import load_run, make_lesson, max_abs_diff, one_error_line, run_lesson


def test_default_run_learns_and_writes_results(tmp_path, reference_3_epochs):
    proc = make_lesson("01", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    losses = metrics["losses"]
    assert len(losses) == recipe.EPOCHS * recipe.N_TRAIN // recipe.GLOBAL_BATCH
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "loss did not go down"
    assert metrics["final_accuracy"] > 0.85  # chance is 0.25
    for key in ("lesson", "world_size", "backend", "device", "wall_seconds", "samples_per_second"):
        assert key in metrics
    assert metrics["lesson"] == "01" and metrics["world_size"] == 1
    # the lesson's loop and the condensed reference other lessons compare with agree exactly
    assert max_abs_diff(state, reference_3_epochs) == 0.0
    assert all(k.startswith(("fc1.", "fc2.", "head.")) for k in state)  # no wrapper prefix
    assert all(t.device.type == "cpu" for t in state.values())
    # the printed accuracy is the one it saved
    assert f"{metrics['final_accuracy']:.1%}" in proc.stdout


def test_steps_are_printed_in_order(tmp_path):
    out = run_lesson("01", "--epochs", "1", "--out", tmp_path).stdout
    steps = [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5


def test_piped_output_has_no_control_codes(tmp_path):
    out = run_lesson("01", "--epochs", "1", "--out", tmp_path).stdout
    assert "\x1b[" not in out and "\r" not in out
    # without a terminal the progress bar is printed once, finished, not redrawn
    bars = [line for line in out.splitlines() if line.startswith("training ")]
    assert len(bars) == 1 and "32/32" in bars[0], bars


def test_step_mode_without_a_terminal_never_blocks(tmp_path):
    proc = run_lesson("01", "--step", "--epochs", "1", "--out", tmp_path, timeout=60)
    assert "will not pause" in proc.stdout
    assert (tmp_path / "final.pt").exists()


def test_seed_changes_the_result(tmp_path):
    run_lesson("01", "--epochs", "1", "--seed", "1", "--out", tmp_path)
    state, _ = load_run(tmp_path)
    assert max_abs_diff(state, recipe.train_reference(seed=0, epochs=1)) > 1e-3
    assert max_abs_diff(state, recipe.train_reference(seed=1, epochs=1)) == 0.0


def test_bad_flags_are_one_clear_line():
    for flags, expect in ((["--epochs", "0"], "--epochs"), (["--epochs", "abc"], "'abc'"),
                          (["--seed", "-1"], "--seed"), (["--device", "tpu"], "--device"),
                          (["--no-such-flag"], "--no-such-flag")):
        line = one_error_line(run_lesson("01", *flags, check=False))
        assert line.startswith("error:") and expect in line, line


def test_cuda_without_cuda_is_one_clear_line():
    if torch.cuda.is_available():
        import pytest
        pytest.skip("this machine has CUDA, so --device cuda is valid here")
    proc = run_lesson("01", "--device", "cuda", check=False)
    assert proc.returncode == 2
    assert "--device cpu" in one_error_line(proc)
