"""Lesson 22: expert parallel. Two runs of the lesson through its real launcher, a few steps
each (2 ranks with 4 experts and top-1; 4 ranks with 8 experts and top-2), checked against the
same mixture of experts trained in one process here (moe._train, not the lesson's cache): the
weights, the tokens per expert and the drops at every step, the all-to-all bytes beside the
formula, the gradients' scaling, capacity 2.0 against 1.0 beside a uniform router's drops, and
whether Step 1 says truly that it trained or read its baselines. In this process: the uniform
router's drop formula against a seeded simulation, and the top-k weights (renormalized for
k > 1). The hand-written differentiable all-to-all is checked against torch's own; bad flags
are refused before any rank starts."""
import argparse
import re
import sys

import pytest
import torch

from common import transformer as T
from conftest import (import_lesson, load_run, max_abs_diff, one_error_line, parse_error, run,
                      run_lesson)

import moe  # lessons/22_expert_parallel/moe.py (conftest puts the lessons' folders on the path)
import moe_report

from common.distributed import run_ranks

STEPS = 10
RUNS = {2: (4, 1), 4: (8, 2)}  # world size: (experts, top-k)
FRESH = 4  # this run's baselines are removed from the cache first: its Step 1 must train them


def baselines(experts: int, top_k: int) -> list:
    """The Setups Step 1 trains or reads for a run with these flags (factors 1.0 and 2.0)."""
    return [moe.Setup(T.SEED, experts, top_k, factor) for factor in (1.0, 2.0)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world, (experts, top_k) in RUNS.items():
        folder = tmp_path_factory.mktemp(f"lesson22-{world}")
        for setup in baselines(experts, top_k) if world == FRESH else []:
            moe.reference_path(setup, STEPS).unlink(missing_ok=True)
        cached = [moe.reference_path(setup, STEPS).exists() for setup in baselines(experts, top_k)]
        proc = run_lesson("22", "--world-size", world, "--experts", experts, "--top-k", top_k,
                          "--steps", STEPS, "--device", "cpu", "--out", folder, timeout=300)
        state, metrics = load_run(folder)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the lesson's train_single computes it
        try:
            one = moe._train(moe.Setup(T.SEED, experts, top_k, 1.0), STEPS)  # here, not read from the cache
        finally:
            torch.set_num_threads(threads)
        out[world] = (proc.stdout, state, metrics, one, cached)
    return out


@pytest.mark.parametrize("world", RUNS)
def test_same_weights_as_the_same_model_in_one_process(runs, world):
    out, state, metrics, one, _ = runs[world]
    assert state.keys() == one["state"].keys()
    diff = max((state[k].double() - one["state"][k].double()).abs().max().item() for k in state)  # float64
    assert diff <= 1e-3, diff
    assert max_abs_diff(state, one["state"]) <= 1e-3  # as every Part 2 lesson compares
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert f"max |w - w_1| = {metrics['max_abs_diff_vs_single_device']:.1e}" in out
    assert (metrics["world_size"], metrics["experts"], metrics["top_k"]) == (world, *RUNS[world])
    model = moe.moe_model(moe.Setup(T.SEED, *RUNS[world], 1.0))
    model.load_state_dict(state)  # every expert, gathered under the one-process names
    assert max(abs(a - b) for a, b in zip(metrics["losses"], one["losses"].tolist())) < 1e-6


@pytest.mark.parametrize("world", RUNS)
def test_tokens_per_expert_and_drops_equal_one_process_at_every_step(runs, world):
    out, _, metrics, one, _ = runs[world]
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
    _, _, metrics, _, _ = runs[world]
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
    _, _, metrics, _, _ = runs[world]
    g = metrics["gradient_check"]
    lo, hi = g["expert_grad_ratio_before"]  # every rank's mean loss summed by the all-to-all
    assert lo == pytest.approx(world, rel=1e-9) and hi == pytest.approx(world, rel=1e-9)
    assert g["shared_max_abs_diff_before"] > 1e-6  # this rank's tokens only: a part
    assert g["max_abs_diff_after"] < 1e-12


def test_capacity_factor_2_drops_fewer_tokens_than_1(runs):
    out, _, metrics, _, _ = runs[2]
    c = metrics["capacity_factors"]
    assert (c["1.0"]["capacity"], c["2.0"]["capacity"]) == (8, 16)  # 1 x 32 tokens / 4 experts, x 2
    assert c["2.0"]["dropped"] < c["1.0"]["dropped"]
    assert c["1.0"]["dropped"] == sum(metrics["dropped_tokens_single_device"][s][b]
                                      for s in range(STEPS) for b in range(T.N_BLOCKS))
    assert "Compare capacity factors 1.0 and 2.0" in out


@pytest.mark.parametrize("world", RUNS)
def test_drops_are_printed_beside_a_uniform_routers(runs, world):
    """Issue 34, item 5: most drops at capacity factor 1.0 are small groups' chance, not the
    router: a perfectly uniform router already drops 12.1% of a 32-token row's assignments."""
    out, _, metrics, _, _ = runs[world]
    experts, top_k = RUNS[world]
    uniform = moe.Setup(T.SEED, experts, top_k, 1.0).uniform_drop()
    assert metrics["uniform_router_drop_fraction"] == pytest.approx(uniform) == pytest.approx(0.12078, abs=1e-5)
    kept, dropped = torch.tensor(metrics["tokens_per_expert"]), torch.tensor(metrics["dropped_tokens"])
    assert metrics["dropped_fraction"] == pytest.approx((dropped.sum() / (kept.sum() + dropped.sum())).item())
    assert metrics["dropped_fraction"] > uniform  # this router is not uniform: it adds its own
    c = metrics["capacity_factors"]
    assert c["1.0"]["uniform_router_drop_fraction"] == pytest.approx(uniform)
    assert c["2.0"]["uniform_router_drop_fraction"] < 1e-3 < c["2.0"]["dropped"] / c["2.0"]["assignments"]
    assert re.search(r"│ 1\.0 +│ 8 +│ [\d,]+ \([\d.]+%\) +│ 12\.1% +│", out), out
    assert f"drops 12.1% at factor 1.0 by chance alone" in out and "E x E[max(0, X - C)] / (k x 32)" in out
    rank = {2: "768 tokens (C = 192)", 4: "384 tokens (C = 96)"}[world]
    assert f"counted over a rank's {rank} instead of a row's 32, the same uniform router would drop " \
           f"{moe.Setup(T.SEED, experts, top_k, 1.0).uniform_drop(T.GLOBAL_BATCH // world * T.SEQ):.1%}" in out


@pytest.mark.parametrize("world", RUNS)
def test_step_1_says_truly_whether_it_trained_or_read_its_baselines(runs, world):
    out, _, _, _, cached = runs[world]
    experts, top_k = RUNS[world]
    for setup, was_cached in zip(baselines(experts, top_k), cached):
        line = next(x for x in out.splitlines() if x.startswith(f"capacity factor {setup.factor}: loss"))
        said = "(read from the cache, trained by an earlier run)" if was_cached else "(trained now, cached for the next run)"
        assert line.endswith(said), (line, was_cached)
    if world == FRESH:
        assert not any(cached)  # so this run trained, and said so


def test_a_run_after_that_reads_the_cache_and_says_so(runs):
    """After the fixture's runs their baselines are cached: train_baselines reads them (no
    process starts), and Step 1's lines say so."""
    experts, top_k = RUNS[FRESH]
    args = argparse.Namespace(seed=T.SEED, experts=experts, top_k=top_k, capacity_factor=1.0,
                              dtype="float64", steps=STEPS)
    refs, trained = moe.train_baselines(args)
    assert trained == [] and list(refs) == baselines(experts, top_k)

    class Lines:
        def __init__(self):
            self.lines = []

        def print(self, text, **kwargs):
            self.lines.append(text)

    ui = Lines()
    moe_report.show_baselines(refs, trained, STEPS, ui)
    assert ui.lines[0].startswith("one process each, every expert local; the cache: ")
    assert all(line.endswith("(read from the cache, trained by an earlier run)") for line in ui.lines[1:])
    assert not any("for the next run" in line for line in ui.lines)
    ui = Lines()
    moe_report.show_baselines(refs, list(refs), STEPS, ui)  # as a run that trained them says it
    assert all(line.endswith("(trained now, cached for the next run)") for line in ui.lines[1:])


# --- the capacity's arithmetic and the router's weights, in this process ---------------------

@pytest.mark.parametrize("experts, top_k, factor", [(4, 1, 1.0), (8, 2, 1.0), (4, 1, 2.0), (4, 1, 1.25)])
def test_uniform_router_drop_is_the_binomial_formula_and_a_seeded_simulation_agrees(experts, top_k, factor):
    setup = moe.Setup(T.SEED, experts, top_k, factor)
    exact = setup.uniform_drop()
    rows, g = 20_000, torch.Generator().manual_seed(0)
    picks = torch.rand(rows, T.SEQ, experts, generator=g).argsort(-1)[..., :top_k]  # k distinct, at random
    per_expert = torch.nn.functional.one_hot(picks, experts).sum((1, 2))  # (rows, E): assignments per row
    simulated = (per_expert - setup.capacity).clamp(min=0).sum() / (rows * T.SEQ * top_k)
    assert simulated.item() == pytest.approx(exact, abs=0.003), (simulated, exact)
    assert 0 <= exact < 1


def test_uniform_router_drop_numbers_of_the_issue_and_its_edges():
    one_row = moe.Setup(T.SEED, 4, 1, 1.0)
    assert one_row.uniform_drop() == pytest.approx(0.12078, abs=1e-5)  # 32 tokens, C = 8
    assert one_row.uniform_drop(768) == pytest.approx(0.02492, abs=1e-5)  # a rank's tokens, C = 192
    assert one_row.capacity_of(768) == 192 and one_row.capacity_of(T.SEQ) == one_row.capacity == 8
    assert 0 < one_row.uniform_drop(T.GLOBAL_BATCH * T.SEQ) < one_row.uniform_drop(768)  # 1,536: no overflow
    assert moe.Setup(T.SEED, 4, 4, 1.0).uniform_drop() == 0.0  # every token picks every expert: X = C
    assert moe.Setup(T.SEED, 4, 4, 0.5).uniform_drop() == pytest.approx(0.5)  # X = 32, C = 16


def test_top_k_weights_are_renormalized_for_k_above_1_and_the_probability_for_k_1():
    """Issue 34, item 5: `--top-k 2` is GShard's and Mixtral's top-2 only with the two gates
    renormalized to sum to 1; top-1 keeps the router's probability, as the Switch Transformer."""
    x = torch.randn(3, T.SEQ, T.DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for k in (1, 2, 3):
        layer = moe.MoE(moe.Setup(T.SEED, 4, k, 1.0), block=0).double()
        weight, expert, _ = layer.route(x)  # (B, k, S)
        probs = layer.router(x).softmax(-1)
        chosen = probs.gather(-1, expert.transpose(1, 2)).transpose(1, 2)
        if k == 1:
            torch.testing.assert_close(weight, chosen)
        else:
            torch.testing.assert_close(weight.sum(1), torch.ones(3, T.SEQ, dtype=torch.float64))
            torch.testing.assert_close(weight, chosen / chosen.sum(1, keepdim=True))
    parser = argparse.ArgumentParser()
    moe.add_flags(parser)
    assert "renormalized to sum to 1" in " ".join(parser.format_help().split())  # --top-k's help says it


@pytest.mark.parametrize("world", RUNS)
def test_prints_the_steps_in_order_and_the_split_sizes(runs, world):
    out, _, metrics, _, _ = runs[world]
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
    # issue 35: --experts 100000000 passed the checks and died allocating 25.6 GB
    line = parse_error(lesson, ["--experts", "100000000"], monkeypatch, capsys)
    assert "--experts 100000000 would need 197,601.3 GiB in one process" in line and "up to 1,012" in line, line
    most = int(line.split("up to ")[1].split(" ")[0].replace(",", ""))
    for fine in ("8", str(most - most % 2)):  # the suggestion, and the largest even count, pass
        monkeypatch.setattr(sys, "argv", ["22", "--experts", fine])
        assert lesson.parse_args().experts == int(fine)
    parse_error(lesson, ["--experts", str(most + 1), "--world-size", "1"], monkeypatch, capsys)


def test_make_refuses_a_world_size_that_does_not_divide_the_experts(tmp_path):
    proc = run(["make", "-s", "lesson-22", f"ARGS=--world-size 3 --out {tmp_path / 'out'}"], check=False, timeout=60)
    assert proc.returncode == 2 and one_error_line(proc).startswith("error: --world-size"), proc.stderr
    assert "Step" not in proc.stdout and not (tmp_path / "out").exists()  # nothing started, nothing claimed
