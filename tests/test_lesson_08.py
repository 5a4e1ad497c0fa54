"""Lesson 08: no_sync() gradient accumulation, checked by the counts and weights it wrote."""
import re

import pytest
import torch

from common import recipe
from conftest import load_run, make_lesson, max_abs_diff, one_error_line, run_lesson


def reference(epochs: int) -> dict:
    """Lesson 01's weights. One thread: on these tiny matrices it is the fastest, and on a
    busy 2-core machine two OpenMP threads were measured 100x slower (4 s instead of 0.04 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return recipe.train_reference(epochs=epochs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One default run (2 ranks, accum 4, 3 epochs), shared by the tests below."""
    folder = tmp_path_factory.mktemp("lesson08")
    proc = make_lesson("08", "--out", folder, timeout=150)
    state, metrics = load_run(folder)
    return proc, state, metrics


def test_no_sync_all_reduces_once_per_optimizer_step(default_run):
    _, _, m = default_run
    calls, sent = m["allreduce_calls"], m["allreduce_bytes"]
    assert m["accum_steps"] == 4 and m["world_size"] == 2 and m["micro_batch"] == 12
    assert m["micro_batch"] * m["accum_steps"] * m["world_size"] == recipe.GLOBAL_BATCH
    steps = recipe.EPOCHS * recipe.N_TRAIN // recipe.GLOBAL_BATCH
    assert m["optimizer_steps"] == steps == len(m["losses"])
    # the tiny MLP fits in one bucket: one all-reduce per sync, of every gradient
    assert m["bucket_sizes"] == [5508]
    assert calls["no_sync"] == steps
    assert calls["naive"] == 4 * steps
    assert calls["naive"] / calls["no_sync"] == m["accum_steps"]  # exactly the accumulation
    assert sent["naive"] / sent["no_sync"] == m["accum_steps"]
    assert sent["no_sync"] == steps * 5508 * 4  # float32 gradients


def test_both_ways_end_with_lesson_01s_weights(default_run):
    _, state, m = default_run
    assert max_abs_diff(state, reference(recipe.EPOCHS)) <= 1e-4
    assert m["max_abs_diff_vs_single_device"] <= 1e-4
    assert m["max_abs_diff_naive_vs_single_device"] <= 1e-4
    assert m["max_abs_diff_naive_vs_no_sync"] <= 1e-4
    assert all(k.startswith(("fc1.", "fc2.", "head.")) for k in state)
    assert m["final_accuracy"] > 0.85
    assert sum(m["losses"][-10:]) < 0.5 * sum(m["losses"][:10])


def test_no_sync_placement_is_decided_at_forward_time(default_run):
    _, _, m = default_run
    v, calls = m["variants"], m["allreduce_calls"]
    # forward inside no_sync, backward outside: no sync (forward did not arm the reducer)
    assert v["no_sync_forward_only"]["allreduce_calls"] == calls["no_sync"]
    # forward outside, backward inside: syncs every micro-batch, as if no_sync were absent
    assert v["no_sync_backward_only"]["allreduce_calls"] == calls["naive"]
    assert v["no_sync_forward_and_backward"]["allreduce_calls"] == calls["no_sync"]
    for name in ("no_sync_forward_only", "no_sync_backward_only", "no_sync_forward_and_backward"):
        assert v[name]["max_abs_diff_vs_single_device"] <= 1e-4, name
        assert v[name]["rank_disagreement"] == 0.0, name


def test_mistakes_change_the_weights_not_the_counts(default_run):
    _, _, m = default_run
    v, calls = m["variants"], m["allreduce_calls"]
    not_divided, early = v["loss_not_divided"], v["step_inside_loop"]
    assert not_divided["allreduce_calls"] == early["allreduce_calls"] == calls["no_sync"]
    # gradients 4x too large: ranks agree, but the weights are not lesson 01's
    assert not_divided["rank_disagreement"] == 0.0
    assert not_divided["max_abs_diff_vs_single_device"] > 1e-2
    # stepping on unsynced gradients: the ranks' copies of the model drift apart
    assert early["rank_disagreement"] > 1e-3
    assert early["max_abs_diff_vs_single_device"] > 1e-2


def test_output_shows_steps_and_the_ratio(default_run):
    out = default_run[0].stdout
    steps = [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)]
    assert steps == list(range(1, 9))
    assert "naive / no_sync = 384 / 96 = 4" in out
    assert "Traceback" not in out + default_run[0].stderr


def test_small_buckets_more_calls_same_bytes(tmp_path):
    """Buckets of 0.01 MiB: DDP cuts the gradients into two buckets, but only once it has
    rebuilt its buckets after the first synced backward (which still used one). Both runs
    start from a fresh model, so each has one one-bucket sync, then two buckets per sync."""
    a = 2
    run_lesson("08", "--accum-steps", a, "--epochs", "1", "--bucket-cap-mb", "0.01",
               "--out", tmp_path, timeout=150)
    state, m = load_run(tmp_path)
    assert max_abs_diff(state, reference(1)) <= 1e-4
    steps = m["optimizer_steps"]
    assert m["micro_batch"] == 24 and steps == 32
    buckets = len(m["bucket_sizes"])
    assert buckets == 2 and sum(m["bucket_sizes"]) == 5508
    calls, sent = m["allreduce_calls"], m["allreduce_bytes"]
    assert calls["naive"] == 1 + (steps * a - 1) * buckets
    assert calls["no_sync"] == 1 + (steps - 1) * buckets
    assert sent["naive"] / sent["no_sync"] == a  # bytes do not care how they are cut


def test_accum_steps_that_do_not_divide_is_one_clear_line():
    line = one_error_line(run_lesson("08", "--accum-steps", "5", check=False, timeout=60))
    assert line.startswith("error:") and "use one of 1, 2, 3, 4, 6, 8, 12, 16, 24, 48" in line, line
