"""Lesson 21: context parallel, ring attention by hand. Two runs of the lesson through its
real launcher feed the end-to-end assertions (2 ranks, contiguous, 20 steps; 4 ranks,
balanced, 3 steps): attention and its gradients against F.scaled_dot_product_attention, lesson
13's weights, each rank's work in both layouts, the bytes beside the formulas, the scores held.
The layout helpers are checked in this process for every allowed world size; a bad world size
is refused before any rank starts; torch's own context_parallel is shown to refuse the CPU."""
import re

import pytest

from common import transformer as T
from conftest import import_lesson, load_run, max_abs_diff, one_error_line, parse_error, run, run_lesson, weights_line

from common.distributed import run_ranks

import ring_attention as R  # noqa: E402  (lessons/21_context_parallel/, on the path by conftest)

RUNS = {2: ("contiguous", 20), 4: ("balanced", 3)}  # world size: (training layout, steps)


@pytest.fixture(scope="module")
def lessons(tmp_path_factory):
    found = {}
    for world, (layout, steps) in RUNS.items():
        folder = tmp_path_factory.mktemp(f"lesson21-{world}")
        proc = run_lesson("21", "--world-size", world, "--layout", layout, "--steps", steps,
                          "--device", "cpu", "--out", folder, timeout=300)
        state, metrics = load_run(folder)
        found[world] = (proc.stdout, state, metrics)
    return found


@pytest.mark.parametrize("world", sorted(RUNS))
def test_ring_attention_and_its_gradients_are_sdpas(lessons, world):
    out, _, metrics = lessons[world]
    assert metrics["attention_max_abs_diff"] <= 1e-5
    assert metrics["attention_grad_max_abs_diff"] <= 1e-5
    for layout in ("contiguous", "balanced"):
        diffs = metrics["attention_diffs"][layout]  # output, dq, dk, dv
        assert len(diffs) == 4 and max(diffs) <= 1e-5, (layout, diffs)
        assert re.search(rf"{layout}: max \|out - sdpa\| = [\d.e+-]+; max \|grad - sdpa's\| for q, k, v = ", out)


@pytest.mark.parametrize("world", sorted(RUNS))
def test_ends_with_lesson_13s_weights_beside_the_floor(lessons, world):
    out, state, metrics = lessons[world]
    layout, steps = RUNS[world]
    reference = T.train_reference(steps=steps)
    diff = max_abs_diff(state, reference["state"])
    floor = max_abs_diff(T.train_reference(steps=steps, chunks=world)["state"], reference["state"])
    assert diff <= 1e-3, diff
    assert weights_line(diff, floor, world) in out and metrics["max_abs_diff_floor"] == pytest.approx(floor)
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert (metrics["world_size"], metrics["layout"], metrics["lesson"]) == (world, layout, "21")
    # the mean of the ranks' losses, each over its 1/N of the tokens, is the whole batch's loss
    assert max(abs(a - b) for a, b in zip(metrics["losses"], reference["losses"].tolist())) < 1e-3
    T.make_model().load_state_dict(state)  # lesson 13's names and shapes: the model is whole


@pytest.mark.parametrize("world", sorted(RUNS))
def test_contiguous_loads_the_last_rank_and_balanced_evens_it(lessons, world):
    out, _, metrics = lessons[world]
    work = metrics["work_per_rank"]
    assert work["contiguous"] == [4 * r + 3 for r in range(world)]
    assert work["balanced"] == [2 * world + 1] * world
    assert sum(work["contiguous"]) == sum(work["balanced"])  # the same tiles, dealt differently
    assert work["contiguous"][-1] / work["contiguous"][0] >= world  # (4N-1)/3: at least N times
    ratio = work["contiguous"][-1] / work["contiguous"][0]
    assert f"contiguous: {sum(work['contiguous'])} tiles in all; the busiest rank computes {ratio:.2f}x" in out
    assert "balanced: " + f"{sum(work['balanced'])} tiles in all; the busiest rank computes 1.00x" in out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_bytes_sent_match_the_formulas(lessons, world):
    out, _, metrics = lessons[world]
    block = T.GLOBAL_BATCH * (T.SEQ // world) * T.DIM * 4  # K (or V) of one rank's tokens
    formula = {"forward": (world - 1) * 2 * block, "backward": (world - 1) * 4 * block}
    assert metrics["bytes_sent_per_layer_formula"] == formula
    for phase, expected in formula.items():
        assert metrics["bytes_sent_per_layer"][phase] == [expected] * world, phase
        assert metrics["bytes_sent_per_step"][phase] == [expected * T.N_BLOCKS] * world
        assert re.search(rf"│ {phase} +│ {expected:,} on every rank +│ {expected:,} +│", out), out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_each_rank_holds_one_tile_of_scores(lessons, world):
    out, _, metrics = lessons[world]
    whole = T.GLOBAL_BATCH * T.N_HEADS * T.SEQ * T.SEQ * 4
    assert metrics["score_bytes_whole_sequence"] == whole
    assert metrics["score_bytes_per_rank"] * (2 * world) ** 2 == whole
    assert f"1/{(2 * world) ** 2} = 1/(2N)^2" in out


def test_prints_the_steps_in_order_and_keeps_lesson_13s_demonstrations_in_13(lessons):
    out, _, metrics = lessons[2]
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 10))
    assert not {"memory_bytes", "activations_checkpointed_bytes", "activations_bf16_bytes",
                "checkpointed_losses", "loss_bf16", "seconds_forward_backward"} & set(metrics)
    assert "│ 0    │ 0-15       │ 0-7, 24-31 │" in out  # the positions each rank holds


# --- the layout, in this process -------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_layouts_deal_every_position_once_and_the_tiles_follow_the_formulas(world):
    for layout in ("contiguous", "balanced"):
        rings = [R.Ring(layout, r, world, T.SEQ) for r in range(world)]
        held = sorted(p for ring in rings for p in ring.mine.tolist())
        assert held == list(range(T.SEQ)), layout
        tiles = [sum(len(ring.tiles_of(owner)) for owner in range(world)) for ring in rings]
        assert tiles == ([4 * r + 3 for r in range(world)] if layout == "contiguous" else [2 * world + 1] * world)
    assert R.chunks_of(1, 4, "balanced") == (1, 6) and R.chunks_of(1, 4, "contiguous") == (2, 3)
    assert R.spans(R.positions(0, 2, "balanced", T.SEQ)) == "0-7, 24-31"


def test_merge_is_softmax_over_both_parts():
    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) * 30 for n in (5, 12, 12))  # large scores too
    (a, la), (b, lb) = R.attend(q, k[..., :5, :], v[..., :5, :], None), R.attend(q, k[..., 5:, :], v[..., 5:, :], None)
    out, lse = R.merge(a, la, b, lb)
    whole, whole_lse = R.attend(q, k, v, None)
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, whole_lse)


# --- refusals ------------------------------------------------------------------------------

def test_world_sizes_that_do_not_split_the_sequence_are_refused(monkeypatch, capsys):
    lesson = import_lesson("21")
    for n in ("3", "5", "16"):
        line = parse_error(lesson, ["--world-size", n], monkeypatch, capsys)
        assert "16 tokens of half a sequence" in line and line.endswith("use one of 1, 2, 4, 8"), line
    assert "--layout" in parse_error(lesson, ["--layout", "zigzag"], monkeypatch, capsys)


def test_make_refuses_world_size_5_in_one_line_before_any_rank_starts(tmp_path):
    proc = run(["make", "-s", "lesson-21", f"ARGS=--world-size 5 --out {tmp_path / 'out'}"], check=False, timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 2 and line.startswith("error: --world-size must divide"), line
    assert "Lesson 21" not in proc.stdout and "Step 1" not in proc.stdout  # no rank started
    assert not (tmp_path / "out").exists()  # refused before it claimed --out


# --- torch's own context_parallel on the CPU (the doc's "Going further") -----------------------

def _torch_context_parallel(rank: int, world: int) -> str:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as exc:
        return str(exc)
    return "ran"


def test_torch_context_parallel_has_no_cpu_sharding_strategy():
    """What docs/21_context_parallel.md says, on the pinned torch: on the CPU, SDPA runs
    aten._scaled_dot_product_flash_attention_for_cpu, and DTensor has no sharding strategy
    for it (context parallel handles the CUDA flash, efficient and cuDNN kernels only)."""
    for text in run_ranks(_torch_context_parallel, 2, ()):
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding " \
               "strategy registered" in text, text
