"""Lesson 05: DDP with mp.spawn gives lesson 01's weights, averages gradients, never hangs.

mp.spawn starts a fresh Python per rank (about 5 CPU s of `import torch` each), and every
epoch trained costs about 1 CPU s twice (the ranks, then rank 0's single-process check), so
the tests share their runs: one per world size, read by the weight checks and by the
clean-exit check. 2 ranks is the lesson's default, run without flags (3 epochs, as
`make lesson-05`); 1 and 3 ranks train 1 epoch (the 3 epochs of the default run cover
sampler.set_epoch). Flag errors are checked in-process, one of them end to end."""
import re
import socket
import time

import pytest

from common import recipe
from conftest import (import_lesson, load_run, max_abs_diff, one_error_line, parse_error,
                      run_lesson)

WORLD_SIZES = [1, 2, 3]
EPOCHS = {1: 1, 2: recipe.EPOCHS, 3: 1}  # world size -> epochs its run trains


@pytest.fixture(scope="module")
def lesson_01_losses(tmp_path_factory):
    """The losses lesson 01 logs, step by step (one run for every world size below)."""
    folder = tmp_path_factory.mktemp("lesson01")
    run_lesson("01", "--out", folder)
    return load_run(folder)[1]["losses"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """ddp_run(n): the lesson's run on n ranks for EPOCHS[n] epochs (proc, folder), run once
    per module and shared by test_ddp_matches_one_device and test_every_run_exits_cleanly.
    n=2 is the lesson's default, so it runs without flags, as `make lesson-05` does."""
    runs = {}

    def get(world_size):
        if world_size not in runs:
            folder = tmp_path_factory.mktemp(f"world{world_size}")
            flags = [] if world_size == 2 else ["--world-size", world_size,
                                                "--epochs", EPOCHS[world_size]]
            runs[world_size] = (run_lesson("05", *flags, "--out", folder, timeout=180), folder)
        return runs[world_size]
    return get


@pytest.fixture(scope="module")
def reference_1_epoch():
    return recipe.train_reference(epochs=1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_matches_one_device(ddp_run, world_size, reference_3_epochs, reference_1_epoch,
                                lesson_01_losses):
    proc, folder = ddp_run(world_size)
    epochs = EPOCHS[world_size]
    state, metrics = load_run(folder)
    assert metrics["world_size"] == world_size and metrics["backend"] == "gloo"
    assert metrics["epochs"] == epochs
    reference = {1: reference_1_epoch, recipe.EPOCHS: reference_3_epochs}[epochs]
    assert max_abs_diff(state, reference) <= 1e-4
    assert metrics["max_abs_diff_vs_single_device"] <= 1e-4  # what the lesson told the learner
    assert metrics["final_accuracy"] > 0.85
    # the logged loss is the global batch's: it matches lesson 01's step by step
    assert len(metrics["losses"]) == len(lesson_01_losses) * epochs // recipe.EPOCHS
    assert max(abs(a - b) for a, b in zip(metrics["losses"], lesson_01_losses)) < 1e-4
    # every rank printed its gradient check, and DDP's gradient equalled the mean of the locals
    gaps = re.findall(r"\|DDP - mean of all ranks' local\| = ([0-9.e+-]+)", proc.stdout)
    assert len(gaps) == world_size and all(float(g) < 1e-6 for g in gaps)
    prefixes = set(re.findall(r"^\[rank (\d+)\]", proc.stdout, re.M))
    assert prefixes == ({str(r) for r in range(world_size)} if world_size > 1 else set())
    assert "'module.fc1.weight'" in proc.stdout


def test_every_run_exits_cleanly(ddp_run):
    """The gloo-at-exit abort (terminate called ...) happened now and then, so it is checked
    on every run this file makes that ends normally: 1 + 2 + 3 ranks leaving the group."""
    for world_size in WORLD_SIZES:
        proc, _ = ddp_run(world_size)
        assert proc.returncode == 0
        assert "terminate called" not in proc.stderr, f"{world_size} ranks: {proc.stderr}"
        assert "every rank left the process group cleanly" in proc.stdout


def test_a_crashing_rank_ends_the_job_promptly(tmp_path):
    start = time.time()
    proc = run_lesson("05", "--crash-rank", "1", "--crash-at-step", "3", "--out", tmp_path,
                      check=False, timeout=120)
    assert time.time() - start < 60
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 failed") and "deliberate crash" in last
    assert not (tmp_path / "final.pt").exists()


BAD_WORLD_SIZES = [("0", "1 or more"), ("-1", "1 or more"), ("abc", "'abc'"), ("2.5", "'2.5'"),
                   ("5", "cannot split the global batch"),
                   ("64", "on one machine; use one of 1, 2, 3, 4, 6, 8, 12, 16")]


@pytest.mark.parametrize("value, expect", BAD_WORLD_SIZES)
def test_bad_world_sizes_are_one_clear_line(value, expect, monkeypatch, capsys):
    """In-process: parse_args() refuses them before anything starts (no Python per case)."""
    line = parse_error(import_lesson("05"), ["--world-size", value], monkeypatch, capsys)
    assert "--world-size" in line and expect in line


def test_a_bad_world_size_is_one_clear_line_from_the_command_line():
    """The same refusal end to end, as the learner sees it: one line, no traceback."""
    line = one_error_line(run_lesson("05", "--world-size", "5", check=False))
    assert "--world-size 5" in line and "cannot split the global batch" in line


def test_busy_port_is_one_clear_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(run_lesson("05", "--master-port", port, check=False))
    assert f"port {port}" in line and "already in use" in line
