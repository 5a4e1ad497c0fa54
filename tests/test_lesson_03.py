"""Lesson 03: DataParallel's stages (real or simulated) train lesson 01's weights."""
import re

import pytest
import torch
import torch.nn.functional as F

from common import recipe
from conftest import load_run, make_lesson, max_abs_diff, one_error_line, run_lesson

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def lesson():
    """The hand-written stages the lesson runs on simulated devices (its companion module)."""
    import simulated_dp
    return simulated_dp


def test_default_run_matches_lesson_01(tmp_path, reference_3_epochs):
    proc = make_lesson("03", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    diff = max_abs_diff(state, reference_3_epochs)
    assert diff <= 1e-4, diff
    assert metrics["max_abs_diff_vs_01"] == pytest.approx(diff, abs=1e-12)
    assert f"max |w_03 - w_01| = {diff:.1e}" in proc.stdout
    assert metrics["lesson"] == "03" and metrics["world_size"] == 1 and metrics["devices"] == 2
    assert len(metrics["losses"]) == recipe.EPOCHS * recipe.N_TRAIN // recipe.GLOBAL_BATCH
    assert metrics["final_accuracy"] > 0.85
    assert list(state) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                           "head.weight", "head.bias"]  # no DataParallel `module.` prefix
    # each device got half of every batch
    assert [d["samples_per_step"] for d in metrics["device_load"]] == [48, 48]
    steps = [int(n) for n in re.findall(r"^Step (\d+):", proc.stdout, re.M)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    # Step 7's two checks are printed with their numbers
    sums = re.search(r"sum of the 2 replicas' gradients \(max diff (\S+)\); vs one device "
                     r"on the whole batch: max diff (\S+)", proc.stdout)
    assert sums and float(sums[1]) <= 1e-6 and float(sums[2]) <= 1e-6
    if not TWO_GPUS:
        assert metrics["simulated"] is True and metrics["device_names"] == ["sim:0", "sim:1"]
        assert "Expected a non cpu device" in proc.stdout  # DataParallel's own refusal
        load = metrics["device_load"]
        device0 = load[0]["bytes_replica"] + load[0]["bytes_device0_only"]
        assert device0 > 1.3 * load[1]["bytes_replica"] and load[1]["bytes_device0_only"] == 0
        assert all(metrics["stage_ms_per_step"][s] > 0 for s in ("scatter", "replicate",
                                                                  "gather", "backward"))
        assert metrics["threads_forward_ms"] > 0 and metrics["one_thread_forward_ms"] > 0


def test_three_devices_one_epoch(tmp_path):
    if TWO_GPUS and torch.cuda.device_count() < 3:
        pytest.skip("this machine has 2 GPUs: --devices 3 is a clear error here")
    run_lesson("03", "--devices", "3", "--epochs", "1", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    assert max_abs_diff(state, recipe.train_reference(seed=0, epochs=1)) <= 1e-4
    assert [d["samples_per_step"] for d in metrics["device_load"]] == [32, 32, 32]


def test_hand_made_stages_give_the_single_device_gradient(lesson):
    torch.manual_seed(0)
    model, single = recipe.make_model(0), recipe.make_model(0)
    x, y = torch.randn(96, recipe.FEATURES), torch.randint(0, recipe.CLASSES, (96,))
    chunks = lesson.scatter_by_hand(x, 3)
    assert [c.shape[0] for c in chunks] == [32, 32, 32]
    replicas = lesson.replicate_by_hand(model, 3)
    assert list(replicas[0].parameters()) == []  # replicas hold copies, not Parameters
    assert replicas[0].fc1.weight.data_ptr() == model.fc1.weight.data_ptr()  # device 0 aliases
    assert replicas[1].fc1.weight.data_ptr() != model.fc1.weight.data_ptr()
    outputs, seconds = lesson.parallel_apply_by_hand(replicas, chunks)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    out = lesson.gather_by_hand(outputs, torch.device("cpu"))
    torch.testing.assert_close(out, single(x), rtol=0, atol=1e-6)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(single(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def test_an_error_in_a_replica_thread_reaches_the_caller(lesson):
    def broken(_):
        raise ValueError("replica failed")
    with pytest.raises(ValueError, match="replica failed"):
        lesson.parallel_apply_by_hand([broken, broken], [torch.zeros(1), torch.zeros(1)])


def test_bad_flags_are_one_clear_line():
    for flags, expect in ((["--devices", "1"], "--devices 1"),):
        line = one_error_line(run_lesson("03", *flags, check=False))
        assert line.startswith("error:") and expect in line, line
    if not TWO_GPUS:
        line = one_error_line(run_lesson("03", "--device", "cuda", check=False))
        assert "--device cpu" in line


def test_real_data_parallel_on_two_gpus(tmp_path, reference_3_epochs):
    if not TWO_GPUS:
        pytest.skip("needs 2 GPUs: trains with the real nn.DataParallel")
    run_lesson("03", "--device", "cuda", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    assert metrics["simulated"] is False and metrics["device_names"] == ["cuda:0", "cuda:1"]
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    peaks = [d["peak_memory_bytes"] for d in metrics["device_load"]]
    assert peaks[0] > peaks[1]  # device 0 holds the weights, grads, optimizer state, outputs
