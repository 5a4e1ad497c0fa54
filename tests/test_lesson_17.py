"""Lesson 17: tensor and sequence parallel. One 2-rank run of the lesson through its real launcher
(by hand, sequence parallel) feeds the end-to-end assertions; the lesson's own functions are also
run on worlds of 1, 2 and 4 ranks (all four variants in each world, one world of 4 in all) for a
few steps, against lesson 13's reference, with their collectives counted."""
import math
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
    # one sum per whole-on-every-rank parameter in the region: 2 norms x 2 + 2 biases per
    # block, and the final norm's 2
    assert metrics["collectives_per_step"]["all_reduce"] == 6 * T.N_BLOCKS + 2
    assert c["per_step_by_phase"]["after backward"] == {"all_reduce": 6 * T.N_BLOCKS + 2}
    local, full = c["split_param_bytes"]
    assert local * WORLD == full
    assert "per block, forward : 2 all_gather, 2 reduce_scatter" in out


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


def test_prints_the_steps_in_order(lesson):
    import re
    out, _, _ = lesson
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 13))


# --- the lesson's functions on 1, 2 and 4 ranks ------------------------------------------

class _Quiet:
    def print(self, *args, **kwargs):
        pass


def _rank_variants(rank: int, world: int, steps: int) -> dict:
    """Every variant of the lesson, trained `steps` steps as its Step 4 does, counted once."""
    import importlib.util

    import torch

    import tensor_parallel as A
    from common import transformer as T

    spec = importlib.util.spec_from_file_location("lesson_17", str(lesson_path("17")))
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    results = {}
    for impl, sp in VARIANTS:
        split_model = lesson.parallelize_by_hand if impl == "manual" else lesson.parallelize_dtensor
        model = split_model(T.make_model(), rank, world, sp)
        optimizer = T.make_optimizer(model)
        for step in range(steps):
            x, y = T.batch(step)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in filter(lambda p: getattr(p, "sequence_parallel", False), model.parameters()):
                torch.distributed.all_reduce(p.grad)
            optimizer.step()
        state = A.full_state_dict(model)

        class Args:
            seed, sequence_parallel = T.SEED, sp

        counts = A.count_step(split_model, rank, world, Args, torch.device("cpu"), _Quiet())
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


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_holds_one_nth_of_the_split_weights(worlds, world):
    for rank in range(world):
        for name, result in worlds[world][rank].items():
            local, full = result["counts"]["split_param_bytes"]
            assert local * world == full, (name, local, full)
    one = worlds[1][0]["manual sp=False"]["counts"]
    assert one["per_step"] == {"all_reduce": 4 * T.N_BLOCKS}  # a world of one still calls them


def test_world_size_and_impl_are_checked(monkeypatch, capsys):
    import tensor_parallel as A
    with pytest.raises(SystemExit) as exit_info:
        A.check_world_size(3)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --world-size 3 does not divide") and "1, 2 or 4" in err
    lesson = import_lesson("17")
    assert "--impl" in parse_error(lesson, ["--impl", "megatron"], monkeypatch, capsys)
    assert math.isfinite(T.loss_floor())
