"""Lesson 11: with one slow worker, asynchronous training gets through the samples faster,
pays with stale gradients, and both still learn; synchronous training stays lesson 01."""
import re
import sys

import pytest

from common import recipe
from conftest import (import_lesson, lesson_path, load_run, make_lesson, max_abs_diff,
                      one_error_line, parse_error, run_lesson, run_with_line_times)


def test_race_with_a_slow_worker(tmp_path, reference_3_epochs):
    proc = make_lesson("11", "--out", tmp_path, timeout=240)
    state, m = load_run(tmp_path)
    sync, asyn = m["modes"]["sync"], m["modes"]["async"]
    n, slow = 4, 1
    samples = recipe.EPOCHS * recipe.N_TRAIN
    assert m["lesson"] == "11" and m["world_size"] == n and m["mode"] == "sync"
    assert m["slow_rank"] == slow and m["slow_factor"] == 4.0
    assert sync["samples"] == asyn["samples"] == samples  # the same task for both

    # synchronous: lockstep. Every worker does every step; nothing is ever stale; the copies
    # stay identical and equal lesson 01's weights (plain SGD on the global batch).
    assert sync["updates"] == samples // recipe.GLOBAL_BATCH
    assert sync["staleness_mean"] == 0 and sync["staleness_max"] == 0
    assert sync["replicas_max_diff"] == 0.0
    assert [w["samples"] for w in sync["per_worker"]] == [samples // n] * n
    assert max_abs_diff(state, reference_3_epochs) < 1e-4
    assert sync["max_abs_diff_vs_single_device"] < 1e-4
    # ... and the step time is the slow worker's: the fast ones spend longer waiting
    waits = [w["wait_fraction"] for w in sync["per_worker"]]
    assert all(waits[slow] < waits[r] for r in range(n) if r != slow), waits

    # asynchronous: nobody waits, so more samples per second, but gradients are stale
    assert asyn["samples_per_second"] > 1.5 * sync["samples_per_second"], (asyn, sync)
    assert asyn["updates"] == samples // (recipe.GLOBAL_BATCH // n)
    assert asyn["staleness_mean"] > 0.5 and asyn["staleness_max"] >= 2
    updates = [w["updates"] for w in asyn["per_worker"]]
    assert sum(updates) == asyn["updates"]
    assert all(updates[slow] < updates[r] for r in range(n) if r != slow), updates
    stale = [w["staleness_mean"] for w in asyn["per_worker"]]
    assert all(stale[slow] > stale[r] for r in range(n) if r != slow), stale  # slow = stalest

    # both learn: well above chance (25%), and the loss went down
    for mode in (sync, asyn):
        assert mode["final_accuracy"] > 0.8 and mode["test_loss"] < 0.6
    assert m["final_accuracy"] == sync["final_accuracy"]
    assert len(m["losses"]) == sync["updates"] and m["losses"][-1] < 0.5 * m["losses"][0]

    out = proc.stdout
    assert [int(k) for k in re.findall(r"^Step (\d+):", out, re.M)] == [1, 2, 3, 4, 5]
    assert re.search(r"^\[rank \d\] epoch  3 \| update  384/384", out, re.M)
    assert "\x1b[" not in out


def test_a_straggler_slower_than_the_timeout_ends_a_sync_job(tmp_path):
    """A 5 s batch against a 3 s timeout: the synchronous job fails with one clear line
    soon after the timeout (asynchronous training would simply have carried on)."""
    timeout = 3
    rc, lines, stderr = run_with_line_times(
        [sys.executable, str(lesson_path("11")), "--out", str(tmp_path), "--mode", "sync",
         "--world-size", "2", "--slow-factor", "1000", "--work-ms", "5",
         "--timeout", str(timeout)], timeout=150)
    began = [t for t, line in lines if "the clock starts" in line]
    assert began, [line for _, line in lines]
    took = lines[-1][0] - began[0]
    # it needs the timeout at least, and at most the timeout plus start-up and exit slack
    # (the slow worker would need 5 s for its first batch; 3 x 96 batches without the bound)
    assert timeout <= took + 0.5 < timeout + 30, f"ended {took:.1f}s after training began"
    assert rc == 1
    error = [line for line in stderr.splitlines() if line.strip()]
    assert len(error) == 1 and "Traceback" not in stderr, stderr
    assert "--timeout" in error[0] and "--slow-factor" in error[0], error[0]
    assert not (tmp_path / "metrics.json").exists()


def load_lesson():
    return import_lesson("11")


@pytest.mark.parametrize("flags, expect", [
    (["--world-size", "1"], "--world-size 2"),
    (["--world-size", "5"], "one of 2, 3, 4, 6, 8"),
    (["--slow-rank", "4"], "--slow-rank 4"),
    (["--slow-factor", "0.5"], "--slow-factor"),
    (["--slow-factor", "x"], "--slow-factor"),
    (["--work-ms", "0"], "--work-ms"),
    (["--mode", "fast"], "--mode"),
    (["--device", "cuda"], "--device"),
])
def test_bad_flags_are_one_clear_line(flags, expect, monkeypatch, capsys):
    line = parse_error(load_lesson(), flags, monkeypatch, capsys)
    assert expect in line, line


def test_a_bad_flag_from_the_command_line():
    line = one_error_line(run_lesson("11", "--slow-rank", "7", check=False, timeout=60))
    assert line.startswith("error:") and "--slow-rank 7" in line, line
