"""Lesson 19: a 2-D (dp, tp) mesh and the planner, run as a learner would.

One short run on 4 ranks (--dp 2 --tp 2) feeds every assertion about the job: lesson 13's
weights, the groups each rank talks in, the bytes each rank holds and sends per dimension
(measured by apparatus/comm.py's CommLog) beside the planner's formulas and beside the same
numbers worked out here from the recipe's shapes; the steps it prints. The planner's other formulas: DDP and ZeRO-3 against lesson 15's
formulas (which its tests measure), ZeRO-1/2 by arithmetic, the pipeline's bytes on a real
2-stage pipeline of the recipe (2 processes), its bubble against lesson 18's GPipe timeline;
and --plan's table in-process.
"""
import math

import pytest

from apparatus import sharding
import pipeline
import planner
from common import transformer as T
from conftest import import_lesson, load_run, max_abs_diff, parse_error, run_lesson

STEPS = 6
DP, TP = 2, 2
SPLIT = ("attn.q", "attn.k", "attn.v", "mlp.fc", "attn.proj.weight", "mlp.proj.weight")
SHAPES = {n: p.shape for n, p in T.make_model().named_parameters()}
PSI = sum(math.prod(s) for s in SHAPES.values())
SPLIT_PSI = sum(math.prod(s) for n, s in SHAPES.items() if any(k in n for k in SPLIT))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson19")
    proc = run_lesson("19", "--device", "cpu", "--dp", DP, "--tp", TP, "--steps", STEPS,
                      "--out", folder, timeout=240)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_same_weights_as_lesson_13_within_the_floor(job):
    out, state, metrics = job
    reference = T.train_reference(T.SEED, STEPS)
    diff = max_abs_diff(state, reference["state"])
    floor = max_abs_diff(T.train_reference(T.SEED, STEPS, chunks=DP)["state"], reference["state"])
    assert diff <= 1e-3 and metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff)
    assert metrics["chunked_floor"] == pytest.approx(floor)  # dp chunks: tp ranks share rows
    assert f"{diff:.1e}" in out and f"{floor:.1e}" in out
    assert metrics["mesh_shape"] == [DP, TP] and metrics["world_size"] == DP * TP
    assert metrics["losses"] == pytest.approx(reference["losses"].tolist(), abs=1e-4)
    assert set(state) == set(SHAPES)  # a plain state dict: no wrapper prefix, nothing sharded


def test_prints_its_own_steps_and_keeps_lesson_13s_demonstrations_in_13(job):
    import re
    out, _, metrics = job
    titles = re.findall(r"^Step (\d+): (.*)$", out, re.M)
    assert [int(n) for n, _ in titles] == list(range(1, 8))
    assert "Build the mesh, split each block across tp, shard across dp" in dict(titles).values()
    assert not {"memory_bytes", "activations_checkpointed_bytes", "activations_bf16_bytes",
                "checkpointed_losses", "loss_bf16", "seconds_forward_backward"} & set(metrics)


def test_each_rank_names_its_dp_and_tp_groups(job):
    out, _, _ = job
    assert "[[0, 1], [2, 3]]" in out  # the mesh: row = a tp group, column = a dp group
    rows = [line for line in out.splitlines() if line.startswith("│ ")]
    for rank, coord, dp, tp in [(0, "(0, 0)", "[0, 2]", "[0, 1]"), (3, "(1, 1)", "[1, 3]", "[2, 3]")]:
        cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
        assert [str(rank), coord, dp, tp] in cells, (rank, cells[:6])


def test_every_rank_holds_what_the_planner_says(job):
    _, _, metrics = job
    # worked out here: split tensors 1/TP, then everything 1/DP (no padding: 2 divides every dim)
    params = 4 * ((PSI - SPLIT_PSI) + SPLIT_PSI / TP) / DP
    for r in metrics["per_rank_bytes_all"]:
        assert r["measured"] == {k: pytest.approx(v) for k, v in r["formula"].items()}
        assert r["measured"]["parameters"] == params and r["measured"]["optimizer_state"] == 2 * params


def test_bytes_per_dimension_match_the_planner(job):
    _, _, metrics = job
    measured, formula = metrics["comm_by_dim"], metrics["comm_formula_by_dim"]
    # tp: two all-reduces per block in forward, two in backward (q, k, v: one input, one sum)
    assert measured["tp"]["all_reduce"] == 4 * T.N_BLOCKS and "all_gather" not in measured["tp"]
    act = (T.GLOBAL_BATCH // DP) * T.SEQ * T.DIM * 4
    assert measured["tp"]["sent_bytes"] == pytest.approx(4 * T.N_BLOCKS * 2 * (TP - 1) / TP * act)
    # dp: FSDP2 gathers each block twice (forward, backward) and the root once; one
    # reduce-scatter per group; never an all-reduce
    assert measured["dp"]["all_gather"] == 2 * T.N_BLOCKS + 1
    assert measured["dp"]["reduce_scatter"] == T.N_BLOCKS + 1 and "all_reduce" not in measured["dp"]
    for dim in ("dp", "tp"):
        assert measured[dim]["sent_bytes"] == pytest.approx(formula[dim])
    assert formula["pp"] == 0 and "other" not in measured  # every collective used a mesh group
    # ZeRO-3 across dp sends 1.5x what DDP across dp would (lesson 15), the root aside
    assert 1.3 < measured["dp"]["sent_bytes"] / metrics["ddp_comm_bytes"] < 1.5
    assert metrics["comm_bytes_per_step"] == pytest.approx(sum(formula.values()))


def test_planner_agrees_with_the_formulas_lesson_15_measures():
    shapes = sharding.recipe_shapes()
    model = planner.Model(PSI, T.N_BLOCKS, T.DIM, T.SEQ)
    for n in (1, 2, 4):  # DDP, and ZeRO-3 where no padding is needed (sharding: measured in 15)
        assert planner.memory(model, planner.Layout(dp=n), planner.FP32) == sharding.formula_bytes(
            "ddp", shapes, n, 0, 0)
        assert planner.memory(model, planner.Layout(dp=n, zero=3), planner.FP32) == sharding.formula_bytes(
            "fsdp", shapes, n, 0, 0)
        assert planner.comm(model, planner.Layout(dp=n), element=4)["dp"] == pytest.approx(
            sharding.comm_formula("ddp", shapes, n, 0, True))
    # ZeRO-1 and 2: the optimizer state (and the gradients) split N ways, the rest whole
    z1, z2 = (planner.memory(model, planner.Layout(dp=4, zero=z), planner.FP32) for z in (1, 2))
    assert z1 == {"parameters": 4 * PSI, "gradients": 4 * PSI, "optimizer_state": 2 * PSI}
    assert z2 == {"parameters": 4 * PSI, "gradients": PSI, "optimizer_state": 2 * PSI}
    # mixed precision: 16 bytes per parameter on one GPU (the ZeRO paper's 2 + 2 + 12)
    assert sum(planner.memory(model, planner.Layout()).values()) == 16 * PSI


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_pipeline_bubble_is_gpipes_idle_share(p, m):
    """GPipe on p stages: every stage runs m forwards, then m backwards (lesson 18's timeline)."""
    actions = {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}
    assert planner.bubble(p, m) == pytest.approx(pipeline.idle_fraction(pipeline.timeline(actions)))
    assert planner.bubble(p, m) == pipeline.bubble_formula(p, m)


def test_plan_table_for_a_7b_model(monkeypatch, capsys):
    lesson = import_lesson("19")
    for gpus in (8, 64):
        monkeypatch.setattr("sys.argv", ["19", "--plan", "7e9", "--gpus", str(gpus), "--gpu-gb", "80"])
        monkeypatch.setenv("COLUMNS", "160")
        lesson.main()
        out = capsys.readouterr().out
        assert "ASSUMED" in out and f"{gpus} GPUs of 80 GB" in out
        rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
        assert "NO" in rows[f"DDP {gpus}"]  # 16 bytes x 7e9 = 112 GB: DDP does not fit
        assert "112.0" in rows[f"DDP {gpus}"] and f"{16 * 7e9 / gpus / 1e9:.1f}" in rows[f"ZeRO-3 {gpus}"]
    assert "tp" in rows["TP 16 x ZeRO-3 4"].split("│")[6]  # tensor parallel across nodes: flagged


@pytest.mark.parametrize("flags,words", [  # Part 2's one rule (common/transformer.py), per dimension
    (["--dp", "5", "--tp", "1"], "--dp must divide the global batch of 48 rows"),
    (["--tp", "3"], "4 attention heads"), (["--dp", "4", "--tp", "4"], "at most 2 on one machine: use one of 1, 2"),
    (["--plan", "-1"], "positive"), (["--plan", "7e9", "--gpus", "12"], "whole number of nodes"),
    (["--plan", "nan"], "positive finite"), (["--plan", "inf"], "positive finite"),
    (["--plan", "7e9", "--gpu-gb", "inf"], "positive finite"), (["--plan", "7e9", "--gpu-gb", "nan"], "positive finite")])
def test_bad_flags_one_line(flags, words, monkeypatch, capsys):
    line = parse_error(import_lesson("19"), flags, monkeypatch, capsys)
    assert words in line, line


def _pipeline_rank(rank: int, world: int, m: int) -> list:
    """Two pipeline stages of the recipe (embeddings + block 0 | block 1 + head), m micro-batches
    (GPipe order: every forward, then every backward), the bytes of each send counted by
    apparatus/comm.py's CommLog and returned (run_ranks has joined the gloo group)."""
    import torch
    import torch.distributed as dist

    from apparatus.comm import CommLog

    model, (x, y) = T.make_model(), T.batch(0)
    outs = []
    with CommLog().recording() as log:
        for i in range(m):  # forwards
            xb, yb = T.shard(x, i, m), T.shard(y, i, m)
            if rank == 0:
                h = model.blocks[0](model.tok_emb(xb) + model.pos_emb(torch.arange(T.SEQ)))
                dist.send(h.detach().contiguous(), 1)
                outs.append(h)
            else:
                h = torch.empty(xb.shape[0], T.SEQ, T.DIM)
                dist.recv(h, 0)
                h.requires_grad_()
                outs.append((h, T.loss_fn(model.head(model.norm(model.blocks[1](h))), yb) / m))
        for i in range(m):  # backwards
            if rank == 0:
                g = torch.empty_like(outs[i])
                dist.recv(g, 1)
                outs[i].backward(g)
            else:
                h, loss = outs[i]
                loss.backward()
                dist.send(h.grad, 0)
    return [c.sent_bytes for c in log.calls if c.kind == "send"]


def test_pipeline_bytes_match_the_planner():
    """Each stage of a 2-stage pipeline of the recipe sends one (b, s, h) tensor per micro-batch:
    activations forward (stage 0), their gradients backward (stage 1), as the planner counts."""
    from apparatus.ranks import run_ranks

    m = 4
    per_rank = run_ranks(_pipeline_rank, 2, (m,), timeout_s=180, group_timeout_s=60)
    model = planner.Model(PSI, T.N_BLOCKS, T.DIM, T.SEQ, micro_batch=T.GLOBAL_BATCH // m, microbatches=m)
    formula = planner.comm(model, planner.Layout(pp=2), element=4)["pp"]
    for rank, sent in enumerate(per_rank):
        assert len(sent) == m and sum(sent) == formula, (rank, sent, formula)
