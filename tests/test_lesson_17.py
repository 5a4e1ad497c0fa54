"""Lesson 17: tensor and sequence parallel. One 2-rank run of the lesson through its real launcher
(DTensor, sequence parallel: its own collectives, AdamW's step's among them) feeds the end-to-end
assertions on metrics.json; the lesson's own functions are also run on worlds of 1, 2 and 4 ranks
(all four variants in each world, and DTensor's use_local_output mistake on 2) for a few steps,
against lesson 13's reference, with every collective of every step counted by apparatus/comm.py
(DTensor's own, and AdamW's step, included)."""
import math
import re
import sys

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, make_lesson, max_abs_diff, parse_error, weights_line

from common.distributed import run_ranks

WORLD, STEPS, FEW = 2, 10, 2
VARIANTS = [("manual", False, False), ("manual", True, False), ("dtensor", False, False), ("dtensor", True, False)]
MISTAKES = [("dtensor", False, True), ("dtensor", True, True)]  # use_local_output=True: on 2 ranks
ACTIVATION = T.GLOBAL_BATCH * T.SEQ * T.DIM * 4  # bytes of one (B, T, D) float32 tensor
NORMS = 2 * (2 * T.N_BLOCKS + 1)  # weight and bias of 2 LayerNorms per block and the last one
SMALL = 4 * T.DIM  # bytes of one of them


def ring(world: int, kind: str) -> float:
    """The share of S one rank sends (lesson 10's ring; apparatus/comm.py's SHARE)."""
    return (2 if kind == "all_reduce" else 1) * (world - 1) / world


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("lesson17")


@pytest.fixture(scope="module")
def lesson(folder):
    proc = make_lesson("17", "--world-size", WORLD, "--impl", "dtensor", "--sequence-parallel",
                       "--steps", STEPS, "--device", "cpu", "--out", folder, timeout=300)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_ends_with_lesson_13s_weights_beside_the_floor(lesson):
    out, state, metrics = lesson
    reference = T.train_reference(steps=STEPS)["state"]
    diff = max_abs_diff(state, reference)
    floor = max_abs_diff(T.train_reference(steps=STEPS, chunks=WORLD)["state"], reference)
    assert diff <= 1e-3, diff
    assert weights_line(diff, floor, WORLD) in out and metrics["max_abs_diff_floor"] == pytest.approx(floor)
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert (metrics["impl"], metrics["sequence_parallel"], metrics["world_size"]) == ("dtensor", True, 2)
    plain = T.make_model()
    plain.load_state_dict(state)  # the gathered shards carry lesson 13's names and shapes
    # every rank computes the whole batch's loss: the losses follow lesson 13's
    reference_losses = T.train_reference(steps=STEPS)["losses"].tolist()
    assert max(abs(a - b) for a, b in zip(metrics["losses"], reference_losses)) < 1e-3


def test_dtensor_plan_sends_what_the_by_hand_plan_sends(lesson):
    """Issue #23: with use_local_output=True at the sublayers' border, q, k and v each summed
    their input's gradient (1,966,080 bytes per block in backward on 2 ranks, not 786,432). Per
    block, each way: f_sp and g_sp per sublayer, as by hand."""
    out, _, metrics = lesson
    c = metrics["collectives"]
    for phase in ("forward", "backward"):
        assert c["per_block"][phase] == {"all_gather": 2, "reduce_scatter": 2}, phase
        assert c["data_bytes_per_block"][phase] == 4 * ACTIVATION
        assert c["sent_bytes_per_block"][phase] == 4 * ring(WORLD, "all_gather") * ACTIVATION == 786_432
    assert "blocks.1 alone: forward: 2 all_gather, 2 reduce_scatter, 786,432 bytes sent; " \
           "backward: 2 all_gather, 2 reduce_scatter, 786,432 bytes sent" in out


def test_metrics_count_everything_a_step_sends(lesson):
    """The interface other checks read: collectives_per_step and collectives.sent_bytes_per_block
    count everything a step sends, DTensor's own collectives and AdamW's step included. DTensor
    leaves the LayerNorms' gradients Partial; AdamW's step reads each three times, and each read
    all-reduces it (by hand: one sum after backward)."""
    out, _, metrics = lesson
    c = metrics["collectives"]
    assert c["per_step_by_phase"]["between"] == {}
    assert c["per_step_by_phase"]["optimizer"] == {"all_reduce": 3 * NORMS}
    assert metrics["collectives_per_step"] == {"all_reduce": 3 * NORMS, "all_gather": 2 * (2 * T.N_BLOCKS + 1),
                                               "reduce_scatter": 2 * 2 * T.N_BLOCKS}
    assert c["per_step"] == metrics["collectives_per_step"]
    # the last block's share of AdamW's sums: its 2 norms' weights and biases, 3 each
    assert c["per_block"]["optimizer"] == {"all_reduce": 12} and c["per_block"]["between"] == {}
    assert c["sent_bytes_per_block"]["optimizer"] == pytest.approx(12 * ring(WORLD, "all_reduce") * SMALL)
    assert c["sent_bytes_per_block"]["between"] == 0
    # the whole step: the blocks, the way into the sequence split and out of it (an all-gather
    # of the gradient, one of the activations), the last norm's sums; the phases add up to it
    outside = 2 * ring(WORLD, "all_gather") * ACTIVATION + 6 * ring(WORLD, "all_reduce") * SMALL
    assert c["sent_bytes_per_step"] == pytest.approx(T.N_BLOCKS * sum(c["sent_bytes_per_block"].values()) + outside)
    assert c["sent_bytes_per_step"] == pytest.approx(sum(c["sent_bytes_by_phase"].values()))
    local, full = c["split_param_bytes"]
    assert local * WORLD == full
    assert re.search(r"│ optimizer step +│ 30 +│ 0 +│ 0 +│ 7,680 +│", out), out  # the table's row
    # CommLog recorded only the printed steps (it slows every op): 5 of 10
    assert f"({STEPS // 2} steps recorded)" in out


def test_recording_the_printed_steps_gives_every_steps_numbers(lesson, worlds):
    """Every step sends the same: the lesson's printed steps give the numbers of every step of
    the same variant, recorded in full."""
    _, _, metrics = lesson
    every = worlds[WORLD][0]["dtensor sp=True"]["counts"]
    for key in ("per_step", "per_step_by_phase", "sent_bytes_by_phase", "per_block", "sent_bytes_per_block"):
        assert metrics["collectives"][key] == every[key], key


def test_the_picture_is_drawn_from_the_blocks_collectives_in_order(lesson, folder):
    """metrics.json keeps the last block's collectives of one step in order;
    block_collective_pictures.py draws
    docs/17's picture from them (here from this run)."""
    _, _, metrics = lesson
    calls = [(p, k) for p, k, _, _ in metrics["collectives"]["block_sequence"]]
    sublayer = [("all_gather", "reduce_scatter")] * 2  # f_sp into attention, g_sp out; then the MLP
    assert [k for p, k in calls if p == "forward"] == [k for pair in sublayer for k in pair]
    assert [k for p, k in calls if p == "backward"] == [k for pair in sublayer for k in pair]
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (requirements.txt)")
    import block_collective_pictures
    assert block_collective_pictures.draw([folder], folder / "block.png").startswith("wrote")
    assert (folder / "block.png").stat().st_size > 10_000


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


def _rank_variants(rank: int, world: int, steps: int, variants: list) -> dict:
    """Each (impl, sequence parallel, use_local_output) of `variants`, trained `steps` steps as
    the lesson's Step 4 does, every collective of every step recorded as it records them."""
    import tensor_parallel
    from apparatus.comm import CommLog
    from common import transformer as T

    lesson = import_lesson("17")
    results = {}
    for impl, sp, local in variants:
        model = T.make_model()
        if impl == "manual":
            model = lesson.parallelize_by_hand(model, rank, world, sp)
        else:
            model = lesson.parallelize_dtensor(model, rank, world, sp, local_inputs=local)
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
        state = tensor_parallel.full_state_dict(model)
        counts = tensor_parallel.report(log, steps, model, _Quiet())
        name = f"{impl} sp={sp}" + (" use_local_output" if local else "")
        results[name] = {"state": state if rank == 0 else {}, "counts": counts}
    return results


@pytest.fixture(scope="module")
def worlds():
    return {world: run_ranks(_rank_variants, world, (FEW, VARIANTS + (MISTAKES if world == 2 else [])))
            for world in (1, 2, 4)}


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
            assert by_hand["sent_bytes_per_block"][phase] == pytest.approx(2 * ring(world, "all_reduce") * ACTIVATION)
        sp = worlds[world][rank]["manual sp=True"]["counts"]
        # sequence parallel: the same bytes on the wire in forward and backward, as 2 all-gathers
        # and 2 reduce-scatters each way (f_sp and g_sp per sublayer)
        for phase in ("forward", "backward"):
            assert sp["per_block"][phase] == {"all_gather": 2, "reduce_scatter": 2}
            assert sp["sent_bytes_per_block"][phase] == pytest.approx(by_hand["sent_bytes_per_block"][phase])
        # tensor parallel alone leaves no gradient to sum after backward, nor in the step
        assert by_hand["per_step_by_phase"]["between"] == by_hand["per_step_by_phase"]["optimizer"] == {}


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_plan_makes_the_by_hand_plans_collectives(worlds, world):
    """The lesson's DTensor plan: q, k and v share one DTensor input (PrepareModuleInput,
    use_local_output=False), so its gradient is summed once per sublayer, as f does by hand:
    forward and backward, with and without sequence parallel, the same calls and bytes."""
    for rank in range(world):
        for sp in (False, True):
            by_hand = worlds[world][rank][f"manual sp={sp}"]["counts"]
            dtensor = worlds[world][rank][f"dtensor sp={sp}"]["counts"]
            for phase in ("forward", "backward"):
                assert dtensor["per_block"][phase] == by_hand["per_block"][phase], (sp, phase)
                assert dtensor["sent_bytes_per_block"][phase] == pytest.approx(by_hand["sent_bytes_per_block"][phase])
        assert worlds[world][rank]["dtensor sp=False"]["counts"]["per_step_by_phase"]["optimizer"] == {}


def test_use_local_output_sends_more_in_backward(worlds):
    """The mistake the lesson's --use-local-output keeps (issue #23's numbers, 2 ranks, one
    block's backward): q, k, v and fc each get a plain tensor, and each sums its input's
    gradient: 4 all-reduces where f needs 1 per sublayer; with sequence parallel they replace
    the reduce-scatters."""
    for rank in range(WORLD):
        plain = worlds[WORLD][rank]["dtensor sp=False use_local_output"]["counts"]
        assert plain["per_block"]["backward"] == {"all_reduce": 4}
        assert plain["sent_bytes_per_block"]["backward"] == 1_572_864
        sp = worlds[WORLD][rank]["dtensor sp=True use_local_output"]["counts"]
        assert sp["per_block"]["backward"] == {"all_gather": 2, "all_reduce": 4}
        assert sp["sent_bytes_per_block"]["backward"] == 1_966_080
        for counts in (plain, sp):  # forward is the same as the lesson's plan
            assert counts["sent_bytes_per_block"]["forward"] == 786_432


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_sums_the_layernorm_gradients_outside_backward(worlds, world):
    """By hand, sequence parallel sums the whole-on-every-rank gradients once, after backward
    (lesson Step 4): the LayerNorms and the row-parallel biases. DTensor leaves the LayerNorms'
    gradients Partial and all-reduces each when AdamW's step reads it: in lerp_, and twice in
    addcmul_(grad, grad). The last block's share is its own parameters'."""
    shared = NORMS + 2 * T.N_BLOCKS   # the row-parallel biases too, by hand
    for rank in range(world):
        by_hand = worlds[world][rank]["manual sp=True"]["counts"]
        dtensor = worlds[world][rank]["dtensor sp=True"]["counts"]
        assert by_hand["per_step_by_phase"]["between"] == {"all_reduce": shared}
        assert by_hand["per_step_by_phase"]["optimizer"] == {}
        assert by_hand["per_block"]["between"] == {"all_reduce": 6}  # 2 norms x 2 + 2 biases
        assert by_hand["sent_bytes_by_phase"]["between"] == pytest.approx(shared * ring(world, "all_reduce") * SMALL)
        assert by_hand["per_step"] == {"all_reduce": shared, "all_gather": 2 * (2 * T.N_BLOCKS + 1),
                                       "reduce_scatter": 2 * 2 * T.N_BLOCKS}
        assert dtensor["per_step_by_phase"]["between"] == {}
        assert dtensor["per_step_by_phase"]["optimizer"] == {"all_reduce": 3 * NORMS}
        assert dtensor["per_block"]["optimizer"] == {"all_reduce": 12}
        assert dtensor["sent_bytes_by_phase"]["optimizer"] == pytest.approx(3 * NORMS * ring(world, "all_reduce") * SMALL)


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
    assert "add --impl dtensor" in parse_error(lesson, ["--use-local-output"], monkeypatch, capsys)
    assert math.isfinite(T.loss_floor())


def test_check_17_names_g_when_g_also_sums_in_backward(tmp_path):
    """Issue #26: a g that all-reduces in backward too makes the gradients of x, fc and proj N
    times too big; the hint names g, where it used to ask which function sums in backward (f)."""
    sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tools" / "checks")]  # as make check-17 has them
    import check_17
    from check_exercise import NotYet

    solution = (ROOT / "tests" / "solutions" / "17_conjugate_functions.py").read_text()
    g = solution.index("class G_")
    wrong = tmp_path / "17_conjugate_functions.py"
    wrong.write_text(solution[:g] + solution[g:].replace(
        "    def backward(ctx, grad):\n        return grad", "    def backward(ctx, grad):\n"
        "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad", 1))
    assert "dist.all_reduce(grad)" in wrong.read_text()
    with pytest.raises(NotYet, match="Does g sum it again in backward"):
        check_17.check(wrong)
