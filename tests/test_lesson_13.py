"""Lesson 13: the transformer baseline and its memory, run once as a learner would."""
import math
import re

import pytest
import torch

from common import transformer as T
from conftest import import_lesson, load_run, make_lesson, max_abs_diff, parse_error, weights_line


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson13")
    proc = make_lesson("13", "--device", "cpu", "--out", folder, timeout=180)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_ends_with_exactly_the_reference_weights(lesson, reference_13):
    _, state, metrics = lesson
    assert max_abs_diff(state, reference_13["state"]) == 0.0
    assert metrics["losses"] == [round(x, 6) for x in reference_13["losses"].tolist()]
    assert all(t.device.type == "cpu" for t in state.values())


def test_the_part2_lessons_evaluate_and_compare_as_lesson_13_does(lesson):
    """T.evaluate is lesson 13's Step 5 for the Part 2 lessons: the same held-out numbers from
    its final weights; T.compare_with_lesson_13 is 0 against its own run, beside the floor."""
    _, state, metrics = lesson
    model = T.make_model()
    model.load_state_dict(state)
    held_out, accuracy = T.evaluate(model, T.STEPS, T.SEED, "cpu")
    assert held_out == pytest.approx(metrics["held_out_loss"], abs=1e-6)  # (threads: rounding)
    assert accuracy == pytest.approx(metrics["final_accuracy"], abs=1e-3)
    compared = T.compare_with_lesson_13(state, T.SEED, T.STEPS, chunks=2)
    assert compared["max_abs_diff_vs_single_device"] == 0.0 and compared["floor_chunks"] == 2
    assert 0 < compared["max_abs_diff_floor"] < 1e-4  # rounding alone, far below the 1e-3 allowed
    assert T.weights_gap(compared) == weights_line(0.0, compared["max_abs_diff_floor"], 2)


def independent_floor() -> float:
    """The floor again, another way: the stationary pair distribution by power iteration."""
    P = T.transition_table()
    V = P.shape[0]
    pi = torch.full((V, V), 1.0 / V**2, dtype=torch.float64)
    for _ in range(2000):  # pi'[b, c] = sum_a pi[a, b] P[a, b, c]
        pi = torch.einsum("ab,abc->bc", pi, P)
    rate = -(pi * (P * P.log()).sum(-1)).sum().item()
    p0 = pi.sum(1)
    first = -(pi * (pi / p0[:, None]).log()).sum().item()  # H(X1 | X0)
    return (first + (T.SEQ - 1) * rate) / T.SEQ


def test_loss_ends_near_the_floor(lesson):
    out, _, metrics = lesson
    floor = independent_floor()
    assert metrics["loss_floor"] == pytest.approx(floor, abs=1e-9)
    assert floor < math.log(T.VOCAB) - 1.0  # the chain is far from uniform: there is much to learn
    assert metrics["losses"][0] > floor + 1.0
    assert floor - 0.02 < metrics["held_out_loss"] < floor + 0.06, metrics["held_out_loss"]
    assert f"{metrics['held_out_loss'] - floor:+.4f} from the floor {floor:.4f}" in out


def test_the_batches_come_from_the_chain_at_its_floor():
    """The true table's own loss on the batches is the floor: data and formula agree."""
    P = T.transition_table()
    losses = []
    for step in range(20):
        x, y = T.batch(step)
        prev2 = torch.cat([x[:, :1], x[:, :-1]], 1)  # target 0's context is one token only
        p = P[prev2, x, y]
        p[:, 0] = (T.stationary_pairs(P)[x[:, 0], y[:, 0]] / T.stationary_pairs(P).sum(1)[x[:, 0]])
        losses.append(-p.log().mean().item())
    assert sum(losses) / len(losses) == pytest.approx(T.loss_floor(), abs=0.02)


def test_memory_matches_the_formula(lesson):
    _, state, metrics = lesson
    n = sum(t.numel() for t in state.values())  # no buffers: every entry is a parameter
    mem = metrics["memory_bytes"]
    assert (mem["parameters"], mem["gradients"], mem["optimizer_state"]) == (4 * n, 4 * n, 8 * n)
    assert mem["activations"] > mem["parameters"]


def test_reports_the_peak_of_one_training_step_beside_what_it_holds_at_rest(lesson):
    """metrics.json's peak_memory_bytes (issue 23): torch's MemTracker around the last step.
    At rest the process holds Step 6's parameters, gradients and AdamW state; inside a step
    the activations come on top, so the peak is higher, and the lesson prints both."""
    out, _, metrics = lesson
    mem, peak = metrics["memory_bytes"], metrics["peak_memory_bytes"]
    at_rest = mem["parameters"] + mem["gradients"] + mem["optimizer_state"]
    assert type(peak) is int and peak >= at_rest > 0
    assert metrics["at_rest_bytes"] == at_rest and metrics["peak_memory_step"] == T.STEPS
    breakdown = metrics["peak_memory_breakdown"]
    assert breakdown["Total"] == peak and breakdown["PARAM"] == mem["parameters"]
    assert 0 < breakdown["ACT"] <= mem["activations"]  # what autograd saved, partly freed by then
    line = next(l for l in out.splitlines() if l.startswith(f"peak of training step {T.STEPS} "))
    assert f"{peak:,} bytes" in line and f"{at_rest:,} held at rest" in line


def test_checkpointing_saves_less_and_changes_nothing(lesson):
    out, _, metrics = lesson
    assert 0 < metrics["activations_checkpointed_bytes"] < metrics["memory_bytes"]["activations"] / 4
    assert [round(x, 6) for x in metrics["checkpointed_losses"]] == metrics["losses"][:10]
    assert "identical with and without checkpointing: True" in out
    seconds = metrics["seconds_forward_backward"]
    assert seconds["plain"] > 0 and seconds["checkpointed"] > 0


def test_bf16_autocast_saves_less_and_nearly_the_same_loss(lesson):
    _, _, metrics = lesson
    assert metrics["activations_bf16_bytes"] < metrics["memory_bytes"]["activations"]
    assert abs(metrics["loss_bf16"] - metrics["held_out_loss"]) < 0.5  # same model, other batch
    for key in ("lesson", "world_size", "backend", "device", "wall_seconds", "samples_per_second",
                "final_accuracy", "loss_floor"):
        assert key in metrics


def test_steps_are_printed_in_order(lesson):
    out, _, _ = lesson
    steps = [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)]
    assert steps == list(range(1, 11))


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    module = import_lesson("13")
    for flags, expect in ((["--steps", "0"], "--steps"), (["--seed", "-1"], "--seed"),
                          (["--seed", str(2**31)], "--seed"), (["--device", "tpu"], "--device"),
                          (["--epochs", "3"], "--epochs")):
        assert expect in parse_error(module, flags, monkeypatch, capsys)
