"""Lesson 22: expert parallel. Two runs of the lesson through its real launcher, a few steps
each (2 ranks with 4 experts and top-1; 4 ranks with 8 experts and top-2), checked against the
same mixture of experts trained in one process here (moe._train, not the lesson's cache): the
weights, the tokens per expert and the drops at every step, the all-to-all bytes beside the
formula, the gradients' scaling, capacity 2.0 against 1.0. The hand-written differentiable
all-to-all is checked against torch's own; bad flags are refused before any rank starts."""
import re

import pytest
import torch

from common import transformer as T
from conftest import (import_lesson, load_run, max_abs_diff, one_error_line, parse_error, run, 
                      run_lesson)

import moe as M  # lessons/22_expert_parallel/moe.py (conftest puts the lessons' folders on the path)

from common.distributed import run_ranks

STEPS = 10
RUNS = {2: (4, 1), 4: (8, 2)}  # world size: (experts, top-k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world, (experts, top_k) in RUNS.items():
        folder = tmp_path_factory.mktemp(f"lesson22-{world}")
        proc = run_lesson("22", "--world-size", world, "--experts", experts, "--top-k", top_k,
                          "--steps", STEPS, "--device", "cpu", "--out", folder, timeout=300)
        state, metrics = load_run(folder)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the lesson's train_single computes it
        try:
            one = M._train(M.Setup(T.SEED, experts, top_k, 1.0), STEPS)  # here, not read from the cache
        finally:
            torch.set_num_threads(threads)
        out[world] = (proc.stdout, state, metrics, one)
    return out


@pytest.mark.parametrize("world", RUNS)
def test_same_weights_as_the_same_model_in_one_process(runs, world):
    out, state, metrics, one = runs[world]
    assert state.keys() == one["state"].keys()
    diff = max((state[k].double() - one["state"][k].double()).abs().max().item() for k in state)  # float64
    assert diff <= 1e-3, diff
    assert max_abs_diff(state, one["state"]) <= 1e-3  # as every Part 2 lesson compares
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert f"max |w - w_1| = {metrics['max_abs_diff_vs_single_device']:.1e}" in out
    assert (metrics["world_size"], metrics["experts"], metrics["top_k"]) == (world, *RUNS[world])
    model = M.moe_model(M.Setup(T.SEED, *RUNS[world], 1.0))
    model.load_state_dict(state)  # every expert, gathered under the one-process names
    assert max(abs(a - b) for a, b in zip(metrics["losses"], one["losses"].tolist())) < 1e-6


@pytest.mark.parametrize("world", RUNS)
def test_tokens_per_expert_and_drops_equal_one_process_at_every_step(runs, world):
    out, _, metrics, one = runs[world]
    experts, top_k = RUNS[world]
    kept, dropped = one["counts"][:, :, 0], one["counts"][:, :, 1]
    assert metrics["tokens_per_expert"] == kept.tolist()  # (steps, blocks, experts)
    assert metrics["dropped_tokens"] == dropped.sum(-1).tolist()  # (steps, blocks)
    assert metrics["tokens_per_expert_single_device"] == kept.tolist()
    # every assignment is kept or dropped: k per token, in every block at every step
    tpe = torch.tensor(metrics["tokens_per_expert"])
    assert (tpe.sum(-1) + torch.tensor(metrics["dropped_tokens"]) == T.GLOBAL_BATCH * T.SEQ * top_k).all()
    # no expert takes more than its capacity in any row: at most capacity x rows over the batch
    assert metrics["capacity"] == -(-top_k * T.SEQ // experts) and tpe.max() <= metrics["capacity"] * T.GLOBAL_BATCH
    assert f"all {STEPS} steps, every block and expert, the same as one process: True" in out


@pytest.mark.parametrize("world", RUNS)
def test_all_to_all_bytes_equal_the_formula(runs, world):
    _, _, metrics, _ = runs[world]
    experts, _ = RUNS[world]
    measured = {int(s): b for s, b in metrics["all_to_all_bytes_per_step"].items()}
    assert 1 in measured and STEPS in measured
    for step, sent in measured.items():
        kept = sum(sum(block) for block in metrics["tokens_per_expert"][step - 1])
        # dispatch, combine and their two backwards carry every kept token's DIM float64
        # values; the split sizes: E int64 counts per rank and MoE layer
        assert sent == 4 * kept * T.DIM * 8 + T.N_BLOCKS * world * experts * 8, step
        assert metrics["all_to_all_bytes_formula"][step - 1] == sent


@pytest.mark.parametrize("world", RUNS)
def test_expert_gradients_need_no_all_reduce_only_the_division_by_n(runs, world):
    _, _, metrics, _ = runs[world]
    g = metrics["gradient_check"]
    lo, hi = g["expert_grad_ratio_before"]  # every rank's mean loss summed by the all-to-all
    assert lo == pytest.approx(world, rel=1e-9) and hi == pytest.approx(world, rel=1e-9)
    assert g["shared_max_abs_diff_before"] > 1e-6  # this rank's tokens only: a part
    assert g["max_abs_diff_after"] < 1e-12


def test_capacity_factor_2_drops_fewer_tokens_than_1(runs):
    out, _, metrics, _ = runs[2]
    c = metrics["capacity_factors"]
    assert (c["1.0"]["capacity"], c["2.0"]["capacity"]) == (8, 16)  # 1 x 32 tokens / 4 experts, x 2
    assert c["2.0"]["dropped"] < c["1.0"]["dropped"]
    assert c["1.0"]["dropped"] == sum(metrics["dropped_tokens_single_device"][s][b]
                                      for s in range(STEPS) for b in range(T.N_BLOCKS))
    assert "Compare capacity factors 1.0 and 2.0" in out


@pytest.mark.parametrize("world", RUNS)
def test_prints_the_steps_in_order_and_the_split_sizes(runs, world):
    out, _, metrics, _ = runs[world]
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 13))
    assert "rank 0 holds" in out and "split sizes" in out
    assert not {"memory_bytes", "activations_checkpointed_bytes", "loss_bf16"} & set(metrics)


# --- the differentiable all-to-all against torch's own --------------------------------------

def _rank_all_to_all(rank: int, world: int) -> dict:
    import torch
    import torch.distributed.nn.functional as dfn

    import moe
    g = torch.Generator().manual_seed(rank)
    send = [(rank + 2 * s) % 3 for s in range(world)]  # uneven, and some empty
    recv = [(s + 2 * rank) % 3 for s in range(world)]
    x = torch.randn(sum(send), 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(sum(recv), 5, generator=g, dtype=torch.float64)
    ours = moe.AllToAll.apply(x, recv, send)
    (ours * weight).sum().backward()
    mine = x.grad.clone()
    x.grad = None
    theirs = dfn.all_to_all_single(x.new_empty(sum(recv), 5), x, recv, send)
    (theirs * weight).sum().backward()
    return {"forward": (ours - theirs).abs().max().item() if len(ours) else 0.0,
            "backward": (mine - x.grad).abs().max().item() if len(mine) else 0.0, "rows": len(ours)}


@pytest.mark.parametrize("world", [2, 3])
def test_hand_written_all_to_all_matches_torch_distributed_nn(world):
    """moe.AllToAll (its backward: the same exchange with the splits swapped) against
    torch.distributed.nn.functional.all_to_all_single, with uneven and empty splits."""
    for r in run_ranks(_rank_all_to_all, world, ()):
        torch.testing.assert_close(r["forward"], 0.0)
        torch.testing.assert_close(r["backward"], 0.0)


# --- bad input -------------------------------------------------------------------------------

def test_bad_flags_are_one_line_before_any_rank_starts(monkeypatch, capsys):
    lesson = import_lesson("22")
    line = parse_error(lesson, ["--world-size", "3"], monkeypatch, capsys)
    assert "4 experts" in line and line.endswith("use one of 1, 2, 4"), line
    line = parse_error(lesson, ["--experts", "6", "--world-size", "4"], monkeypatch, capsys)
    assert "6 experts" in line and line.endswith("use one of 1, 2, 3, 6"), line
    assert "--top-k 5 is more than the 4 experts" in parse_error(lesson, ["--top-k", "5"], monkeypatch, capsys)
    for bad in ("0", "-1", "nan"):
        assert "--capacity-factor" in parse_error(lesson, ["--capacity-factor", bad], monkeypatch, capsys)


def test_make_refuses_a_world_size_that_does_not_divide_the_experts(tmp_path):
    proc = run(["make", "-s", "lesson-22", f"ARGS=--world-size 3 --out {tmp_path / 'out'}"], check=False, timeout=60)
    assert proc.returncode == 2 and one_error_line(proc).startswith("error: --world-size"), proc.stderr
    assert "Step" not in proc.stdout and not (tmp_path / "out").exists()  # nothing started, nothing claimed
