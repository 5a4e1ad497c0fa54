"""Lesson 19: a 2-D (dp, tp) mesh and the planner, run as a learner would.

One short run on 4 ranks (--dp 2 --tp 2) feeds every assertion about the job: lesson 13's
weights, the groups each rank talks in, the bytes each rank holds and sends per dimension
(measured by apparatus/comm.py's CommLog) beside the planner's formulas and beside the same
numbers worked out here from the recipe's shapes; the steps it prints. The planner's other formulas: DDP and ZeRO-3 against lesson 15's
formulas (which its tests measure), ZeRO-1/2 by arithmetic, the pipeline's bytes on a real
2-stage pipeline of the recipe (2 processes), its bubble against lesson 18's GPipe timeline;
by arithmetic, the mixed-precision plan (18 bytes per parameter, fp32 gradients on the wire),
micro-batches (ZeRO-2/3's bytes grow with them, DDP's and ZeRO-1's do not), sequence parallel,
recompute's extra all-reduces and FLOPs, step time and MFU; and --plan's tables (80 columns)
and plan.json in-process, and the doc's picture drawn from plan.json files.
"""
import json
import math

import pytest

from apparatus import sharding
import pipeline
import planner
from common import transformer as T
from conftest import ROOT, import_lesson, load_run, make_lesson, max_abs_diff, parse_error, run, weights_line

STEPS = 6
DP, TP = 2, 2
SPLIT = ("attn.q", "attn.k", "attn.v", "mlp.fc", "attn.proj.weight", "mlp.proj.weight")
SHAPES = {n: p.shape for n, p in T.make_model().named_parameters()}
PSI = sum(math.prod(s) for s in SHAPES.values())
SPLIT_PSI = sum(math.prod(s) for n, s in SHAPES.items() if any(k in n for k in SPLIT))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson19")
    proc = make_lesson("19", "--device", "cpu", "--dp", DP, "--tp", TP, "--steps", STEPS,
                       "--out", folder, timeout=240)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_same_weights_as_lesson_13_within_the_floor(job):
    out, state, metrics = job
    reference = T.train_reference(T.SEED, STEPS)
    diff = max_abs_diff(state, reference["state"])
    floor = max_abs_diff(T.train_reference(T.SEED, STEPS, chunks=DP)["state"], reference["state"])
    assert diff <= 1e-3 and metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff)
    assert metrics["max_abs_diff_floor"] == pytest.approx(floor)  # dp chunks: tp ranks share rows
    assert weights_line(diff, floor, DP) in out
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
    # mixed precision as Megatron-LM keeps it: 2 (bf16 weights) + 4 (fp32 gradients) + 12 = 18
    assert planner.memory(model, planner.Layout()) == {"parameters": 2 * PSI, "gradients": 4 * PSI,
                                                       "optimizer_state": 12 * PSI}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_pipeline_bubble_is_gpipes_idle_share(p, m):
    """GPipe on p stages: every stage runs m forwards, then m backwards (lesson 18's timeline)."""
    actions = {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}
    assert planner.bubble(p, m) == pytest.approx(pipeline.idle_fraction(pipeline.timeline(actions)))
    assert planner.bubble(p, m) == pipeline.bubble_formula(p, m)


def _plan(lesson, flags, folder, monkeypatch, capsys, columns=80) -> tuple[str, dict]:
    """--plan in-process (no processes to start): what it printed, and its plan.json."""
    monkeypatch.setattr("sys.argv", ["19", "--plan", *map(str, flags), "--out", str(folder)])
    monkeypatch.setenv("COLUMNS", str(columns))
    lesson.main()
    return capsys.readouterr().out, json.loads((folder / "plan.json").read_text())


def test_plan_tables_for_a_7b_model_fit_80_columns(monkeypatch, capsys, tmp_path):
    lesson = import_lesson("19")
    for gpus, sp in ((8, False), (64, False), (64, True)):
        flags = ["7e9", "--gpus", gpus, "--gpu-gb", 80] + (["--sequence-parallel"] if sp else [])
        out, plan = _plan(lesson, flags, tmp_path / f"{gpus}{sp}", monkeypatch, capsys)
        assert "ASSUMED" in out and f"{gpus} GPUs of 80 GB" in out and "wrote" in out
        assert "989 TFLOP/s" in out and "450 GB/s" in out and "50 GB/s" in out
        table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
        assert table and max(map(len, table)) <= 80, max(table, key=len)  # nothing wraps
        names = [r["layout"] for r in plan["rows"]]
        assert (" SP" in " ".join(names)) == sp
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table if line.startswith("│")]
        for name in names:  # one line in each of the three tables, the whole name on it
            assert [c[0] for c in cells].count(name) == 3, (name, [c[0] for c in cells])
        assert len(cells) == 3 * len(names)  # no row continued on a second line
        rows = {c[0]: c for c in cells if len(c) == 5}  # the memory table
        assert rows[f"DDP {gpus}"][1:] == ["126.0", "1.1", "127.1", "NO"]  # 18 x 7e9 bytes: no fit
        assert rows[f"ZeRO-3 {gpus}"][1] == f"{18 * 7e9 / gpus / 1e9:.1f}"
    sent = {c[0]: c for c in cells if len(c) == 6}
    assert sent["TP 16 SP x ZeRO-3 4"][4] == "tp dp"  # tensor parallel across nodes: flagged


def test_plan_says_when_tensor_parallel_cannot_split_the_width(monkeypatch, capsys, tmp_path):
    """On 3 GPUs the plan's TP layout is TP 3, which no real job runs on a width of 4,096: the
    plan says so in a note, and says nothing of the kind on 8 GPUs."""
    lesson = import_lesson("19")
    out, _ = _plan(lesson, ["7e9", "--gpus", 3], tmp_path / "3", monkeypatch, capsys)
    assert "note: tensor parallel of 3 does not divide the width 4096" in out
    out, _ = _plan(lesson, ["7e9", "--gpus", 8], tmp_path / "8", monkeypatch, capsys)
    assert "does not divide the width" not in out


def test_plan_json_has_the_interface_keys(monkeypatch, capsys, tmp_path):
    """--plan ... --out DIR writes DIR/plan.json: rows with the keys issue #23 fixes, the
    planner's own numbers."""
    _, plan = _plan(import_lesson("19"), ["7e9", "--gpus", 64, "--microbatches", 4], tmp_path,
                    monkeypatch, capsys, columns=160)
    model = planner.Model(7e9, 32, 4096, 4096, 1, 4)
    assert plan["assumed"]["peak_flops_per_s"] == planner.PEAK and plan["gpus"] == 64
    for row in plan["rows"]:
        assert {"layout", "dp", "tp", "pp", "micro_batches", "state_bytes", "activation_bytes",
                "bytes_sent", "compute_seconds", "comm_seconds"} <= set(row)
        lay = planner.Layout(row["dp"], row["tp"], row["pp"], row["zero"], row["sequence_parallel"])
        assert lay.name == row["layout"] and row["micro_batches"] == 4 and lay.dp * lay.tp * lay.pp == 64
        assert row["state_bytes"] == pytest.approx(sum(planner.memory(model, lay).values()))
        assert row["activation_bytes"] == pytest.approx(planner.activations(model, lay))
        assert row["bytes_sent"] == pytest.approx(planner.comm(model, lay))
        assert set(row["bytes_sent"]) == {"dp", "tp", "pp"} and row["compute_seconds"] > 0


def test_the_planner_runs_by_itself_as_lesson_19s_plan(monkeypatch, capsys, tmp_path):
    """lessons/19_two_d_mesh/planner.py 7e9 --gpus 8, run by a learner in a new Python: the same
    tables and plan.json as the lesson's --plan; a bad number is one line, exit 2."""
    import sys
    script = ROOT / "lessons" / "19_two_d_mesh" / "planner.py"
    proc = run([sys.executable, str(script), "7e9", "--gpus", "8", "--out", str(tmp_path / "alone")])
    alone = json.loads((tmp_path / "alone" / "plan.json").read_text())
    out, plan = _plan(import_lesson("19"), ["7e9", "--gpus", 8], tmp_path / "lesson", monkeypatch, capsys)
    assert alone == plan and "ASSUMED" in proc.stdout and "Memory per GPU, GB" in proc.stdout
    bad = run([sys.executable, str(script), "7e9", "--gpus", "12"], check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --gpus 12 is not a whole number of nodes of 8"
    assert "PARAMS" in run([sys.executable, str(script), "--help"]).stdout


def test_a_bad_out_is_refused_before_the_plan(monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr("sys.argv", ["19", "--plan", "7e9", "--out", str(tmp_path / "file")])
    with pytest.raises(SystemExit) as exit_info:
        import_lesson("19").main()
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and err.count("\n") == 1 and "is a file" in err


def test_zero_2_and_3_bytes_grow_with_micro_batches_ddp_and_zero_1s_do_not():
    """DDP and ZeRO-1 accumulate the micro-batches' gradients locally and send once a step;
    ZeRO-2 keeps only its 1/D of the gradients, so it reduce-scatters each micro-batch's;
    ZeRO-3 also gathers the weights twice in each. Mixed precision: gradients go in fp32 (4),
    weights in bf16 (2)."""
    D, W = 8, 7e9
    ring = (D - 1) / D
    sent = {(z, m): planner.comm(planner.Model(W, 32, 4096, 4096, 1, m), planner.Layout(dp=D, zero=z))["dp"]
            for z in range(4) for m in (1, 8)}
    assert sent[0, 8] == sent[0, 1] == pytest.approx(2 * ring * W * 4)  # DDP: all-reduce, fp32
    assert sent[1, 8] == sent[1, 1] == pytest.approx(ring * W * (4 + 2))  # reduce-scatter + all-gather
    assert sent[2, 8] == pytest.approx(ring * W * (4 * 8 + 2)) and sent[2, 8] > 5 * sent[2, 1]
    assert sent[3, 8] == pytest.approx(8 * sent[3, 1]) == pytest.approx(ring * W * (2 + 2 + 4) * 8)
    for z in range(4):  # fp32 on the wire (lessons 15, 19, 23): DDP's and ZeRO-1's 2(D-1)/D
        fp32 = planner.comm(planner.Model(W, 32, 4096, 4096, 1, 8), planner.Layout(dp=D, zero=z), element=4)["dp"]
        assert fp32 == pytest.approx(ring * W * 4 * [2, 2, 8 + 1, 3 * 8][z])


def test_activations_divide_by_t_only_with_sequence_parallel():
    model = planner.Model(7e9, 32, 4096, 4096, 1, 8)
    whole = planner.activations(model, planner.Layout())
    assert whole == 32 * 4096 * 4096 * 2  # every block's input, bf16, checkpointed
    assert planner.activations(model, planner.Layout(tp=8)) == whole  # each tp rank holds it all
    assert planner.activations(model, planner.Layout(tp=8, sp=True)) == whole / 8
    # without checkpointing (Korthikanti et al. 2022, Table 2): sbh(10 + 24/T), sbh 34/T with SP
    full = planner.Model(7e9, 32, 4096, 4096, 1, 8, checkpoint=False)
    sbh = 4096 * 4096
    assert planner.activations(full, planner.Layout(tp=8)) == 32 * sbh * (10 + 24 / 8)
    assert planner.activations(full, planner.Layout(tp=8, sp=True)) == 32 * sbh * 34 / 8
    assert planner.Layout(tp=8, dp=8, zero=1, sp=True).name == "TP 8 SP x ZeRO-1 8"


def test_recompute_repeats_the_forward_all_reduces_and_flops():
    """Full checkpointing: 6 tp all-reduces per block per micro-batch (2 forward, 2 recomputed,
    2 backward), 4 without (what lessons 19 and 23 measure); sequence parallel's all-gather +
    reduce-scatter pairs send the same bytes. FLOPs: 8 x N x tokens instead of 6."""
    act, ring, m = 2 * 4096 * 4096, 7 / 8, 8
    for checkpoint, per_block in ((True, 6), (False, 4)):
        model = planner.Model(7e9, 32, 4096, 4096, 1, m, checkpoint=checkpoint)
        for sp in (False, True):
            tp = planner.comm(model, planner.Layout(tp=8, sp=sp))["tp"]
            assert tp == pytest.approx(32 * per_block * 2 * ring * act * m)
        f = planner.flops(model, planner.Layout(dp=4, tp=2))
        tokens = 4 * 1 * m * 4096
        assert f["tokens"] == tokens and f["model_flops"] == 6 * 7e9 * tokens
        assert f["hardware_flops_per_gpu"] == (per_block + 2) * 7e9 * tokens / 8


@pytest.mark.parametrize("lay", [planner.Layout(dp=8, zero=3), planner.Layout(tp=8, pp=4, dp=2, zero=1)],
                         ids=lambda lay: lay.name)
def test_step_time_and_mfu_arithmetic(lay):
    model = planner.Model(7e9, 32, 4096, 4096, 1, 8)
    sent, cross = planner.comm(model, lay), planner.crosses_nodes(lay, 8)
    t = planner.step_time(model, lay, sent, cross)
    gpus, tokens = lay.dp * lay.tp * lay.pp, lay.dp * 8 * 4096
    idle = planner.bubble(lay.pp, 8)
    assert t["compute_seconds"] == pytest.approx(8 * 7e9 * tokens / gpus / planner.PEAK / (1 - idle))
    assert t["comm_seconds"] == pytest.approx(sum(b / (planner.INFINIBAND if cross[d] else planner.NVLINK)
                                                  for d, b in sent.items()))
    assert t["step_seconds"] == pytest.approx(t["compute_seconds"] + t["comm_seconds"])
    assert t["step_seconds_overlap"] == max(t["compute_seconds"], t["comm_seconds"])
    for key, step in (("mfu", "step_seconds"), ("mfu_overlap", "step_seconds_overlap")):
        assert t[key] == pytest.approx(6 * 7e9 * tokens / (t[step] * gpus * planner.PEAK))
    assert t["mfu_overlap"] <= 0.75 * (1 - idle) + 1e-12  # recompute's 8/6 and the bubble at best


def test_the_picture_is_drawn_from_plan_json(monkeypatch, capsys, tmp_path):
    """dp_bytes_pictures.py draws docs/img/19_dp_bytes.png from plan.json files; both docs show it."""
    pytest.importorskip("matplotlib")
    import dp_bytes_pictures
    lesson, runs = import_lesson("19"), []
    for m in (1, 4):
        runs.append(tmp_path / f"m{m}")
        _plan(lesson, ["7e9", "--gpus", 64, "--microbatches", m], runs[-1], monkeypatch, capsys)
    png = tmp_path / "dp.png"
    assert dp_bytes_pictures.draw(runs, png) == f"wrote {png}" and png.stat().st_size > 10_000
    for doc, img in (("docs/19_two_d_mesh.md", "img"), ("docs/zh/19_two_d_mesh.md", "../img")):
        text = (ROOT / doc).read_text()
        assert f"]({img}/19_dp_bytes.png)" in text and "lessons/19_two_d_mesh/dp_bytes_pictures.py" in text, doc
    assert (ROOT / "docs" / "img" / "19_dp_bytes.png").stat().st_size > 10_000


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
    from common.distributed import run_ranks

    m = 4
    per_rank = run_ranks(_pipeline_rank, 2, (m,), timeout_s=180, group_timeout_s=60)
    model = planner.Model(PSI, T.N_BLOCKS, T.DIM, T.SEQ, micro_batch=T.GLOBAL_BATCH // m, microbatches=m)
    formula = planner.comm(model, planner.Layout(pp=2), element=4)["pp"]
    for rank, sent in enumerate(per_rank):
        assert len(sent) == m and sum(sent) == formula, (rank, sent, formula)


def test_a_negative_plan_is_named_as_such(monkeypatch, capsys):
    """Issue 35: --plan -7e9 said "expected one argument" (argparse reads -7e9, unlike -7, as a
    flag): the refusal now says it is a negative number where a positive one is wanted."""
    line = parse_error(import_lesson("19"), ["--plan", "-7e9"], monkeypatch, capsys)
    assert "argument --plan: -7e9 is a negative number" in line and "takes a positive one" in line, line
    assert "expected one argument" not in line
    assert "expected one argument" in parse_error(import_lesson("19"), ["--plan"], monkeypatch, capsys)
