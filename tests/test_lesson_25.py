"""Lesson 25: DTensor by itself. One run through `make lesson-25` as a learner types it (4 gloo
ranks, then the same program under LocalTensorMode in rank 0) feeds the end-to-end assertions:
what each rank holds, every redistribution's collective and bytes against formulas worked out
here, the propagated placements, the Partial pitfalls, LocalTensorMode against gloo, and every
whole result against one process. In this test's own process, on a fake process group: the
lesson's transcription of torch's redistribution planner against torch's own planner, and
LocalTensorMode's plain-tensor trap the docs describe. Exercise 25's solution is checked
against the run's own measurements, and the check's cases and hints as functions."""
import math
import re
import runpy
import sys

import pytest
import torch

from conftest import ROOT, import_lesson, load_run, parse_error, run

import local_ranks  # noqa: E402  (lessons/25_dtensor/, on the path by conftest)
import placement_pictures  # noqa: E402
import redistribution  # noqa: E402

sys.path.insert(0, str(ROOT / "tools" / "checks"))
sys.path.insert(0, str(ROOT / "tools"))
import check_25  # noqa: E402  (tools/checks/check_25.py)

WORLD = 4
X = torch.arange(64.0).reshape(8, 8)


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson25")
    proc = run(["make", "-s", "lesson-25", f"ARGS=--out {folder}"], timeout=600)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics, folder


def test_steps_and_the_private_api_note(lesson):
    out, _, metrics, _ = lesson
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 8))
    assert "PRIVATE API: LocalTensorMode (torch.distributed._local_tensor)" in out
    assert f"checked on torch {local_ranks.CHECKED_ON}" in out and metrics["checked_on"] == local_ranks.CHECKED_ON
    assert (metrics["world_size"], metrics["backend"]) == (WORLD, "gloo")


def test_each_rank_holds_the_slice_of_x_its_placement_says(lesson):
    """Worked out here with torch.chunk, and compared with the pieces the ranks saved."""
    _, state, metrics, _ = lesson
    rows, cols = lambda r: f"X[{2 * r}:{2 * r + 2}]", lambda r: f"X[:, {2 * r}:{2 * r + 2}]"
    want = {"S(0) on 1-D": [rows(r) for r in range(WORLD)], "S(1) on 1-D": [cols(r) for r in range(WORLD)],
            "R on 1-D": ["X"] * WORLD, "P(sum) on 1-D": ["X / 4"] * WORLD,
            "S(0),S(1) on 2-D": ["X[0:4, 0:4]", "X[0:4, 4:8]", "X[4:8, 0:4]", "X[4:8, 4:8]"],
            "R,S(1) on 2-D": ["X[:, 0:4]", "X[:, 4:8]"] * 2, "P(sum),S(0) on 2-D": ["X[0:4] / 2", "X[4:8] / 2"] * 2}
    assert metrics["layouts"] == want
    for r in range(WORLD):
        assert torch.equal(state[f"piece/X as S(0) on 1-D/{r}"], X.chunk(WORLD, 0)[r])
        assert torch.equal(state[f"piece/X as S(1) on 1-D/{r}"], X.chunk(WORLD, 1)[r])
        assert torch.equal(state[f"piece/X as P(sum) on 1-D/{r}"], X / WORLD)
        assert torch.equal(state[f"piece/X as S(0),S(1) on 2-D/{r}"], X.chunk(2, 0)[r // 2].chunk(2, 1)[r % 2])
    assert sum(state[f"piece/X as P(sum),S(0) on 2-D/{r}"] for r in (0, 2)).equal(X[0:4])  # the sum is X
    assert all(torch.equal(state[f"full/X as {name}"], X) for name in want)


def ring(kind: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "none": 0.0}.get(kind, (n - 1) / n)


def test_every_redistribution_runs_what_torch_plans_and_sends_its_formula(lesson):
    """The collectives from torch's source (_TransformInfo._comm_type_key) and lesson 10's ring;
    on gloo the all-to-all is an all-gather of the whole (shard_dim_alltoall on a CPU mesh)."""
    out, state, metrics, _ = lesson
    whole, half = 256, 128  # X's bytes; X with its rows split over mesh dim "a" (2 ranks)
    want = {  # (from, to): (planned, ran, bytes sent by rank 0, formula of the plan)
        ("S(0)", "R"): (["all_gather"], "all_gather", 3 / 4 * whole, 3 / 4 * whole),
        ("P(sum)", "R"): (["all_reduce"], "all_reduce", 6 / 4 * whole, 6 / 4 * whole),
        ("P(sum)", "S(0)"): (["reduce_scatter"], "reduce_scatter", 3 / 4 * whole, 3 / 4 * whole),
        ("S(0)", "S(1)"): (["all_to_all"], "all_gather", 3 / 4 * whole, 3 / 4 * whole / 4),
        ("R", "S(0)"): (["none"], "none", 0, 0), ("S(0)", "P(sum)"): (["none"], "none", 0, 0),
        ("S(0),S(1)", "R,R"): (["all_gather"] * 2, "all_gather+all_gather", half / 2 + whole / 2, half / 2 + whole / 2),
        ("P(sum),P(sum)", "S(0),S(1)"): (["reduce_scatter"] * 2, "reduce_scatter+reduce_scatter",
                                         whole / 2 + half / 2, whole / 2 + half / 2),
        ("S(0),S(1)", "S(1),S(0)"): (["all_gather", "all_to_all"], "all_gather+all_gather",
                                     half / 2 + whole / 2, half / 2 + half / 2),  # all-to-all: half of a (4, 8) piece
    }
    rows = {(r["from"], r["to"]): r for r in metrics["redistributions"]}
    assert set(rows) == set(want) | {("R", "P(sum)")}
    for key, (planned, ran, sent, formula) in want.items():
        row = rows[key]
        assert (row["planned"], row["collective"]) == (planned, ran), key
        assert row["bytes"] == pytest.approx(sent) and row["formula_bytes"] == pytest.approx(formula), key
        assert row["formula_bytes_as_gloo_runs_it"] == pytest.approx(sent), key  # gloo's way: to the byte
        assert sum(row["comm_debug_mode"].values()) == len(row["group_sizes"]), key  # torch's counter agrees
        assert torch.equal(state[f"full/X {key[0]} -> {key[1]} on {'2-D' if ',' in key[0] else '1-D'}"], X)
    assert rows[("S(0),S(1)", "R,R")]["group_sizes"] == [2, 2] and rows[("S(0)", "R")]["group_sizes"] == [4]
    assert rows[("R", "P(sum)")]["collective"] == "refused" and "only Shard to Partial(sum)" in rows[("R", "P(sum)")]["refused"]
    assert metrics["torch_counts_equal_commlog"] is True
    assert "S(0) -> S(1): torch plans all_to_all; this CPU mesh ran all_gather and kept its chunk" in out
    assert "CPU process group does not support alltoall" not in out  # said once, by the lesson


def test_seven_rows_are_padded_before_they_are_gathered(lesson):
    out, state, metrics, _ = lesson
    held = [len(c) for c in torch.arange(7).chunk(WORLD)]  # torch.chunk: 2, 2, 2, 1
    assert metrics["uneven"] == {"rows_held": held, "gathered_bytes": WORLD * max(held) * 8 * 4,
                                 "tensor_bytes": 7 * 8 * 4, "padded_rows": 8}
    assert torch.equal(state["full/X[:7] S(0) -> R on 1-D"], X[:7])
    assert "all-gathered 256 bytes, not X[:7]'s 224" in out


def test_exercise_25s_answer_predicts_the_runs_one_dimensional_rows(lesson):
    """The solution's cost() gives, for the 8 x 8 X on 4 ranks, what the lesson measured."""
    _, _, metrics, _ = lesson
    cost = runpy.run_path(str(ROOT / "tests" / "solutions" / "25_redistribution_cost.py"))["cost"]
    for row in metrics["redistributions"]:
        if len(row["mesh"]) == 1 and not row["refused"]:
            assert cost(row["from"], row["to"], (8, 8), WORLD) == (row["collective"], pytest.approx(row["bytes"]))
    assert cost("S(0)", "R", (7, 8), WORLD) == ("all_gather", pytest.approx(3 / 4 * metrics["uneven"]["gathered_bytes"]))


def test_propagation_gives_each_output_its_placement_and_redistributes_only_where_it_must(lesson):
    _, _, metrics, _ = lesson
    got = [(p["op"], tuple(p["inputs"]), p["output"], p["redistributed"]) for p in metrics["propagation"]]
    w_bytes, x_bytes = 32 * 16 * 4, 8 * 32 * 4
    assert got == [
        ("x @ w", ("S(0)", "R"), "S(0)", "none"), ("x @ w", ("R", "S(1)"), "S(1)", "none"),
        ("x @ w", ("S(1)", "S(0)"), "P(sum)", "none"),
        ("x @ w", ("S(0)", "S(0)"), "S(0)", f"all_gather of {w_bytes:,} bytes"),  # w gathered whole
        ("x.sum()", ("S(0)",), "P(sum)", "none"), ("softmax(x, -1)", ("S(0)",), "S(0)", "none"),
        ("softmax(x, -1)", ("S(1)",), "R", f"all_gather of {x_bytes:,} bytes"),
        ("softmax(x, -1)", ("P(sum)",), "R", f"all_reduce of {x_bytes:,} bytes"),
        ("x + 1", ("P(sum)",), "R", f"all_reduce of {x_bytes:,} bytes"), ("2 * x", ("P(sum)",), "P(sum)", "none")]
    assert max(p["gap"] for p in metrics["propagation"]) <= 1e-4  # x @ w is about 8: rounding


def test_the_pieces_of_a_partial_lie_and_dtensors_own_reductions_do_not(lesson):
    _, _, metrics, _ = lesson
    p, clip = metrics["pitfalls"], metrics["clipping"]
    close = lambda a, b: abs(a - b) <= 1e-4 * abs(b)  # noqa: E731
    assert close(p["max_dtensor"], p["max_one_process"]) and close(p["norm_dtensor"], p["norm_one_process"])
    assert close(p["norm_of_shard_pieces"], p["norm_one_process"])  # Shard(0): the pieces' norms combine
    # summands that agree in sign: each piece is about a quarter of y, so the errors are large
    assert p["max_of_local_pieces"] < 0.6 * p["max_one_process"]
    assert p["norm_of_local_pieces"] < 0.7 * p["norm_one_process"]
    assert p["norm_of_rank_0_shard_alone"] < 0.7 * p["norm_one_process"]
    # DTensor all-reduced the Partial before its max and its norm (pytorch#165962's rule); the
    # Shard(0) norm is a pending root of a sum of squares, reduced when read
    assert p["dtensor_ran"] == {"max of P(sum)": "all_reduce", "norm of P(sum)": "all_reduce", "norm of S(0)": "none"}
    assert p["dtensor_result"]["norm of S(0)"] == "_NormP(2)"
    assert clip["gradient_placements"] == ["S(0)", "P(sum)"]
    assert close(clip["total_norm_dtensor"], clip["total_norm_one_process"]) and clip["clipped_gap_dtensor"] < 1e-5
    assert all(t < clip["total_norm_one_process"] for t in clip["total_norm_each_rank_alone"])
    assert clip["clipped_gap_each_rank_alone"] > 0.1 and clip["dtensor_ran"] == "all_reduce+all_reduce"


def test_local_tensor_mode_computes_the_gloo_ranks_values_in_one_process(lesson):
    out, _, metrics, _ = lesson
    results = len(metrics["one_process_gaps"]) + len(metrics["mistake_gaps"])
    assert metrics["local_tensor_pieces_compared"] == WORLD * results
    assert metrics["local_tensor_max_abs_diff_vs_gloo"] <= 1e-4  # sums in another order, values up to 90
    simulated = {(r["from"], r["to"]): r for r in metrics["local_tensor_redistributions"]}
    for row in metrics["redistributions"]:  # the same plan; where gloo lowers it, the all-to-all runs
        twin = simulated[(row["from"], row["to"])]
        assert twin["planned"] == row["planned"]
        if not row["refused"]:
            assert twin["collective"] == "+".join(k for k in row["planned"] if k != "none") or twin["collective"] == "none"
            assert twin["bytes"] == pytest.approx(twin["formula_bytes"])
    assert "S(0) -> S(1) (1-D mesh): under LocalTensorMode all_to_all, 48 bytes sent, as planned; on gloo all_gather, 192" in out


def test_every_result_equals_one_process_and_the_mistake_does_not(lesson):
    out, _, metrics, _ = lesson
    assert metrics["max_abs_diff_vs_one_process"] <= 1e-4  # values up to about 90: a few float32 steps
    assert metrics["max_relative_diff_vs_one_process"] <= 1e-6  # of each result's largest value
    assert max(metrics["one_process_gaps"].values()) == metrics["max_abs_diff_vs_one_process"]
    assert min(metrics["mistake_gaps"].values()) > 0.01
    assert f"{len(metrics['one_process_gaps'])} results against one process" in out


@pytest.fixture
def fake_group():
    """A fake process group of 4 ranks in this process (lesson 23's), destroyed afterwards."""
    import torch.distributed as dist
    import fake_cluster  # lessons/23_cluster_on_a_laptop/
    fake_cluster.join_fake_group(WORLD)
    yield
    dist.destroy_process_group()


def test_planned_is_torchs_own_planner_on_a_2d_mesh(fake_group):
    """redistribution.planned transcribes torch's greedy planner: for every pair of layouts of
    S(0), S(1), R, P(sum) on a 2 x 2 mesh (256 pairs), the same steps as torch's
    _gen_transform_infos_non_cached (private: the test reads it, the lesson does not)."""
    from torch.distributed.tensor import Partial, Replicate, Shard, init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    meta = TensorMeta(torch.Size([8, 8]), (8, 1), torch.float32)
    names = [Shard(0), Shard(1), Replicate(), Partial()]
    layouts = [(p, q) for p in names for q in names]
    for src in layouts:
        for dst in layouts:
            theirs = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, tensor_meta=meta),
                                                     DTensorSpec(mesh, dst, tensor_meta=meta))
            ours = redistribution.planned(src, dst, (2, 2))
            assert [(t.mesh_dim, *t.src_dst_placements) for t in theirs] == [(i, a, b) for i, _, a, b in ours], (src, dst)
            assert [t._comm_type_key() or "none" for t in theirs] == [k for _, k, _, _ in ours], (src, dst)


def test_a_tensor_made_before_local_tensor_mode_is_not_summed(fake_group):
    """local_ranks' docstring: only tensors made inside the mode hold every rank's value; a plain
    one passes through an all-reduce unchanged (the fake group moves nothing)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    before = torch.ones(4)
    with LocalTensorMode(WORLD):
        inside = torch.ones(4)
        summed = [distribute_tensor(t, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
                  for t in (before, inside)]
    assert not isinstance(summed[0], LocalTensor) and torch.equal(summed[0], torch.ones(4) / WORLD)  # wrong
    assert isinstance(summed[1], LocalTensor)
    assert all(torch.equal(piece, torch.ones(4)) for piece in local_ranks.LocalView(WORLD).pieces(summed[1]))


def test_held_names_a_piece_by_its_slice():
    assert redistribution.held(X[2:4], X) == "X[2:4]"
    assert redistribution.held(X[:, 6:8], X) == "X[:, 6:8]"
    assert redistribution.held(X[4:8, 0:4] / 2, X, parts=2) == "X[4:8, 0:4] / 2"
    assert redistribution.held(X / 8, X, parts=8) == "X / 8"
    assert redistribution.held(X[:0], X) == "nothing" and redistribution.held(-X[:2], X) == "other values"


def test_the_checks_cases_cover_every_move_twice_and_its_hints_say_why():
    cases = check_25._cases(seed=1)
    assert len(cases) == 2 * len(check_25.MOVES) == 22
    assert {(a, b) for a, b, _, _ in cases[:11]} == set(check_25.MOVES)
    assert all(s % n == 0 for _, _, shape, n in cases[:11] for s in shape)  # the even ones first
    assert ("R", "P(sum)") not in check_25.MOVES and check_25._cases(1) == cases != check_25._cases(2)
    hint = check_25._hint
    assert "all-gather and keeps its chunk" in hint("S(0)", "S(1)", (8, 8), 4, ("all_gather", 1.0), "all_to_all")
    assert "nothing to send" in hint("R", "S(0)", (8, 8), 4, ("none", 0.0), "all_gather")
    assert "ceil(7/4)" in hint("S(0)", "R", (7, 8), 4, ("all_gather", 1.0), "all_gather")


def test_the_picture_draws_from_the_run(lesson, tmp_path):
    _, _, _, folder = lesson
    to = tmp_path / "placements.png"
    assert placement_pictures.draw(folder, to).startswith("wrote") and to.stat().st_size > 10_000
    assert placement_pictures.cells("X[0:4, 4:8] / 2") == (range(0, 4), range(4, 8), 2)
    assert placement_pictures.cells("X") == (range(8), range(8), 1)


@pytest.mark.parametrize("flags,words", [
    (["--world-size", "3"], "invalid choice: 3"),
    (["--world-size", "16"], "invalid choice: 16"),
    (["--seed", "-1"], "a seed between 0 and"),
    (["--timeout", "0"], "a number above 0"),
])
def test_bad_flags_are_refused_in_one_line(flags, words, monkeypatch, capsys):
    line = parse_error(import_lesson("25"), flags, monkeypatch, capsys)
    assert words in line, line


def test_ring_shares_are_lesson_10s():
    """The formula this file uses is apparatus/comm.py's SHARE (what CommLog counts with)."""
    from apparatus.comm import SHARE
    for n in (2, 4, 8):
        assert ring("all_reduce", n) == SHARE["all_reduce"](n) and ring("all_gather", n) == SHARE["all_gather"](n)
        assert math.isclose(redistribution.formula_bytes(redistribution.planned(
            [torch.distributed.tensor.Shard(0)], [torch.distributed.tensor.Replicate()], (n,)), (8, 8),
            [torch.distributed.tensor.Shard(0)], (n,)), SHARE["all_gather"](n) * 256)
