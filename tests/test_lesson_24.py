"""Lesson 24: LocalSGD and DiLoCo. Two runs of the lesson through its real launcher:

A: 3 replicas, DiLoCo (AdamW inside, Nesterov outside), H = 16 for 64 steps, replica 1 away for
   outer step 2 (so the other two all-reduce in a group of two), with --sweep (DDP, LocalSGD and
   DiLoCo at H = 1, 4, 16, 64, and six outer lr/momentum settings at H = 16);
B: 2 replicas, H = 1, SGD inside and outside (lr 1): DDP's arithmetic, 8 steps.

Checked here, not only read from the lesson: B's weights against plain SGD on the whole batch
in one process, and against its replicas simulated here (A's simulation, with the drop-out,
is the lesson's own Step 9: its numbers are checked); the sweep's DDP row against lesson 13's
run summed in 3 chunks; the outer step (LocalSGD's average, DiLoCo's Nesterov) in this process;
the bytes per sample against the formula and 1/H, and the printed formula against its value;
what the drop-out cost; bad flags refused in one line before any rank starts; and what doc 24
says of torchft, of the exercise's starter, and of the exercise's answer."""
import re
import runpy
import sys

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, one_error_line, parse_error, run, run_lesson

import diloco  # lessons/24_local_sgd_diloco/ (conftest puts the lessons' folders on the path)
import talk_report

pytestmark = pytest.mark.timeout(900)  # run A (below) trains 14 runs of 64 steps on 3 ranks and simulates one:
# 8 min on this project's machine under a load of about 25

RUNS = {
    "A": diloco.Plan(world=3, steps=64, H=16, inner="adamw", outer="nesterov", drop_rank=1, drop_at=2),
    "B": diloco.Plan(world=2, steps=8, H=1, inner="sgd", outer="sgd"),
}
P = sum(p.numel() for p in T.make_model().parameters())
DOCS = [ROOT / "docs" / "24_local_sgd_diloco.md", ROOT / "docs" / "zh" / "24_local_sgd_diloco.md"]


def flags(plan: diloco.Plan) -> list:
    out = ["--world-size", plan.world, "--steps", plan.steps, "--sync-every", plan.H,
           "--inner", plan.inner, "--outer", plan.outer, "--device", "cpu"]
    if plan.drop_rank is not None:
        out += ["--drop-rank", plan.drop_rank, "--drop-at", plan.drop_at, "--sweep"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, plan in RUNS.items():
        folder = tmp_path_factory.mktemp(f"lesson24-{name}")
        proc = run_lesson("24", *flags(plan), "--out", folder, timeout=840)  # a loaded machine: 10x slower
        state, metrics = load_run(folder)
        # B's replicas simulated here, now (A's, 3 x 64 steps, the lesson simulates itself: Step 9)
        out[name] = (proc.stdout, state, metrics, folder, diloco.simulate(plan) if name == "B" else None)
    return out


def row(rows: list, method: str, H: int) -> dict:
    found = [r for r in rows if r["method"] == method and r["sync_every"] == H]
    assert len(found) == 1, (method, H, rows)
    return found[0]


def test_h1_with_sgd_inside_is_ddp(runs):
    """Run B's own weights (H = 1, SGD inside, outer SGD lr 1, 2 replicas) against plain SGD on
    the whole batch in one process: DDP's arithmetic, up to float rounding."""
    out, state, metrics, _, _ = runs["B"]
    torch.set_num_threads(1)  # as the ranks compute (and quick on a busy machine)
    model = T.make_model(T.SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=diloco.SGD_LR)
    for step in range(RUNS["B"].steps):
        x, y = T.batch(step, T.SEED)
        optimizer.zero_grad()
        T.loss_fn(model(x), y).backward()
        optimizer.step()
    diff = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert diff < 1e-5, diff
    # the lesson's own comparison with torch's DDP, in both runs: tiny with SGD, not with AdamW
    for name in RUNS:
        m = runs[name][2]
        assert m["max_abs_diff_vs_ddp"] < 1e-5, (name, m["max_abs_diff_vs_ddp"])
        assert m["max_abs_diff_vs_ddp_adamw"] > 1e-3, (name, m["max_abs_diff_vs_ddp_adamw"])
        assert m["max_abs_diff_vs_torch_periodic_averager"] < 1e-5
        assert f"{m['max_abs_diff_vs_ddp']:.1e}" in runs[name][0]


def test_same_weights_as_the_replicas_in_one_process(runs):
    out, state, metrics, _, one = runs["B"]
    diff = max((state[k].double() - one["state"][k].double()).abs().max().item() for k in state)
    assert diff <= 1e-4, diff
    assert metrics["max_abs_diff_vs_single_process"] == pytest.approx(diff, abs=1e-7)
    assert max(abs(a - b) for a, b in zip(metrics["losses"], one["losses"])) < 1e-5
    assert f"max |w - w_sim| = {metrics['max_abs_diff_vs_single_process']:.1e}" in out


def test_the_drop_out_run_matches_its_simulation_and_not_the_run_without(runs):
    out, _, metrics, _, _ = runs["A"]
    assert metrics["max_abs_diff_vs_single_process"] <= 1e-4
    assert f"max |w - w_sim| = {metrics['max_abs_diff_vs_single_process']:.1e}" in out
    assert metrics["held_out_loss_single_process"] == pytest.approx(metrics["held_out_loss"], abs=1e-4)
    # and not by accident: without the drop-out the same run ends elsewhere
    assert metrics["dropout"]["held_out_loss_without"] != pytest.approx(metrics["held_out_loss"], abs=1e-4)


# --- item 1: every H beside DDP and LocalSGD, at equal samples ---------------------------------

def test_the_sweep_sets_every_h_beside_ddp_and_localsgd_at_equal_samples(runs):
    """The sweep's rows: DDP once, LocalSGD and DiLoCo at each H, all trained on the same 64
    batches; what the lesson prints as the winner is the lowest row."""
    out, _, metrics, _, _ = runs["A"]
    rows = metrics["sweep"]
    assert [(r["method"], r["sync_every"]) for r in rows] == \
        [("ddp", 1)] + [(m, H) for m in ("localsgd", "diloco") for H in diloco.SWEEP]
    for r in rows:
        assert {"method", "sync_every", "held_out_loss", "bytes_sent_per_sample"} <= r.keys()
        assert len(r["losses"]) == 64  # the same steps, the same 3,072 samples: no drop-out in a sweep
    assert {(r["outer_lr"], r["outer_momentum"]) for r in rows if r["method"] == "localsgd"} == {(1.0, 0.0)}
    assert {(r["outer_lr"], r["outer_momentum"]) for r in rows if r["method"] == "diloco"} == {(0.7, 0.9)}
    # DDP talks every step: the bytes of H = 1
    assert row(rows, "ddp", 1)["bytes_sent_per_sample"] == pytest.approx(
        row(rows, "localsgd", 1)["bytes_sent_per_sample"], rel=1e-12)
    # the DDP row is DDP: lesson 13's run on the whole batch, summed in 3 chunks as 3 ranks sum it
    reference = T.make_model(T.SEED)
    reference.load_state_dict(T.train_reference(T.SEED, 64, chunks=3)["state"])
    held_out, _ = T.evaluate(reference, 64, T.SEED, "cpu")
    assert row(rows, "ddp", 1)["held_out_loss"] == pytest.approx(held_out, abs=1e-3)
    # printed: a row per run, and the lowest one named
    for r in rows:
        label = {"ddp": "DDP", "localsgd": "LocalSGD", "diloco": "DiLoCo"}[r["method"]]
        assert re.search(rf"│ {label} +│ {r['sync_every']} +│.*│ {r['held_out_loss']:.4f} +│", out), (label, r)
    best = min(rows, key=lambda r: r["held_out_loss"])
    named = "DDP" if best["method"] == "ddp" else f"{best['method']} H = {best['sync_every']}"
    assert f"lowest held-out loss: {named} ({best['held_out_loss']:.4f})".lower() in out.lower()
    local = {r["sync_every"]: r["held_out_loss"] for r in rows if r["method"] == "localsgd"}
    nesterov = {r["sync_every"]: r["held_out_loss"] for r in rows if r["method"] == "diloco"}
    wins = sum(local[H] < nesterov[H] for H in local)
    assert f"LocalSGD ends below DiLoCo at {wins} of 4 H values" in out
    # what doc 24 reads from its 2-replica sweep holds on 3 replicas too: DDP lowest, and
    # LocalSGD's plain average below DiLoCo's outer Nesterov at every H (64 steps is 1-64 outer steps)
    assert best["method"] == "ddp" and wins == 4, rows


def test_outer_settings_are_measured_on_the_same_batches(runs):
    out, _, metrics, _, _ = runs["A"]
    settings, rows = metrics["outer_settings"], metrics["sweep"]
    assert [(s["outer_lr"], s["outer_momentum"]) for s in settings] == list(diloco.SETTINGS)
    assert {s["sync_every"] for s in settings} == {diloco.SETTINGS_H}
    # two of them are the sweep's own runs (taken, not trained again: the same numbers)
    named = {(s["outer_lr"], s["outer_momentum"]): s["held_out_loss"] for s in settings}
    assert named[(1.0, 0.0)] == row(rows, "localsgd", diloco.SETTINGS_H)["held_out_loss"]
    assert named[(0.7, 0.9)] == row(rows, "diloco", diloco.SETTINGS_H)["held_out_loss"]
    assert len(set(named.values())) == len(named)  # six different runs
    top = min(settings, key=lambda s: s["held_out_loss"])
    assert f"best outer step here: lr {top['outer_lr']}, momentum {top['outer_momentum']} " \
           f"({top['held_out_loss']:.4f})" in out


def test_every_run_is_measured_beside_ddp_and_both_outer_steps(runs):
    """Step 5: DDP, LocalSGD and DiLoCo at this run's H, on the same batches (no drop-out), also
    without --sweep; runs already made are reused, not trained again."""
    for name, plan in RUNS.items():
        out, _, metrics, _, _ = runs[name]
        same = metrics["same_batches"]
        assert [(r["method"], r["sync_every"]) for r in same] == [("ddp", 1), ("localsgd", plan.H), ("diloco", plan.H)]
        assert re.search(r"lowest held-out loss on these batches: (DDP|LocalSGD|DiLoCo) ", out)
    # B is itself LocalSGD at H = 1 (no drop-out): its row is this run
    assert runs["B"][2]["same_batches"][1]["held_out_loss"] == runs["B"][2]["held_out_loss"]
    # A dropped out: its DiLoCo row is the run without the drop-out, the one Step 8 and the sweep use
    a = runs["A"][2]
    assert a["same_batches"][2]["held_out_loss"] == a["dropout"]["held_out_loss_without"] == \
        row(a["sweep"], "diloco", 16)["held_out_loss"]
    assert a["same_batches"][0]["held_out_loss"] == row(a["sweep"], "ddp", 1)["held_out_loss"]


def test_localsgd_outer_step_is_the_average_and_diloco_goes_past_it():
    """The outer step in this process. Outer SGD lr 1 puts the weights at the replicas' mean;
    the paper's Nesterov (lr 0.7, momentum 0.9) moves 0.7 x 1.9 = 1.33 times the mean pseudo-
    gradient at its first step and about 0.7 / (1 - 0.9) = 7 times it once the momentum has
    built up: what doc 24 uses to explain the sweep."""
    def model():  # any module will do: the outer step sees a list of tensors
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))

    start = [p.detach().clone() for p in model().parameters()]
    ends = [[s + torch.randn_like(s) * 0.01 for s in start] for _ in range(3)]  # three replicas' θ_end
    mean_delta = torch.cat([sum(s - e[i] for e in ends).flatten() / 3 for i, s in enumerate(start)])
    flat_start = torch.cat([s.flatten() for s in start])

    def moved(plan, rounds=1):
        m = model()
        outer, optimizer = diloco.make_outer(m, plan)
        for _ in range(rounds):
            before = torch.cat([o.detach().flatten() for o in outer])
            diloco.apply_outer(m, outer, optimizer, mean_delta)
        after = torch.cat([p.detach().flatten() for p in m.parameters()])
        assert torch.equal(after, torch.cat([o.detach().flatten() for o in outer]))  # model = outer weights
        return (before - after) / mean_delta

    sgd = diloco.Plan(world=3, steps=1, H=1, outer="sgd")
    m = model()
    outer, optimizer = diloco.make_outer(m, sgd)
    diloco.apply_outer(m, outer, optimizer, mean_delta)
    average = torch.cat([sum(e[i] for e in ends).flatten() / 3 for i in range(len(start))])
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in m.parameters()]), average)
    assert not torch.equal(average, flat_start)
    paper = diloco.Plan(world=3, steps=1, H=1, outer="nesterov")
    assert paper.outer_settings() == dict(lr=0.7, momentum=0.9, nesterov=True)
    torch.testing.assert_close(moved(paper).median(), torch.tensor(0.7 * 1.9), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moved(paper, rounds=100).median(), torch.tensor(0.7 / 0.1), rtol=1e-3, atol=1e-3)
    # the sweep's settings: lr and momentum set on a plan; momentum 0 is plain SGD
    assert diloco.Plan(1, 1, 1, outer_lr=0.7, outer_momentum=0.0).outer_settings() == \
        dict(lr=0.7, momentum=0.0, nesterov=False)
    torch.testing.assert_close(moved(diloco.Plan(1, 1, 1, outer_lr=0.7, outer_momentum=0.0)).median(),
                               torch.tensor(0.7))


def test_simulate_steps_the_plans_outer_settings():
    """A plan's outer lr and momentum reach the simulation (the sweep's settings rows run on it
    too): outer Nesterov with lr 1 and momentum 0 is outer SGD lr 1, bit for bit; lr 0.7 is not."""
    base = diloco.Plan(world=2, steps=4, H=2, outer="sgd")
    plain = diloco.simulate(base)["state"]
    same = diloco.simulate(diloco.Plan(world=2, steps=4, H=2, outer="nesterov", outer_lr=1.0,
                                       outer_momentum=0.0))["state"]
    other = diloco.simulate(diloco.Plan(world=2, steps=4, H=2, outer="sgd", outer_lr=0.7))["state"]
    assert all(torch.equal(plain[k], same[k]) for k in plain)
    assert any(not torch.equal(plain[k], other[k]) for k in plain)


# --- the bytes ---------------------------------------------------------------------------------

def value_of(expression: str, N: int) -> float:
    """The printed formula, computed: '(2(N-1) x 412,704 x 3 + ...) / 2,688' with N filled in."""
    python = (expression.replace(",", "").replace(" x ", " * ")
              .replace("2(N-1)", f"2 * ({N} - 1)").replace("2(N-2)", f"2 * ({N} - 2)"))
    assert re.fullmatch(r"[\d\s()+\-*/.]+", python), python
    return eval(python)  # digits and operators only (checked above)


def test_the_printed_formula_equals_its_value():
    """A drop-out run prints the expression of its own bytes, not the no-drop one beside the
    drop-adjusted value (with --outer sgd: '= 1,074.8' for an expression worth 1,228.3)."""
    for outer in ("sgd", "nesterov"):
        for drop in ((None, None), (1, 2)):
            plan = diloco.Plan(world=2, steps=64, H=16, outer=outer, drop_rank=drop[0], drop_at=drop[1])
            expression, value = talk_report.bytes_formula(plan)
            assert value_of(expression, plan.world) == pytest.approx(value, rel=1e-12), (outer, drop, expression)
    # the --outer sgd drop-out of the issue: 3 all-reduces of 2 replicas, none of 1, the weights sent back
    expression, value = talk_report.bytes_formula(diloco.Plan(2, 64, 16, outer="sgd", drop_rank=1, drop_at=2))
    assert f"{value:,.1f}" == "1,074.8" and value * (64 * 48 - 16 * 24) == 3 * 2 * 4 * P + 4 * P


def test_bytes_per_sample_equal_the_formula_and_fall_as_1_over_h(runs):
    out, _, metrics, _, _ = runs["A"]
    N, samples = 3, 64 * T.GLOBAL_BATCH
    rows = [r for r in metrics["sweep"] if r["method"] != "ddp"]
    for r in rows:
        H = r["sync_every"]
        # an all-reduce of 4P bytes: each of N ranks sends 2(N-1)/N of it, once per H steps
        assert r["bytes_sent_per_sample"] == pytest.approx(2 * (N - 1) * 4 * P * (64 // H) / samples, rel=1e-12)
        assert r["bytes_sent_per_sample"] * H == pytest.approx(row(rows, r["method"], 1)["bytes_sent_per_sample"],
                                                             rel=1e-12)
        assert r["bytes_sent_per_sample_formula"] == pytest.approx(r["bytes_sent_per_sample"], rel=1e-12)
    for name in RUNS:  # DDP, measured by the same counter, sends what H = 1 sends
        m = runs[name][2]
        assert m["ddp_adamw_bytes_sent_per_sample"] == pytest.approx(m["h1_adamw_bytes_sent_per_sample"], rel=1e-12)
        assert m["ddp_sgd_bytes_sent_per_sample"] == pytest.approx(2 * (m["world_size"] - 1) * 4 * P / T.GLOBAL_BATCH)
    # run A itself: 3 outer steps of all 3 replicas, 1 of replicas 0 and 2 alone (a group of two),
    # then the outer weights and the momentum (2 x 4P) sent to replica 1
    lost = 16 * T.GLOBAL_BATCH // 3
    assert metrics["bytes_sent"] == 3 * 2 * (N - 1) * 4 * P + 2 * (N - 2) * 4 * P + 2 * 4 * P
    assert metrics["bytes_sent_per_sample"] == pytest.approx(metrics["bytes_sent"] / (samples - lost), rel=1e-12)
    assert metrics["bytes_sent_per_sample_formula"] == pytest.approx(metrics["bytes_sent_per_sample"], rel=1e-12)
    printed = re.search(r"\(formula, N = 3: (.+?) = ([\d,.]+)\)", out)
    assert value_of(printed[1], 3) == pytest.approx(float(printed[2].replace(",", "")), abs=0.05)


def test_the_drop_out_and_what_it_cost(runs):
    out, _, metrics, _, _ = runs["A"]
    d = metrics["dropout"]
    assert (d["rank"], d["at"], d["samples_lost"]) == (1, 2, 16 * T.GLOBAL_BATCH // 3)
    assert d["bytes_to_come_back"] == 2 * 4 * P  # the outer weights and the Nesterov momentum
    assert d["held_out_loss"] == metrics["held_out_loss"]
    assert d["cost"] == pytest.approx(d["held_out_loss"] - d["held_out_loss_without"])
    assert f"the cost is {d['cost']:+.4f}" in out
    # during the round it missed, the losses are the mean over replicas 0 and 2: steps 16-31
    without = row(metrics["sweep"], "diloco", 16)["losses"]
    assert metrics["losses"][16:32] != pytest.approx(without[16:32], abs=1e-3)
    assert metrics["losses"][:16] == pytest.approx(without[:16], abs=1e-6)  # the same run until it left


def test_sweep_writes_its_tables_and_plot(runs):
    out, _, metrics, folder, _ = runs["A"]
    png = folder / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "the same 64 batches (3,072 samples) for each" in out and "sweep.png" in out
    assert "the outer step's lr and momentum at H = 16" in out


@pytest.mark.parametrize("name", RUNS)
def test_prints_the_steps_in_order(runs, name):
    out = runs[name][0]
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 10))


def test_a_world_of_one_runs_to_the_end(tmp_path):
    """One replica talks to nobody: 0 bytes, and no division by DDP's 0 bytes (it crashed)."""
    proc = run_lesson("24", "--world-size", 1, "--steps", 4, "--sync-every", 2, "--out", tmp_path, timeout=300)
    _, metrics = load_run(tmp_path)
    assert metrics["bytes_sent"] == 0 and "one replica talks to nobody" in proc.stdout
    assert [r["method"] for r in metrics["same_batches"]] == ["ddp", "localsgd", "diloco"]


# --- what doc 24 says ---------------------------------------------------------------------------

def test_doc_points_to_torchft_diloco():
    """torch 2.14.1 has no DiLoCo; torchft 0.2.0 ships one: the doc names it, in both languages."""
    torch_files = [f for part in ("distributed", "optim")
                   for f in (ROOT / ".venv" / "lib").glob(f"python3*/site-packages/torch/{part}/**/*.py")]
    assert not any("diloco" in f.read_text(errors="ignore").lower() for f in torch_files)
    for doc in DOCS:
        text = doc.read_text()
        assert "torchft.local_sgd.DiLoCo" in text, doc
        assert "Torch has no DiLoCo" not in text, doc


def test_doc_says_what_the_starter_gets_wrong():
    """Exercise 24's starter copies the outer weights into the model; what it leaves out is the
    average (no all-reduce: each replica steps on its own pseudo-gradient). The doc's common
    mistake that cites the starter must say that, not 'forgetting the outer weights'."""
    outer_step = runpy.run_path(str(ROOT / "exercises" / "24_outer_step.py"))["outer_step"]  # as shipped
    model = torch.nn.Linear(3, 2)
    outer = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the inner steps moved this replica
    outer_step(model, outer, torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True))
    # no process group here, and the starter needed none: it never talks to the other ranks...
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), outer))  # ...but does copy
    for doc in DOCS:
        mistakes = re.search(r"^## (?:Common mistakes|常见错误)\n(.*?)^## ", doc.read_text(), re.S | re.M)[1]
        cites = [bullet for bullet in mistakes.split("\n- ") if "exercise 24's starter" in bullet or
                 "练习 24 的初始代码" in bullet]
        assert len(cites) == 1, (doc, cites)
        for bullet in cites:
            assert "forgetting the outer weights" not in bullet and "忘了外层权重" not in bullet, bullet
            assert "all_reduce" in bullet, bullet


def test_doc_explains_the_outer_step_without_the_exercise_answer():
    """The checked exercise is the outer step: the doc explains it and leaves the code to the
    learner (no block that defines outer_step or all-reduces the pseudo-gradients)."""
    for doc in DOCS:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", doc.read_text(), re.S | re.M):
            assert "def outer_step" not in block and "all_reduce(" not in block, (doc, block)


# --- bad input -------------------------------------------------------------------------------

def test_bad_flags_are_one_line_before_any_rank_starts(monkeypatch, capsys):
    lesson = import_lesson("24")
    cases = {
        ("--steps", "50", "--sync-every", "16"): "--steps 50 is not a multiple of --sync-every 16",
        ("--sweep", "--steps", "96", "--sync-every", "8"): "--sweep trains H = 1, 4, 16, 64",
        ("--drop-rank", "1"): "--drop-rank and --drop-at go together",
        ("--drop-rank", "2", "--drop-at", "1"): "--drop-rank 2 is not a replica",
        ("--drop-rank", "0", "--drop-at", "1", "--world-size", "1"): "--drop-rank 0 is not a replica",
        ("--drop-rank", "1", "--drop-at", "9"): "--drop-at 9: the run has 8 outer steps",
        ("--world-size", "5"): "--world-size must divide",
        ("--sync-every", "0"): "--sync-every",
        ("--outer", "adam"): "--outer",
    }
    for bad, said in cases.items():
        line = parse_error(lesson, list(bad), monkeypatch, capsys)
        assert said in line, (bad, line)


def test_make_refuses_a_bad_flag_before_claiming_the_folder(tmp_path):
    proc = run(["make", "-s", "lesson-24", f"ARGS=--steps 50 --out {tmp_path / 'out'}"], check=False, timeout=60)
    assert proc.returncode == 2 and one_error_line(proc).startswith("error: --steps 50"), proc.stderr
    assert "Step" not in proc.stdout and not (tmp_path / "out").exists()


def test_a_refused_sync_every_names_only_values_that_pass(monkeypatch, capsys):
    """Issue 35: --sync-every 1000000000 was refused with "use --steps 1000000000 or
    1000000000", a run of a billion steps. H above --steps is refused on its own, naming the
    divisors of --steps (that --drop-at leaves room for); each of them passes."""
    lesson = import_lesson("24")
    for base in (["--sync-every", "1000000000"], ["--sync-every", "100", "--world-size", "2",
                                                  "--drop-rank", "1", "--drop-at", "5"]):
        line = parse_error(lesson, base, monkeypatch, capsys)
        assert f"--sync-every {base[1]} is more than --steps 64" in line and "1000000000 or" not in line, line
        fits = [v for v in line.rsplit(": ", 1)[1].replace(" ...", "").split(", ")]
        assert fits and all(v.isdigit() for v in fits), line
        for value in fits:
            monkeypatch.setattr(sys, "argv", ["24", *base[2:], "--sync-every", value])
            assert lesson.parse_args().sync_every == int(value)
