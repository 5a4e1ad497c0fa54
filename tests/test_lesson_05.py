"""Lesson 05: DDP with mp.spawn gives lesson 01's weights, averages gradients, never hangs."""
import re
import socket
import time

import pytest

from common import recipe
from conftest import load_run, max_abs_diff, one_error_line, run_lesson


@pytest.fixture(scope="module")
def lesson_01_losses(tmp_path_factory):
    """The losses lesson 01 logs, step by step (one run for every world size below)."""
    folder = tmp_path_factory.mktemp("lesson01")
    run_lesson("01", "--out", folder)
    return load_run(folder)[1]["losses"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ddp_matches_one_device(tmp_path, world_size, reference_3_epochs, lesson_01_losses):
    proc = run_lesson("05", "--world-size", world_size, "--out", tmp_path, timeout=180)
    assert "terminate called" not in proc.stderr, proc.stderr  # see the test below
    state, metrics = load_run(tmp_path)
    assert metrics["world_size"] == world_size and metrics["backend"] == "gloo"
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    assert metrics["max_abs_diff_vs_single_device"] <= 1e-4  # what the lesson told the learner
    assert metrics["final_accuracy"] > 0.85
    # the logged loss is the global batch's: it matches lesson 01's step by step
    assert max(abs(a - b) for a, b in zip(metrics["losses"], lesson_01_losses)) < 1e-4
    # every rank printed its gradient check, and DDP's gradient equalled the mean of the locals
    gaps = re.findall(r"\|DDP - mean of all ranks' local\| = ([0-9.e+-]+)", proc.stdout)
    assert len(gaps) == world_size and all(float(g) < 1e-6 for g in gaps)
    prefixes = set(re.findall(r"^\[rank (\d+)\]", proc.stdout, re.M))
    assert prefixes == ({str(r) for r in range(world_size)} if world_size > 1 else set())
    assert "'module.fc1.weight'" in proc.stdout


def test_two_ranks_exit_cleanly_every_time(tmp_path):
    """The gloo-at-exit abort (terminate called ...) must never happen: run it several times
    (test_ddp_matches_one_device checks three more runs)."""
    for attempt in range(2):
        proc = run_lesson("05", "--epochs", "1", "--out", tmp_path / str(attempt), timeout=120)
        assert "terminate called" not in proc.stderr, f"attempt {attempt}: {proc.stderr}"
        assert max_abs_diff(load_run(tmp_path / str(attempt))[0],
                            recipe.train_reference(epochs=1)) <= 1e-4


def test_a_crashing_rank_ends_the_job_promptly(tmp_path):
    start = time.time()
    proc = run_lesson("05", "--crash-rank", "1", "--crash-at-step", "3", "--out", tmp_path,
                      check=False, timeout=120)
    assert time.time() - start < 60
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 failed") and "deliberate crash" in last
    assert not (tmp_path / "final.pt").exists()


@pytest.mark.parametrize("value, expect", [("0", "1 or more"), ("-1", "1 or more"),
                                           ("abc", "'abc'"), ("2.5", "'2.5'"),
                                           ("5", "cannot split the global batch"),
                                           ("64", "on one machine; use one of 1, 2, 3, 4, 6, 8, 12, 16")])
def test_bad_world_sizes_are_one_clear_line(value, expect):
    line = one_error_line(run_lesson("05", "--world-size", value, check=False))
    assert "--world-size" in line and expect in line


def test_busy_port_is_one_clear_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(run_lesson("05", "--master-port", port, check=False))
    assert f"port {port}" in line and "already in use" in line
