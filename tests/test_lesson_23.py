"""Lesson 23: a cluster on a laptop. Four runs of the lesson, started together (each is mostly one
process): rank 0 of 1,024 fake ranks for the tiny model (a 256 x 4 mesh, where FSDP2's padding
shows) and for the 1b model (the default, 128 x 8), and the --real trust check on 2 and 4 gloo
ranks. Every byte and count the lesson wrote is checked against formulas worked out here from
the model's shapes, and against lesson 19's planner; bad flags are refused before any work."""
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import import_lesson, lesson_path, load_run, parse_error, run, run_lesson

import fake_cluster as F  # lessons/23_cluster_on_a_laptop/ (conftest puts the lessons' folders on the path)
import planner  # lessons/19_two_d_mesh/planner.py

RUNS = {  # name: (model, dp, tp, microbatches, real)
    "tiny-1024": ("tiny", 256, 4, 1, False),
    "1b-1024": ("1b", 128, 8, 1, False),
    "real-2": ("tiny", 2, 1, 2, True),
    "real-4": ("tiny", 2, 2, 1, True),
}
pytestmark = pytest.mark.timeout(900)  # the module fixture runs 4 jobs in one setup (about 45 s on 2 idle cores)
COLWISE = ("attn.q", "attn.k", "attn.v", "mlp.fc")  # lesson 19's plan: rows split across tp
ROWWISE = ("attn.proj.weight", "mlp.proj.weight")  # columns split across tp


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def one(name):
        model, dp, tp, m, real = RUNS[name]
        folder = tmp_path_factory.mktemp(f"lesson23-{name}")
        proc = run_lesson("23", "--model", model, "--world-size", dp * tp, "--tp", tp, "--microbatches", m,
                          *(["--real"] if real else []), "--out", folder, timeout=800)
        return name, (proc.stdout, load_run(folder)[1], folder)

    with ThreadPoolExecutor(len(RUNS)) as pool:  # most of each run is one process: overlap them
        return dict(pool.map(one, RUNS))


def shards(model: str, dp: int, tp: int) -> list[tuple[int, int, int]]:
    """(FSDP group: block number or -1 for the root, rows rank 0 holds, elements per row) of
    every parameter: tp splits lesson 19's layers, then FSDP2 gives each rank ceil(rows / dp)."""
    with torch.device("meta"):
        named = list(F.make_model(F.SIZES[model]).named_parameters())
    out = []
    for name, p in named:
        rows, cols = p.shape[0], math.prod(p.shape[1:])
        rows //= tp if any(s in name for s in COLWISE) else 1
        cols //= tp if any(s in name for s in ROWWISE) else 1
        group = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        out.append((group, math.ceil(rows / dp), cols))
    return out


@pytest.mark.parametrize("name", RUNS)
def test_rank_0_holds_its_padded_shards_fp32(runs, name):
    _, metrics, _ = runs[name]
    model, dp, tp, _, _ = RUNS[name]
    held = sum(4 * rows * cols for _, rows, cols in shards(model, dp, tp))
    assert metrics["per_rank"]["held_bytes"] == {"parameters": held, "gradients": held, "optimizer_state": 2 * held}
    assert metrics["world_size"] == dp * tp and metrics["mesh_shape"] == [dp, tp]


@pytest.mark.parametrize("name", RUNS)
def test_collectives_and_bytes_per_dimension_equal_the_formulas(runs, name):
    _, metrics, _ = runs[name]
    model, dp, tp, m, _ = RUNS[name]
    size, per_rank = F.SIZES[model], metrics["per_rank"]
    blocks = size.blocks
    # FSDP2, per micro-batch: each block gathered in forward and again in backward, the root once
    # (kept through backward); every group's gradients reduce-scattered
    assert per_rank["collectives"] == {"all_gather": m * (2 * blocks + 1), "reduce_scatter": m * (blocks + 1),
                                       "all_reduce": m * 4 * blocks * (tp > 1)}  # tp: 2 forward + 2 backward a block
    gathered = [0] * (blocks + 1)  # bytes of each group's all-gather output: dp padded shards
    for group, rows, cols in shards(model, dp, tp):
        gathered[group] += 4 * rows * cols * dp
    ring = (dp - 1) / dp
    dp_sent = m * ring * (3 * sum(gathered[:-1]) + 2 * gathered[-1])
    tp_sent = m * 4 * blocks * 2 * (tp - 1) / tp * size.seq * size.dim * 4  # (1, seq, dim) fp32 activations
    assert per_rank["sent_bytes"]["dp"] == pytest.approx(dp_sent, abs=1)
    assert per_rank["sent_bytes"]["tp"] == pytest.approx(tp_sent, abs=1)


def test_planner_within_10_percent_at_1b_on_1024_ranks(runs):
    out, metrics, _ = runs["1b-1024"]
    assert metrics["max_relative_difference"] <= 0.10
    assert metrics["parameters"] > 0.9e9 and metrics["per_rank"]["sent_bytes"]["tp"] > 0
    for group in ("held_bytes", "sent_bytes"):  # the planner's keys, and the same numbers as it gives
        for key, value in metrics["planner"][group].items():
            assert metrics["per_rank"][group][key] == pytest.approx(value, rel=0.10)
    assert "over 10%" not in out and "largest difference from the planner" in out


def test_planner_counts_zero_3_traffic_in_every_micro_batch(runs):
    """real-2 runs 2 micro-batches: FSDP2 gathers and reduce-scatters in each one. The planner
    agrees (lesson 23 fixed it: it counted one micro-batch's worth per step)."""
    _, metrics, _ = runs["real-2"]
    assert metrics["microbatches"] == 2 and metrics["max_relative_difference"] < 1e-6
    model = planner.Model(1e9, 2, 64, 32, 1, microbatches=4)
    one = planner.Model(1e9, 2, 64, 32, 1, microbatches=1)
    lay = planner.Layout(dp=8, zero=3)
    assert planner.comm(model, lay)["dp"] == pytest.approx(4 * planner.comm(one, lay)["dp"])


def test_small_model_on_many_ranks_says_the_planner_is_wrong_and_why(runs):
    out, metrics, _ = runs["tiny-1024"]
    assert metrics["max_relative_difference"] > 0.10  # the padding: the planner divides evenly
    assert "over 10%: the planner is wrong here" in out and "ceil(rows / dp)" in out


@pytest.mark.parametrize("name", ["real-2", "real-4"])
def test_real_gloo_ranks_count_what_the_fake_group_counts(runs, name):
    out, metrics, _ = runs[name]
    fake, real = metrics["per_rank"], metrics["real"]
    assert metrics["fake_equals_real"] is True
    for key in ("held_bytes", "collectives", "sent_bytes", "collectives_by_dim", "comm_debug_mode"):
        assert fake[key] == real[key], key
    # torch's own CommDebugMode counts what CommLog counts, FSDP2's collectives included
    assert {k: v for k, v in fake["collectives"].items() if v} == fake["comm_debug_mode"]
    assert "agree on every count and byte: True" in out


def test_mem_tracker_peak_under_fake_tensors_is_not_the_real_peak(runs):
    """What the lesson says plainly: MemTracker runs under FakeTensorMode, but its peak differs
    from the same tracker on real ranks (activations nearly vanish)."""
    _, metrics, _ = runs["real-4"]
    fake, real = metrics["per_rank"]["peak_bytes"], metrics["real"]["peak_bytes"]
    assert metrics["peak_fake_vs_real"] > 0.05 and fake["total"] != real["total"]
    assert fake.get("activation", 0) < real["activation"] / 10
    assert runs["1b-1024"][1]["per_rank"]["peak_bytes"] == {}  # so the fake runs report none
    assert runs["real-2"][1]["per_rank"]["peak_bytes"] == {}  # micro-batches: MemTracker refuses


def test_steps_and_private_api_note(runs):
    out, metrics, _ = runs["tiny-1024"]
    assert [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)] == list(range(1, 8))
    assert "PRIVATE API" in out and f"checked on torch {F.CHECKED_ON}" in out
    assert metrics["checked_on"] == F.CHECKED_ON and metrics["backend"] == "fake"


@pytest.mark.parametrize("flags,words", [
    (["--tp", "3"], "does not divide --world-size"),
    (["--world-size", "64", "--tp", "3", "--dp", "20"], "= 60 ranks, not --world-size 64"),
    (["--model", "tiny", "--tp", "8"], "does not divide --model tiny's 4 attention heads"),
    (["--world-size", "0"], "1 or more"),
    (["--world-size", "100000"], "checked up to 4096"),
    (["--microbatches", "17"], "at most 16"),
    (["--real"], "use --model tiny and at most 8 ranks"),
    (["--real", "--model", "tiny", "--world-size", "16", "--tp", "2"], "at most 8 ranks"),
    (["--model", "70b"], "invalid choice"),
])
def test_bad_flags_are_refused_in_one_line(flags, words, monkeypatch, capsys):
    line = parse_error(import_lesson("23"), flags, monkeypatch, capsys)
    assert words in line, line


def test_the_picture_draws_from_the_runs(runs, tmp_path):
    """cluster_pictures.py draws docs/23's picture from lesson 23's metrics.json files."""
    import importlib.util  # by path: other lessons' folders have picture scripts too
    path = lesson_path("23").with_suffix("") / "cluster_pictures.py"
    spec = importlib.util.spec_from_file_location("lesson23_pictures", path)
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    to = tmp_path / "bytes.png"
    assert pictures.draw([runs["tiny-1024"][2], runs["1b-1024"][2]], to).startswith("wrote")
    assert to.stat().st_size > 10_000


def test_a_mesh_built_inside_fake_tensor_mode_fails():
    """Step 2's rule: the mesh reads numbers out of its tensor of ranks; a fake one has none."""
    script = ("import torch.distributed as dist\n"
              "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
              "from torch._subclasses.fake_tensor import FakeTensorMode\n"
              "dist.init_process_group('fake', rank=0, world_size=4, store=FakeStore())\n"
              "with FakeTensorMode():\n"
              "    dist.init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n")
    proc = run([sys.executable, "-c", script], check=False, timeout=120)
    assert proc.returncode != 0 and "DataDependentOutputException" in proc.stderr, proc.stderr[-2000:]
