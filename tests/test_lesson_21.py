"""Lesson 21: context parallel, ring attention by hand. Two runs of the lesson through its
real launcher feed the end-to-end assertions (2 ranks, contiguous, 20 steps; 4 ranks,
balanced, 3 steps): attention and its gradients against F.scaled_dot_product_attention, lesson
13's weights, each rank's work in both layouts, the bytes beside the formulas, the activations
each rank saves against lesson 13's (the reason for context parallel) and the scores. The
layout helpers, and the ring in a world of one against lesson 13's SDPA, are checked in this
process; a bad world size is refused before any rank starts; torch's own context_parallel is
shown to refuse the CPU, and the doc's Going further names only what the pinned torch has."""
import functools
import re

import pytest

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, max_abs_diff, one_error_line, parse_error, run, run_lesson, weights_line

from common.distributed import run_ranks

import ring_attention  # lessons/21_context_parallel/, on the path by conftest
import ring_measure

RUNS = {2: ("contiguous", 20), 4: ("balanced", 3)}  # world size: (training layout, steps)


@pytest.fixture
def one_thread():
    """One torch thread, as the lesson's ranks compute: the in-process forwards below take
    milliseconds instead of seconds on a loaded 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
def test_each_rank_saves_1_over_n_of_lesson_13s_activations(lessons, world, one_thread):
    """Issue 34, item 4: what context parallel buys is 1/N of every layer's saved activations,
    measured with lesson 13's own instrument against lesson 13's model in one process."""
    out, _, metrics = lessons[world]
    x, y = T.batch(0)
    model = T.make_model()
    whole = ring_measure.saved_activation_bytes(model, model, x, y)  # here, not the lesson's number
    assert metrics["saved_activation_bytes_lesson_13"] == whole
    mine = metrics["saved_activation_bytes_per_rank"]
    assert len(mine) == world and len(set(mine)) == 1  # every rank the same share
    assert mine[0] * world - whole == 4 * (world - 1)  # 1/N of every per-token byte; the loss's
    # one 4-byte scalar (not per token) is on every rank whole
    assert mine[0] >= 2 * T.N_BLOCKS * T.GLOBAL_BATCH * (T.SEQ // world) * T.DIM * 4  # K and V among them
    assert re.search(rf"│ rank {world - 1} +│ {mine[-1]:,} +│ {1 / world:.3f} \(1/N = {1 / world:.3f}\) +│", out)
    assert re.search(rf"│ lesson 13, one process +│ {whole:,} +│", out)
    assert "each rank saves 1/N of every layer's activations" in out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_each_rank_computes_one_tile_of_scores_and_that_is_not_the_reason(lessons, world):
    out, _, metrics = lessons[world]
    whole = T.GLOBAL_BATCH * T.N_HEADS * T.SEQ * T.SEQ * 4
    assert metrics["score_bytes_whole_sequence"] == whole
    assert metrics["score_bytes_per_rank"] * (2 * world) ** 2 == whole
    assert f"1/{(2 * world) ** 2} = 1/(2N)^2" in out
    assert "lesson 13's SDPA saves none either" in out and "not what N ranks buy" in out
    assert "that is why context parallel exists" not in (ROOT / "docs" / "21_context_parallel.md").read_text()


def test_the_ring_in_a_world_of_one_saves_what_lesson_13s_sdpa_saves(one_thread):
    """The doc's claim that one process never held the scores either: the ring keeps q, k, v,
    the output and its log-sum-exp by construction (save_for_backward, no scores); in a world
    of one (no process group, no hop) it saves exactly the bytes of lesson 13's model, whose
    SDPA is a flash-attention kernel on the CPU. A saved (B, heads, S, S) block of scores per
    layer would add 786,432 bytes each."""
    import torch

    lesson = import_lesson("21")
    x, y = T.batch(0)
    sdpa = T.make_model()
    ring = ring_attention.Ring("contiguous", 0, 1, T.SEQ)
    model = T.make_model()
    for block in model.blocks:
        block.attn.forward = functools.partial(lesson.context_parallel_attention, block.attn, ring=ring)
    forward = functools.partial(lesson.forward_context_parallel, model, ring=ring)
    torch.testing.assert_close(forward(x), sdpa(x), rtol=0, atol=1e-5)  # the same model
    ours, theirs = (ring_measure.saved_activation_bytes(m, f, x, y) for m, f in ((model, forward), (sdpa, sdpa)))
    assert ours == theirs, (ours, theirs)


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
        rings = [ring_attention.Ring(layout, r, world, T.SEQ) for r in range(world)]
        held = sorted(p for ring in rings for p in ring.mine.tolist())
        assert held == list(range(T.SEQ)), layout
        tiles = [sum(len(ring.tiles_of(owner)) for owner in range(world)) for ring in rings]
        assert tiles == ([4 * r + 3 for r in range(world)] if layout == "contiguous" else [2 * world + 1] * world)
    assert ring_attention.chunks_of(1, 4, "balanced") == (1, 6) and ring_attention.chunks_of(1, 4, "contiguous") == (2, 3)
    assert ring_attention.spans(ring_attention.positions(0, 2, "balanced", T.SEQ)) == "0-7, 24-31"


def test_merge_is_softmax_over_both_parts():
    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) * 30 for n in (5, 12, 12))  # large scores too
    (a, la), (b, lb) = ring_attention.attend(q, k[..., :5, :], v[..., :5, :], None), ring_attention.attend(q, k[..., 5:, :], v[..., 5:, :], None)
    out, lse = ring_attention.merge(a, la, b, lb)
    whole, whole_lse = ring_attention.attend(q, k, v, None)
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


def test_going_further_names_what_the_pinned_torch_has():
    """Issue 34, item 6: torch 2.14.1's FlexAttention context-parallel path and its three load
    balancers are described, by names that exist in the pinned torch, in both languages."""
    from torch.distributed.tensor.experimental import _context_parallel as cp
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

    names = {"_ContextParallel": cp, "flex_cp_allgather": cp, "_context_parallel_shard": cp,
             "context_parallel_unshard": cp, "_HeadTailLoadBalancer": _load_balancer,
             "_PerDocumentHeadTailLoadBalancer": _load_balancer, "_PTRRLoadBalancer": _load_balancer,
             "_create_cp_block_mask": _attention, "set_rotate_method": _attention}
    assert cp._ContextParallel.AttentionType.FLEX.value == "flex_attention"
    for doc in ("21_context_parallel.md", "zh/21_context_parallel.md"):
        text = (ROOT / "docs" / doc).read_text()
        for name, module in names.items():
            assert hasattr(module, name), name
            assert f"`{name}" in text, (doc, name)


def test_the_doc_explains_merge_without_printing_the_exercises_answer():
    """The classroom (issue 34): exercise 21 asks for merge; the doc explains the rule in
    words and does not print the lesson's merge lines, in either language."""
    import inspect

    body = [line.strip() for line in inspect.getsource(ring_attention.merge).splitlines()
            if line.strip().startswith(("new =", "return"))]
    assert len(body) == 2, body
    for doc in ("21_context_parallel.md", "zh/21_context_parallel.md"):
        text = (ROOT / "docs" / doc).read_text()
        for line in body:
            assert line not in text, (doc, line)
        assert "exercise 21" in text.lower() or "练习 21" in text
