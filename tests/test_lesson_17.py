"""Lesson 17: tensor and sequence parallel. One 2-rank run of the lesson through its real launcher
(by hand, sequence parallel) feeds the end-to-end assertions; the lesson's own functions are also
run on worlds of 1, 2 and 4 ranks (all four variants in each world, one world of 4 in all) for a
few steps, against lesson 13's reference, with every collective of those steps counted by
apparatus/comm.py (DTensor's own, and AdamW's step, included)."""
import math
import re
import sys

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, lesson_path, load_run, max_abs_diff, parse_error, run_lesson

sys.path.insert(0, str(ROOT / "tools"))
from check_exercise import run_world  # noqa: E402  (the harness's way to start N ranks)

WORLD, STEPS, FEW = 2, 20, 4
VARIANTS = [("manual", False), ("manual", True), ("dtensor", False), ("dtensor", True)]
ACTIVATION = T.GLOBAL_BATCH * T.SEQ * T.DIM * 4  # bytes of one (B, T, D) float32 tensor


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson17")
    proc = run_lesson("17", "--world-size", WORLD, "--impl", "manual", "--sequence-parallel",
                      "--steps", STEPS, "--device", "cpu", "--out", folder, timeout=300)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_ends_with_lesson_13s_weights_beside_the_floor(lesson):
    out, state, metrics = lesson
    reference = T.train_reference(steps=STEPS)["state"]
    diff = max_abs_diff(state, reference)
    floor = max_abs_diff(T.train_reference(steps=STEPS, chunks=WORLD)["state"], reference)
    assert diff <= 1e-3, diff
    assert f"max |w - w_13| = {diff:.1e} (floor {floor:.1e})" in out
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert (metrics["impl"], metrics["sequence_parallel"], metrics["world_size"]) == ("manual", True, 2)
    plain = T.make_model()
    plain.load_state_dict(state)  # the gathered shards carry lesson 13's names and shapes
    # every rank computes the whole batch's loss: the losses follow lesson 13's
    reference_losses = T.train_reference(steps=STEPS)["losses"].tolist()
    assert max(abs(a - b) for a, b in zip(metrics["losses"], reference_losses)) < 1e-3


def test_counts_the_sequence_parallel_collectives(lesson):
    out, _, metrics = lesson
    c = metrics["collectives"]
    for phase in ("forward", "backward"):  # f_sp and g_sp per sublayer, each way
        assert c["per_block"][phase] == {"all_gather": 2, "reduce_scatter": 2}
        assert c["data_bytes_per_block"][phase] == 4 * ACTIVATION
        assert c["sent_bytes_per_block"][phase] == pytest.approx(4 * (WORLD - 1) / WORLD * ACTIVATION)
    # our sum after backward: one per whole-on-every-rank parameter in the region, 2 norms x 2
    # + 2 biases per block and the final norm's 2, each of 4 x DIM bytes; AdamW's step: none
    shared = 6 * T.N_BLOCKS + 2
    assert c["per_step_by_phase"]["between"] == {"all_reduce": shared}
    assert c["per_step_by_phase"]["optimizer"] == {}
    assert c["sent_bytes_by_phase"]["between"] == pytest.approx(shared * 2 * (WORLD - 1) / WORLD * 4 * T.DIM)
    # the whole step: the blocks, the way into the split and out of it (one all-gather each
    # way more), and our sum; the bytes are everything the step sent
    assert metrics["collectives_per_step"] == {"all_reduce": shared, "all_gather": 2 * (2 * T.N_BLOCKS + 1),
                                               "reduce_scatter": 2 * 2 * T.N_BLOCKS}
    assert c["sent_bytes_per_step"] == pytest.approx(sum(c["sent_bytes_by_phase"].values()))
    local, full = c["split_param_bytes"]
    assert local * WORLD == full
    assert "blocks.1 alone: forward: 2 all_gather, 2 reduce_scatter" in out
    assert re.search(r"│ after backward +│ 14 +│ 0 +│ 0 +│ 3,584 +│", out), out  # the table's row


def test_shows_the_sequence_parallel_mistake_and_its_fix(lesson):
    _, _, metrics = lesson
    m = metrics["sequence_parallel_mistake"]
    ratios = m["mistake_ratio_by_rank"]
    assert len(ratios) == WORLD and all(r < 0.95 for r in ratios)  # each rank: a part only
    assert m["mistake"]["max_abs_diff"] > 1e-4
    assert m["fixed"]["ratio"] == pytest.approx(1, abs=1e-5)
    assert m["fixed"]["max_abs_diff"] < 1e-7
    # the loss on each rank's own tokens: N times too big unless divided by N
    assert m["local_loss_unscaled"]["ratio"] == pytest.approx(WORLD, rel=1e-5)
    assert m["local_loss_scaled"]["ratio"] == pytest.approx(1, rel=1e-5)
    assert m["local_loss_scaled"]["max_abs_diff"] < 1e-7


def test_measures_what_sequence_parallel_saves(lesson):
    out, _, metrics = lesson
    saved = metrics["activations_bytes"]
    # every rank saves less than one process; sequence parallel saves less than tensor
    # parallel alone (the LayerNorms' inputs, 1/N of the tokens each)
    assert saved["sequence_parallel"] < saved["tensor_parallel"] < saved["one_process"]
    assert f"{saved['one_process'] / 2**20:.2f} MiB in one process (lesson 13)" in out


def test_prints_the_steps_in_order_and_keeps_lesson_13s_demonstrations_in_13(lesson):
    out, _, metrics = lesson
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 10))
    assert not {"memory_bytes", "activations_checkpointed_bytes", "activations_bf16_bytes",
                "checkpointed_losses", "loss_bf16", "seconds_forward_backward"} & set(metrics)


# --- the lesson's functions on 1, 2 and 4 ranks ------------------------------------------

class _Quiet:
    def print(self, *args, **kwargs):
        pass

    table = print


def _rank_variants(rank: int, world: int, steps: int) -> dict:
    """Every variant of the lesson, trained `steps` steps as its Step 4 does, every collective
    recorded as it records them."""
    import importlib.util

    import torch

    import tensor_parallel as A
    from apparatus.comm import CommLog
    from common import transformer as T

    spec = importlib.util.spec_from_file_location("lesson_17", str(lesson_path("17")))
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    results = {}
    for impl, sp in VARIANTS:
        split_model = lesson.parallelize_by_hand if impl == "manual" else lesson.parallelize_dtensor
        model = split_model(T.make_model(), rank, world, sp)
        optimizer = T.make_optimizer(model)
        log = CommLog(modules=True)
        with log.recording():
            for step in range(steps):
                x, y = T.batch(step)
                loss = T.loss_fn(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                for p in filter(lambda p: getattr(p, "sequence_parallel", False), model.parameters()):
                    torch.distributed.all_reduce(p.grad)
                optimizer.step()
        state = A.full_state_dict(model)
        counts = A.report(log, steps, model, _Quiet())
        results[f"{impl} sp={sp}"] = {"state": state if rank == 0 else {}, "counts": counts}
    return results


@pytest.fixture(scope="module")
def worlds():
    return {world: run_world(world, _rank_variants, (FEW,), lesson_path("17")) for world in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_variant_ends_with_lesson_13s_weights(worlds, world):
    reference = T.train_reference(steps=FEW)["state"]
    floor = max_abs_diff(T.train_reference(steps=FEW, chunks=world)["state"], reference)
    for name, result in worlds[world][0].items():
        diff = max_abs_diff(result["state"], reference)
        assert diff <= 1e-3, (world, name, diff, floor)
        assert diff <= max(20 * floor, 1e-5), (world, name, diff, floor)  # float rounding only


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_makes_two_all_reduces_per_block_each_way(worlds, world):
    for rank in range(world):
        by_hand = worlds[world][rank]["manual sp=False"]["counts"]
        for phase in ("forward", "backward"):
            assert by_hand["per_block"][phase] == {"all_reduce": 2}
            assert by_hand["data_bytes_per_block"][phase] == 2 * ACTIVATION
            assert by_hand["sent_bytes_per_block"][phase] == pytest.approx(
                2 * 2 * (world - 1) / world * ACTIVATION)
        dtensor = worlds[world][rank]["dtensor sp=False"]["counts"]
        assert dtensor["per_block"]["forward"] == {"all_reduce": 2}
        # DTensor sums the input gradient of each column-parallel linear on its own: q, k, v, fc
        assert dtensor["per_block"]["backward"] == {"all_reduce": 4}
        sp = worlds[world][rank]["manual sp=True"]["counts"]
        # sequence parallel: the same bytes on the wire, as all-gathers and reduce-scatters
        assert sp["sent_bytes_per_block"] == pytest.approx(by_hand["sent_bytes_per_block"])
        # tensor parallel alone leaves no gradient to sum after backward, nor in the step
        for counts in (by_hand, dtensor):
            assert counts["per_step_by_phase"]["between"] == counts["per_step_by_phase"]["optimizer"] == {}


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_sums_the_layernorm_gradients_in_adamws_step(worlds, world):
    """By hand, sequence parallel sums the whole-on-every-rank gradients once, after backward
    (lesson Step 4). DTensor leaves the LayerNorms' gradients Partial and all-reduces each
    when AdamW's step reads it: in lerp_, and twice in addcmul_(grad, grad)."""
    norms = 2 * (2 * T.N_BLOCKS + 1)  # weight and bias of 2 norms per block and the last one
    shared = norms + 2 * T.N_BLOCKS   # the row-parallel biases too, by hand
    for rank in range(world):
        by_hand = worlds[world][rank]["manual sp=True"]["counts"]["per_step_by_phase"]
        dtensor = worlds[world][rank]["dtensor sp=True"]["counts"]
        assert by_hand["between"] == {"all_reduce": shared} and by_hand["optimizer"] == {}
        assert dtensor["per_step_by_phase"]["between"] == {}
        assert dtensor["per_step_by_phase"]["optimizer"] == {"all_reduce": 3 * norms}
        assert dtensor["sent_bytes_by_phase"]["optimizer"] == pytest.approx(
            3 * norms * 2 * (world - 1) / world * 4 * T.DIM)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_holds_one_nth_of_the_split_weights(worlds, world):
    for rank in range(world):
        for name, result in worlds[world][rank].items():
            local, full = result["counts"]["split_param_bytes"]
            assert local * world == full, (name, local, full)
    one = worlds[1][0]["manual sp=False"]["counts"]
    assert one["per_step"] == {"all_reduce": 4 * T.N_BLOCKS}  # a world of one still calls them


def test_world_size_and_impl_are_checked(monkeypatch, capsys):
    """Part 2's one rule (common/transformer.check_world_size), with the heads and the tokens."""
    lesson = import_lesson("17")
    for n in ("3", "8"):
        line = parse_error(lesson, ["--world-size", n], monkeypatch, capsys)
        assert "4 attention heads" in line and "32 tokens" in line and line.endswith("use one of 1, 2, 4"), line
    assert "--impl" in parse_error(lesson, ["--impl", "megatron"], monkeypatch, capsys)
    assert math.isfinite(T.loss_floor())
