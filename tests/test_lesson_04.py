"""Lesson 04: the split model computes and trains exactly like the whole one, and the
pipeline schedule's idle fractions are what the arithmetic says."""
import re

import pytest
import torch
import torch.nn.functional as F

from common import recipe
from conftest import import_lesson, load_run, make_lesson, max_abs_diff, one_error_line, run_lesson

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def load_lesson():
    return import_lesson("04")


@pytest.fixture(scope="module")
def lesson():
    return load_lesson()


@pytest.fixture(scope="module")
def pipe():
    """The lesson's companion: micro-batches, the schedule replay and the timeline."""
    import micro_batches
    return micro_batches


def test_default_run_matches_lesson_01_and_pipelining_helps(tmp_path, reference_3_epochs):
    proc = make_lesson("04", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    diff = max_abs_diff(state, reference_3_epochs)
    assert diff <= 1e-4, diff
    if not TWO_GPUS:
        assert "both stages are placed on" in proc.stdout
    if not torch.cuda.is_available():
        assert diff == 0.0  # both stages on the CPU, like the reference: the very same operations
    assert f"max |w_04 - w_01| = {diff:.1e}" in proc.stdout
    assert metrics["lesson"] == "04" and metrics["final_accuracy"] > 0.85
    assert len(metrics["losses"]) == recipe.EPOCHS * recipe.N_TRAIN // recipe.GLOBAL_BATCH
    check = metrics["check"]
    assert check["output_max_diff"] <= 1e-6 and check["grad_max_diff"] <= 1e-6
    assert check["micro_batch_grad_max_diff"] <= 1e-6
    assert metrics["split"] == {"stage 0": ["fc1", "fc2"], "stage 1": ["head"]}

    pipe = metrics["pipeline"]
    assert pipe["micro_batches"] == 4 and len(pipe["task_ms"]["4"]) == 4 * 4
    # naive: each device works only while the other waits, so exactly half is idle
    assert pipe["naive"]["idle_overall"] == pytest.approx(0.5, abs=1e-3)
    # pipelined: stage 0's forward of micro-batch 1 overlaps stage 1's of micro-batch 0,
    # so strictly less is idle, whatever the measured times are
    assert pipe["pipelined"]["idle_overall"] < pipe["naive"]["idle_overall"]
    assert f"idle fraction from 50% to {pipe['pipelined']['idle_overall']:.0%}" in proc.stdout
    # the timeline shows stage 0 on micro-batch k+1 while stage 1 is on k
    rows = re.findall(r"^  stage (\d) \|([^|]+)\|$", proc.stdout, re.M)
    assert len(rows) == 4  # two devices, naive and pipelined
    piped0, piped1 = rows[2][1], rows[3][1]
    assert set("0123abcd") <= set(piped0 + piped1)
    steps = [int(n) for n in re.findall(r"^Step (\d+):", proc.stdout, re.M)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]


def test_schedule_matches_the_bubble_formula(pipe):
    for m in (1, 2, 4, 8):
        seconds = {(kind, s, k): 1.0 for kind in "FB" for s in (0, 1) for k in range(m)}
        plan = pipe.schedule(seconds, m)
        # GPipe with 2 equal stages: (m + 1) slots of forward, (m + 1) of backward
        assert plan["makespan"] == 2 * (m + 1)
        assert plan["idle_overall"] == pytest.approx(1 / (m + 1))
        for k in range(m):  # nobody starts before its input exists
            assert plan["start"]["F", 1, k] >= plan["end"]["F", 0, k]
            assert plan["start"]["B", 0, k] >= plan["end"]["B", 1, k]
        if m > 1:  # and stage 0 really does work on k+1 while stage 1 works on k
            assert plan["start"]["F", 0, 1] == plan["start"]["F", 1, 0]


def test_unequal_stages_leave_the_fast_one_waiting(pipe):
    seconds = {("F", 0, k): 3.0 for k in range(4)} | {("B", 0, k): 3.0 for k in range(4)}
    seconds |= {("F", 1, k): 1.0 for k in range(4)} | {("B", 1, k): 1.0 for k in range(4)}
    plan = pipe.schedule(seconds, 4)
    assert plan["idle"][1] > 0.5 > plan["idle"][0]


def test_split_model_is_the_mlp(lesson, pipe):
    cpu = torch.device("cpu")
    whole = recipe.make_model(0)
    split = lesson.SplitMLP(recipe.make_model(0), cpu, cpu)
    assert list(split.state_dict()) == list(whole.state_dict())
    x, y = torch.randn(24, recipe.FEATURES), torch.randint(0, recipe.CLASSES, (24,))
    assert torch.equal(split(x), whole(x))
    split.zero_grad()
    loss, seconds = pipe.run_micro_batches(split, x, y, 3)
    assert len(seconds) == 12 and all(v >= 0 for v in seconds.values())
    full = F.cross_entropy(whole(x), y)
    full.backward()
    assert loss == pytest.approx(full.item(), abs=1e-6)
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def test_timeline_marks(pipe):
    seconds = {(kind, s, k): 1.0 for kind in "FB" for s in (0, 1) for k in range(2)}
    plan = pipe.schedule(seconds, 2)
    rows = pipe.timeline(plan, 2, plan["makespan"], width=6)
    assert rows == ["01..ba", ".01ba."]


def test_bad_flags_are_one_clear_line():
    for flags, expect in ((["--micro-batches", "17"], "--micro-batches 17"),
                          (["--pipeline-batch", "2"], "--pipeline-batch 2")):
        line = one_error_line(run_lesson("04", *flags, check=False))
        assert line.startswith("error:") and expect in line, line


def test_two_gpus_hold_one_stage_each(tmp_path, reference_3_epochs):
    if not TWO_GPUS:
        pytest.skip("needs 2 GPUs: puts stage 0 on cuda:0 and stage 1 on cuda:1")
    run_lesson("04", "--device", "cuda", "--out", tmp_path)
    state, metrics = load_run(tmp_path)
    assert metrics["stage_devices"] == ["cuda:0", "cuda:1"]
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
