"""Lesson 26: the parity oracle. Two runs through `make lesson-26` as a learner types it (ddp
with --bug grad-sum; tp without a bug, 5 steps each) feed the end-to-end assertions: the
printed steps, the first divergence named in the output and in metrics.json, the growth table,
the recordings on disk and tools/parity.py on them. Every layout without a bug and every
injected bug are then run in this test's own process group (common.distributed.run_ranks: the
lesson's record_pair, one recorded step, 2 ranks; a few on 4), and the comparison, its floor,
the file format and the flags' one-line errors are tested as functions."""
import json
import math
import os
import re
import sys

import pytest
import torch

from common import transformer as T
from common.distributed import run_ranks
from conftest import ROOT, import_lesson, load_run, one_error_line, parse_error, run

import parity_layouts  # noqa: E402  (lessons/26_parity_oracle/, on the path by conftest)
import parity_oracle  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import parity as parity_tool  # noqa: E402  (tools/parity.py)

STEPS = 5
MAKE_RUNS = {"grad-sum": "--bug grad-sum --record-steps 2", "tp": "--layout tp --record-steps 2"}


@pytest.fixture(scope="module")
def lessons(tmp_path_factory):
    found = {}
    for name, flags in MAKE_RUNS.items():
        folder = tmp_path_factory.mktemp(f"lesson26-{name}")
        proc = run(["make", "-s", "lesson-26", f"ARGS={flags} --steps {STEPS} --device cpu --out {folder}"], timeout=300)
        state, metrics = load_run(folder)
        found[name] = (proc.stdout, state, metrics, folder)
    return found


def test_the_summed_gradients_are_named_at_their_first_tensor(lessons):
    out, _, metrics, _ = lessons["grad-sum"]
    first = metrics["first_divergence"]
    assert (first["step"], first["module"], first["pass"], first["tensor"]) == (1, "head", "backward", "head.bias")
    assert first["ratio"] > 1e4 and metrics["max_ratio"] >= first["ratio"]
    assert first["norm_ratio"] == pytest.approx(2.0, abs=1e-3)  # a sum over 2 ranks where a mean was meant
    assert "first divergence: step 1, backward, head.bias (module head)" in out
    assert "|B| / |A| = 2.000 on 2 ranks: a sum where a mean was meant" in out
    assert metrics["chunked_floor_first"]["tensor"] == "head.bias"  # a bug: both floors see it
    assert re.search(r"^step 1: 64 entries, .*: NOT rounding$", out, re.M)
    # the table: the entries just before it, in order, were within rounding (the forward pass)
    table = re.findall(r"^│ (\d+) +│ (\w+) +│ (\S+) +│ \S+ +│ \S+ +│ (\S+)x +│", out, re.M)
    assert [(p, n) for _, p, n, _ in table] == [("forward", "blocks.1.mlp"), ("forward", "blocks.1"), ("forward", "norm"),
                                                ("forward", "head"), ("backward", "head.bias")]
    assert all(float(r) <= 1.0 for *_, r in table[:-1]) and float(table[-1][3]) > 1e4


def test_a_correct_layout_is_within_rounding_everywhere(lessons):
    out, state, metrics, _ = lessons["tp"]
    assert metrics["first_divergence"] is None and metrics["max_ratio"] <= 1.0
    assert len(metrics["max_ratio_per_step"]) == 2 and max(metrics["max_ratio_per_step"]) == metrics["max_ratio"]
    assert "within rounding everywhere: 128 entries in 2 steps" in out
    # lessons 14-24's floor (lesson 13 in 2 chunks) calls this correct layout wrong; the twins' does not
    assert metrics["chunked_floor_entries_above"] > 0 and metrics["chunked_floor_first"]["ratio"] > 1
    assert f"of the 128 entries above it, the first step 1, forward" in out
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 7))
    # the shards, gathered, are lesson 13's model: its names, its shapes, its weights
    reference = T.train_reference(steps=STEPS)["state"]
    T.make_model().load_state_dict(state)  # strict: every name and shape of lesson 13's model
    assert max((state[k] - reference[k]).abs().max().item() for k in state) < 1e-5


def test_rounding_grows_but_stays_the_twins_size_while_a_bug_starts_big(lessons):
    _, _, clean, _ = lessons["tp"]
    _, _, bug, _ = lessons["grad-sum"]
    for metrics in (clean, bug):
        assert sorted(map(int, metrics["weights_gap"])) == [1, 2, 3, 5]  # SHOWN_STEPS up to --steps 5
    # no bug: the layout's weights stay as close to lesson 13's as to their own float64 twin
    assert clean["weights_gap"]["1"] < 1e-6
    assert all(clean["weights_gap"][s] < 3 * clean["weights_gap_to_float64_twin"][s] for s in clean["weights_gap"])
    # a bug: from the first step, thousands of times its own rounding (the twin has the bug too)
    assert bug["weights_gap"]["1"] > 1e3 * bug["weights_gap_to_float64_twin"]["1"]
    assert bug["weights_gap_to_float64_twin"]["1"] < 1e-6


def test_the_recordings_on_disk_are_what_tools_parity_compares(lessons, capsys):
    for name, (_, _, metrics, folder) in lessons.items():
        reference, parallel = (parity_oracle.load(folder / f) for f in ("reference.pt", "parallel.pt"))
        assert len(reference["names"]) == len(parallel["names"]) == 2 * metrics["entries_per_step"]
        assert set(reference["rounding"]) == set(reference["names"])  # every floor measured
        assert reference["names"][0] == "1/forward/tok_emb" and reference["names"][26] == "1/backward/head.bias"
        code = parity_tool.main([str(folder / "reference.pt"), str(folder / "parallel.pt")])
        out = capsys.readouterr().out
        assert code == (0 if metrics["first_divergence"] is None else 1)
        if metrics["first_divergence"]:
            assert "first divergence: step 1, backward, head.bias (module head)" in out
        else:
            assert "within rounding everywhere: 128 entries in 2 steps" in out
        assert f"tools/parity.py {folder / 'reference.pt'} {folder / 'parallel.pt'}" in lessons[name][0]


# --- every layout and every bug, in this test's own process group ----------------------------

CLEAN = [(layout, None, None) for layout in parity_layouts.LAYOUTS]
NAMED = {  # (layout, bug, where) -> (module, pass) where the oracle must name it, at step 1
    ("ddp", "grad-sum", None): ("head", "backward"),
    ("ddp", "data-shift", None): ("tok_emb", "forward"),
    ("fsdp", "data-shift", None): ("tok_emb", "forward"),
    ("tp", "tp-bias", None): ("blocks.0.attn.proj", "forward"),
    ("tp", "sp-norm", None): ("norm", "backward"),
    ("cp", "cp-positions", None): ("pos_emb", "forward"),
    ("cp", "grad-sum", None): ("head", "backward"),
    ("cp", "data-shift", None): ("tok_emb", "forward"),
    ("tp", "tp-bias", "blocks.1.mlp.proj"): ("blocks.1.mlp.proj", "forward"),  # one layer only
    ("tp", "sp-norm", "blocks.0.norm1"): ("blocks.0.norm1", "backward"),       # one norm only
}
ON_FOUR = [("fsdp", None, None), ("tp", None, None), ("cp", "grad-sum", None)]


def _oracle(rank: int, world: int, cases: list) -> dict | None:
    """For each case, lesson 26's record_pair (one step) and, on rank 0, the comparison."""
    found = {}
    for layout, bug, where in cases:
        pair = parity_layouts.record_pair(rank, world, layout, parity_layouts.Bug(bug, where), steps=1)
        if rank == 0:
            rows = parity_oracle.compare(*pair)
            found[layout, bug, where] = (parity_oracle.divergence_metrics(parity_oracle.first_divergence(rows)),
                                         max(r["ratio"] for r in rows), len(rows))
    return found if rank == 0 else None


@pytest.fixture(scope="module")
def oracle():
    found = run_ranks(_oracle, 2, (CLEAN + list(NAMED),), timeout_s=300, group_timeout_s=60)[0]
    found4 = run_ranks(_oracle, 4, (ON_FOUR,), timeout_s=300, group_timeout_s=60)[0]
    return found, found4


@pytest.mark.parametrize("layout", parity_layouts.LAYOUTS)
def test_every_correct_layout_reports_no_divergence(oracle, layout):
    first, worst, entries = oracle[0][layout, None, None]
    assert first is None and worst <= 1.0, (first, worst)
    assert entries == 64  # 26 module outputs and 38 gradients: every one compared


@pytest.mark.parametrize("case", list(NAMED), ids=lambda c: "-".join(x for x in c if x))
def test_every_injected_bug_is_named_at_its_first_module(oracle, case):
    first, _, _ = oracle[0][case]
    assert first is not None and (first["step"], first["module"], first["pass"]) == (1, *NAMED[case]), first
    assert first["ratio"] > 1e3, first  # not a near miss: far above rounding
    if case[1] == "grad-sum":
        assert first["norm_ratio"] == pytest.approx(2.0, abs=1e-3)
    if case[1] in ("tp-bias", "sp-norm"):  # what doc 26 says |B| / |A| tells: a bias twice, a share of a sum
        assert (first["norm_ratio"] > 1.01) == (case[1] == "tp-bias") and (first["norm_ratio"] < 0.99) == (case[1] == "sp-norm")


@pytest.mark.parametrize("case", ON_FOUR, ids=lambda c: "-".join(x for x in c if x))
def test_on_four_ranks_too(oracle, case):
    first, worst, _ = oracle[1][case]
    if case[1] is None:
        assert first is None and worst <= 1.0
    else:
        assert (first["module"], first["pass"], first["norm_ratio"]) == ("head", "backward", pytest.approx(4.0, abs=1e-3))


# --- the comparison and its floor, as functions -------------------------------------------------

def recording(values: dict, rounding: dict | None = None, about: str = "", dtype=torch.float32) -> dict:
    rec = parity_oracle.new_recording(about)
    rec["names"] = list(values)
    rec["values"] = {k: torch.as_tensor(v).to(dtype) for k, v in values.items()}
    rec["rounding"] = dict(rounding or {})
    return rec


def test_the_floor_is_both_roundings_plus_one_float32_step():
    a = recording({"1/forward/x": [1.0, -3.0]}, {"1/forward/x": 1e-7})
    b = recording({"1/forward/x": [1.0, -3.0 + 2e-7]}, {"1/forward/x": 2e-7})
    row = parity_oracle.compare(a, b)[0]
    floor = 1e-7 + 2e-7 + 2 ** -23 * 3.0
    assert row["floor"] == pytest.approx(floor)
    assert row["diff"] == pytest.approx(abs(torch.tensor(-3.0 + 2e-7).item() + 3.0))
    assert row["ratio"] == pytest.approx(row["diff"] / floor)


def test_exact_entries_need_the_minimum_and_nan_is_never_rounding():
    zero = recording({"1/forward/x": [0.0, 0.0]})
    assert parity_oracle.compare(zero, zero)[0]["ratio"] == 0.0
    assert math.isinf(parity_oracle.compare(zero, recording({"1/forward/x": [0.0, 1e-30]}))[0]["ratio"])
    one = recording({"1/forward/x": [4.0]})
    assert parity_oracle.compare(one, recording({"1/forward/x": [4.0 + 2 ** -21]}))[0]["ratio"] == pytest.approx(1.0)
    assert math.isinf(parity_oracle.compare(one, recording({"1/forward/x": [math.nan]}))[0]["ratio"])
    missing = parity_oracle.compare(recording({"1/forward/x": [4.0], "1/forward/y": [1.0]}), one)
    assert missing[1]["note"] == "missing in B" and parity_oracle.first_divergence(missing)["name"] == "y"
    shape = parity_oracle.compare(one, recording({"1/forward/x": [4.0, 4.0]}))[0]
    assert math.isinf(shape["ratio"]) and "shape" in shape["note"]


def test_the_first_divergence_is_the_first_in_order_not_the_largest():
    a = recording({"1/forward/x": [1.0], "1/forward/y": [1.0], "1/backward/m.w": [1.0]})
    b = recording({"1/forward/x": [1.0], "1/forward/y": [1.01], "1/backward/m.w": [9.0]})
    rows = parity_oracle.compare(a, b)
    first = parity_oracle.first_divergence(rows)
    assert first["name"] == "y" and parity_oracle.module_of(first) == "y"
    assert parity_oracle.module_of(rows[2]) == "m" and parity_oracle.by_step(rows)[1]["name"] == "m.w"
    assert parity_oracle.divergence_metrics(first)["module"] == "y"


def test_the_bound_holds_for_sums_in_any_order():
    """What the floor promises, on the operation data parallel changes: a sum (a matrix product)
    computed whole or in chunks, each in float32 beside its float64 twin. The ratio stays at or
    below 1 in every trial; a relative error of 1e-5, far below any of lesson 26's bugs, is
    far above it."""
    g = torch.Generator().manual_seed(0)
    whole = lambda x, w: x @ w  # noqa: E731
    chunked = lambda x, w: sum(x[:, i:i + 64] @ w[i:i + 64] for i in range(0, 512, 64))  # noqa: E731
    ratios = []
    for trial in range(20):
        x, w = torch.randn(64, 512, generator=g), torch.randn(512, 32, generator=g)
        a, b = (recording({"1/forward/y": f(x, w)}) for f in (whole, chunked))
        for rec, f in ((a, whole), (b, chunked)):  # each beside its twin: the same sums in float64
            parity_oracle.measure_rounding(rec, recording({"1/forward/y": f(x.double(), w.double())}, dtype=torch.float64))
        ratios.append(parity_oracle.compare(a, b)[0]["ratio"])
        wrong = recording({"1/forward/y": b["values"]["1/forward/y"] * (1 + 1e-5)}, b["rounding"])
        assert parity_oracle.compare(a, wrong)[0]["ratio"] > 1.0
    assert max(ratios) <= 1.0 and max(ratios) > 0.3, ratios  # never above, and not a vacuous bound


def test_whole_shapes_come_from_a_forward_on_the_meta_device():
    with torch.device("meta"):
        shapes = parity_oracle.whole_shapes(T.Transformer(), torch.zeros(T.GLOBAL_BATCH, T.SEQ, dtype=torch.long))
    assert shapes["forward/tok_emb"] == (T.GLOBAL_BATCH, T.SEQ, T.DIM) and shapes["forward/pos_emb"] == (T.SEQ, T.DIM)
    assert shapes["forward/blocks.0.mlp.fc"] == (T.GLOBAL_BATCH, T.SEQ, T.MLP_DIM)
    assert shapes["backward/blocks.1.attn.proj.weight"] == (T.DIM, T.DIM)
    assert sum(k.startswith("forward/") for k in shapes) == 26 and sum(k.startswith("backward/") for k in shapes) == 38


def test_one_process_recorder_keeps_the_order_things_happened():
    model = T.make_model()
    recorder = parity_oracle.Recorder(model)
    x, y = T.batch(0)
    with recorder.forward(1):
        loss = parity_layouts.loss_fn(model(x), y)
    loss.backward()
    recorder.gradients(1)
    recorder.collect()
    names = recorder.recording["names"]
    assert names[:3] == ["1/forward/tok_emb", "1/forward/pos_emb", "1/forward/blocks.0.norm1"]
    assert names[25] == "1/forward/head" and names[26:28] == ["1/backward/head.bias", "1/backward/head.weight"]
    assert names[-1] == "1/backward/tok_emb.weight" and len(names) == 64
    torch.testing.assert_close(recorder.recording["values"]["1/forward/head"], model(x))


# --- the file ------------------------------------------------------------------------------------

def test_a_recording_round_trips_and_nothing_else_loads(tmp_path):
    rec = recording({"1/forward/x": [1.0, 2.0]}, {"1/forward/x": 1e-8}, "mine")
    parity_oracle.save(rec, tmp_path / "a.pt")
    back = parity_oracle.load(tmp_path / "a.pt")
    assert back["names"] == rec["names"] and back["about"] == "mine" and back["rounding"] == rec["rounding"]
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a pickled class: code, refused
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "text.pt").write_text("hello")
    for name, words in (("other.pt", "is not a parity-recording/1 file"), ("module.pt", "torch.load(weights_only=True) cannot read it"),
                        ("fifo.pt", "is not a regular file"), ("text.pt", "cannot read it"),
                        ("none.pt", "no such file")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parity_oracle.load(tmp_path / name)


def test_tools_parity_verdicts_exit_codes_and_float64_twins(tmp_path, capsys):
    a = recording({"1/forward/x": [1.0, 2.0], "1/backward/m.w": [0.5]})
    b = recording({"1/forward/x": [1.0, 2.0 + 1e-6], "1/backward/m.w": [0.5]})
    a64 = recording(a["values"], dtype=torch.float64)  # a is exact
    b64 = recording({"1/forward/x": [1.0, 2.0], "1/backward/m.w": [0.5]}, dtype=torch.float64)  # b rounded x
    for name, rec in (("a", a), ("b", b), ("a64", a64), ("b64", b64)):
        parity_oracle.save(rec, tmp_path / f"{name}.pt")
    assert parity_tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1  # no floor measured
    out = capsys.readouterr().out
    assert "carry no measured rounding" in out and "first divergence: step 1, forward, x" in out
    assert parity_tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--float64",
                             str(tmp_path / "a64.pt"), str(tmp_path / "b64.pt")]) == 0  # b's rounding, measured
    assert "within rounding everywhere: 2 entries in 1 step, the largest ratio" in capsys.readouterr().out
    assert parity_tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--limit", "100"]) == 0


def test_tools_parity_mistakes_are_one_line(tmp_path):
    for args, words in (([], "the following arguments are required"),
                        (["runs/none.pt", "runs/none2.pt"], "no such file"),
                        (["README.md", "README.md"], "cannot read it")):
        line = one_error_line(run([sys.executable, "tools/parity.py", *args], check=False, timeout=60))
        assert line.startswith("error:") and words in line, line


# --- flags ------------------------------------------------------------------------------------

def test_bad_flags_are_one_line_before_any_rank_starts(monkeypatch, capsys):
    lesson = import_lesson("26")
    cases = {("--bug", "tp-bias", "--layout", "ddp"): "--bug tp-bias is a mistake of the tp layout, not of ddp: pass --layout tp",
             ("--bug", "grad-sum", "--world-size", "1"): "--bug needs --world-size 2 or more",
             ("--layout", "tp", "--world-size", "3"): "4 attention heads",
             ("--layout", "cp", "--world-size", "3"): "16 tokens of half a sequence",
             ("--record-steps", "9", "--steps", "4"): "--record-steps 9 is more than --steps 4",
             ("--bug", "typo"): "--bug: invalid choice"}
    for flags, words in cases.items():
        assert words in parse_error(lesson, list(flags), monkeypatch, capsys), flags
    monkeypatch.setattr(sys, "argv", ["26", "--bug", "sp-norm"])
    assert lesson.parse_args().layout == "tp"  # a bug without --layout picks its layout


def test_make_refuses_a_bug_on_the_wrong_layout_in_one_line(tmp_path):
    proc = run(["make", "-s", "lesson-26", f"ARGS=--bug cp-positions --layout ddp --out {tmp_path / 'out'}"],
               check=False, timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "pass --layout cp" in line, line
    assert "Step 1" not in proc.stdout and not (tmp_path / "out").exists()


# --- exercise 26's check: its hints, with the oracle's answer given (no ranks) ------------------

@pytest.mark.parametrize("module, kind, bug, words", [
    ("norm", "backward", "sp-norm", "is not where the difference first leaves its floor"),
    ("blocks.0.norm1", "forward", "sp-norm", "is not in the forward pass"),
    ("blocks.0.norm1", "backward", "grad-sum", "is right; but grad-sum"),
])  # (the right answer passes: tests/test_exercises.py runs the check on tests/solutions/26_*.py)
def test_check_26_names_what_is_wrong(tmp_path, monkeypatch, module, kind, bug, words):
    sys.path.insert(0, str(ROOT / "tools" / "checks"))
    import check_26
    from check_exercise import NotYet

    assert parity_layouts.hidden_bug(0) == ("tp", parity_layouts.Bug("sp-norm", "blocks.0.norm1"))
    monkeypatch.setattr(check_26, "_oracle", lambda layout, hidden: {  # what the oracle finds for SEED 0
        "step": 1, "module": "blocks.0.norm1", "pass": "backward", "tensor": "blocks.0.norm1.bias",
        "ratio": 1.4e5, "norm_ratio": 0.871})
    answer = tmp_path / "answer.py"
    answer.write_text(f'SEED = 0\nMODULE = "{module}"\nPASS = "{kind}"\nBUG = "{bug}"\n')
    with pytest.raises(NotYet, match=re.escape(words)):
        check_26.check(answer)
