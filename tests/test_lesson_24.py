"""Lesson 24: LocalSGD and DiLoCo. Two runs of the lesson through its real launcher:

A: 3 replicas, DiLoCo (AdamW inside, Nesterov outside), H = 16 for 64 steps, replica 1 away for
   outer step 2 (so the other two all-reduce in a group of two), with --sweep (H = 1, 4, 16, 64);
B: 2 replicas, H = 1, SGD inside and outside (lr 1): DDP's arithmetic, 8 steps.

Checked here, not only read from the lesson: B's weights against plain SGD on the whole batch
in one process, and against its replicas simulated here (A's simulation, with the drop-out,
is the lesson's own Step 9: its numbers are checked); the bytes per sample against the
formula and 1/H; what the drop-out cost; bad flags refused in one line before any rank starts."""
import re

import pytest
import torch

from common import transformer as T
from conftest import import_lesson, load_run, one_error_line, parse_error, run, run_lesson

import diloco as D  # lessons/24_local_sgd_diloco/diloco.py (conftest puts the lessons' folders on the path)

RUNS = {
    "A": D.Plan(world=3, steps=64, H=16, inner="adamw", outer="nesterov", drop_rank=1, drop_at=2),
    "B": D.Plan(world=2, steps=8, H=1, inner="sgd", outer="sgd"),
}
P = sum(p.numel() for p in T.make_model().parameters())


def flags(plan: D.Plan) -> list:
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
        proc = run_lesson("24", *flags(plan), "--out", folder, timeout=600)  # a loaded machine: 10x slower
        state, metrics = load_run(folder)
        # B's replicas simulated here, now (A's, 2 x 64 steps, the lesson simulates itself: Step 9)
        out[name] = (proc.stdout, state, metrics, folder, D.simulate(plan) if name == "B" else None)
    return out


def test_h1_with_sgd_inside_is_ddp(runs):
    """Run B's own weights (H = 1, SGD inside, outer SGD lr 1, 2 replicas) against plain SGD on
    the whole batch in one process: DDP's arithmetic, up to float rounding."""
    out, state, metrics, _, _ = runs["B"]
    torch.set_num_threads(1)  # as the ranks compute (and quick on a busy machine)
    model = T.make_model(T.SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=D.SGD_LR)
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


def test_bytes_per_sample_equal_the_formula_and_fall_as_1_over_h(runs):
    _, _, metrics, _, _ = runs["A"]
    N, samples = 3, 64 * T.GLOBAL_BATCH
    sweep = metrics["sweep"]
    assert sorted(map(int, sweep)) == [1, 4, 16, 64]
    for H, row in sweep.items():
        # an all-reduce of 4P bytes: each of N ranks sends 2(N-1)/N of it, once per H steps
        assert row["bytes_sent_per_sample"] == pytest.approx(2 * (N - 1) * 4 * P * (64 // int(H)) / samples, rel=1e-12)
        assert row["bytes_sent_per_sample"] * int(H) == pytest.approx(sweep["1"]["bytes_sent_per_sample"], rel=1e-12)
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


def test_the_drop_out_and_what_it_cost(runs):
    out, _, metrics, _, _ = runs["A"]
    d = metrics["dropout"]
    assert (d["rank"], d["at"], d["samples_lost"]) == (1, 2, 16 * T.GLOBAL_BATCH // 3)
    assert d["bytes_to_come_back"] == 2 * 4 * P  # the outer weights and the Nesterov momentum
    assert d["held_out_loss"] == metrics["held_out_loss"]
    assert d["held_out_loss_without"] == metrics["sweep"]["16"]["held_out_loss"]  # the same run, no drop-out
    assert d["cost"] == pytest.approx(d["held_out_loss"] - d["held_out_loss_without"])
    assert f"the cost is {d['cost']:+.4f}" in out
    # during the round it missed, the losses are the mean over replicas 0 and 2: steps 16-31
    assert metrics["losses"][16:32] != pytest.approx(metrics["sweep"]["16"]["losses"][16:32], abs=1e-3)


def test_sweep_writes_its_table_and_plot(runs):
    out, _, metrics, folder, _ = runs["A"]
    png = folder / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "H sweep, 64 inner steps each" in out and "sweep.png" in out


@pytest.mark.parametrize("name", RUNS)
def test_prints_the_steps_in_order(runs, name):
    out = runs[name][0]
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 10))


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
