"""Lesson 15 in practice (lessons/15_zero_fsdp/in_practice.py): FSDP2's knobs, each measured.

One run of the script as a learner starts it (4 ranks, its default steps), shared by every test
here; each test reads the numbers it wrote to metrics.json and would fail if the mechanism it
shows stopped working: bf16 all-gathers half of fp32's bytes, accumulation reduce-scatters once
per group, explicit prefetch moves the all-gathers ahead of the blocks' forwards, HSDP holds
half the model per rank and ends with lesson 13's weights, the DTensor gradient norm is the
one-process norm, and a scheduler's lr reaches ZeRO's inner optimizer only from the wrapper.
"""
import math
import re
import sys

import pytest

from common import transformer as T
from conftest import ROOT, load_run, max_abs_diff, run

SCRIPT = ROOT / "lessons" / "15_zero_fsdp" / "in_practice.py"
DOC = ROOT / "docs" / "15_zero_fsdp.md"


@pytest.fixture(scope="module")
def practice(tmp_path_factory):
    """(stdout, final.pt, metrics.json) of one default run."""
    out = tmp_path_factory.mktemp("in-practice")
    proc = run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], timeout=300)
    return (proc.stdout, *load_run(out))


@pytest.fixture(scope="module")
def reference(practice):
    """Lesson 13's single-process answer for the run's steps (common/transformer.py caches it)."""
    return T.train_reference(T.SEED, practice[2]["steps"])


def test_fp32_baseline_gathers_what_the_formula_says_and_is_lesson_13(practice):
    _, _, m = practice
    base = m["baseline"]
    assert base["all_gather_bytes"] == base["all_gather_formula"]
    assert base["all_gather_calls"] == 2 * T.N_BLOCKS + 1  # blocks twice, the root once
    assert base["max_abs_diff_vs_13"] <= 1e-3


def test_bf16_policy_gathers_half_the_bytes_and_reduces_in_fp32(practice):
    out, _, m = practice
    base, bf16 = m["baseline"], m["bf16"]
    assert 2 * bf16["all_gather_bytes"] == base["all_gather_bytes"]
    assert bf16["reduce_scatter_bytes"] == base["reduce_scatter_bytes"]  # reduce_dtype=float32
    assert bf16["peak_bytes"] < base["peak_bytes"]
    # a different run, reported as such: bf16 compute is not lesson 13's within 1e-3
    assert bf16["max_abs_diff_vs_13"] > 1e-3 and f"{bf16['max_abs_diff_vs_13']:.1e}" in out


def test_accumulation_reduce_scatters_once_per_group_and_is_lesson_13(practice):
    _, _, m = practice
    acc = m["accumulation"]
    assert acc["groups"] == T.N_BLOCKS + 1
    assert acc["reduce_scatter_calls"] == acc["groups"]  # the last micro-batch only
    assert acc["reduce_scatter_calls_naive"] == acc["k"] * acc["groups"]
    assert acc["all_gather_calls"] == acc["k"] * m["baseline"]["all_gather_calls"]
    assert acc["max_abs_diff_vs_13"] <= 1e-3  # the loss divided by k: the same mean gradient


def test_explicit_prefetch_gathers_each_block_before_its_forward(practice):
    _, _, m = practice
    default, explicit = m["prefetch"]["default"], m["prefetch"]["explicit"]

    def gathered_in(rows, hook, module):
        return next(issued for h, mod, issued in rows if h.strip() == hook and mod == module)

    assert gathered_in(default, "pre_forward", "blocks.1").startswith("all-gather")
    assert gathered_in(explicit, "pre_forward", "blocks.1") == "-"  # gathered already
    prefetch = [i for i, (h, mod, _) in enumerate(explicit) if h.strip() == "prefetch in blocks.0's"]
    forward = [i for i, (h, mod, _) in enumerate(explicit) if h == "pre_forward" and mod == "blocks.1"]
    assert prefetch and prefetch[0] < forward[0]
    assert m["prefetch"]["max_abs_diff_vs_baseline"] == 0.0  # the same work, in another order
    assert m["prefetch"]["all_gather_bytes"] == m["baseline"]["all_gather_bytes"]


def test_hsdp_holds_half_per_rank_and_ends_with_lesson_13s_weights(practice, reference):
    _, state, m = practice
    hsdp = m["hsdp"]
    assert hsdp["mesh"] == [2, m["world_size"] // 2]
    assert len(hsdp["param_fraction_per_rank"]) == m["world_size"]
    assert all(0.5 <= f < 0.51 for f in hsdp["param_fraction_per_rank"])  # 1/2, plus padding
    for name, dim in hsdp["per_dimension"].items():
        assert dim["bytes"] == dim["formula"], name
    assert hsdp["per_dimension"]["replicate:all_reduce"]["calls"] == T.N_BLOCKS + 1
    diff = max_abs_diff(state, reference["state"])  # final.pt holds the HSDP run's weights
    assert diff <= 1e-3 and hsdp["max_abs_diff_vs_13"] == pytest.approx(diff)
    assert m["losses"] == pytest.approx(reference["losses"].tolist(), abs=1e-4)


def test_cpu_offload_ran_and_trained_lesson_13s_weights(practice):
    _, _, m = practice
    off = m["offload"]
    assert off["where"]["sharded parameters"] == "cpu" and off["where"]["optimizer state"] == "cpu"
    assert off["max_abs_diff_vs_13"] <= 1e-3


def test_clip_grad_norm_is_the_global_norm_and_local_norms_are_not(practice):
    _, _, m = practice
    clip = m["clip"]
    one = clip["one_process_norm"]
    assert all(g == pytest.approx(one, rel=1e-5) for g in clip["global_norm_per_rank"])
    local = clip["local_norm_per_rank"]
    assert len({round(n, 6) for n in local}) == len(local)  # a different number on every rank
    assert all(n < one for n in local)
    assert math.sqrt(sum(n * n for n in local)) == pytest.approx(one, rel=1e-5)
    assert clip["by_hand_norm"] == pytest.approx(one, rel=1e-5)
    assert "all_reduce" in clip["collectives"]  # DTensor summed the shards' squares


def test_scheduler_lr_reaches_zeros_inner_optimizer_only_from_the_wrapper(practice):
    _, _, m = practice
    sched = m["scheduler"]
    assert sched["used"]["wrapper"] == pytest.approx(sched["schedule"])
    assert sched["used"]["inner"] == pytest.approx([T.LR] * m["steps"])  # overwritten every step
    assert sched["schedule"] != pytest.approx([T.LR] * m["steps"])
    diffs = sched["max_abs_diff_vs_one_process"]
    assert diffs["wrapper"] <= 1e-3 < diffs["inner"]


def test_steps_are_printed_and_named_in_the_doc(practice):
    out, _, _ = practice
    source = SCRIPT.read_text()
    steps = re.findall(r"^\s*# Step (\d+): (.+?)\s*$", source, re.M)
    assert [int(n) for n, _ in steps] == list(range(1, 10))
    doc = DOC.read_text()
    section = doc[doc.index("### FSDP2 in practice"):]
    assert doc.index("## Going further") < doc.index("### FSDP2 in practice")
    for n, title in steps:
        assert f'step({n}, "{title}")' in source and f"Step {n}: {title}" in out
        assert f"Step {n}: {title}" in section, f"the doc's FSDP2 in practice lacks Step {n}: {title}"
    assert f"<!-- output: .venv/bin/python {SCRIPT.relative_to(ROOT)} -->" in section

