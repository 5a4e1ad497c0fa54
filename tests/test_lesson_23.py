"""Lesson 23: a cluster on a laptop. Three runs of the lesson, started together (each is mostly
one process): rank 0 of 1,024 fake ranks for the tiny model (a 256 x 4 mesh, where FSDP2's
padding shows, 2 micro-batches) and for the 1b model (the default, 128 x 8), and the --real
trust check on 4 gloo ranks. Every byte and count the lesson wrote is checked against formulas
worked out here from the model's shapes, and against lesson 19's planner; the planner given the
shapes is checked against the same formulas without a run; bad flags are refused before any work."""
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import import_lesson, load_run, parse_error, run, run_lesson

import cluster_report as R  # lessons/23_cluster_on_a_laptop/ (conftest puts the lessons' folders on the path)
import fake_cluster as F
import planner  # lessons/19_two_d_mesh/planner.py

RUNS = {  # name: (model, dp, tp, microbatches, real)
    "tiny-1024": ("tiny", 256, 4, 2, False),
    "1b-1024": ("1b", 128, 8, 1, False),
    "real-4": ("tiny", 2, 2, 1, True),
}
pytestmark = pytest.mark.timeout(900)  # the module fixture runs 3 jobs in one setup (about 45 s on 2 idle cores)
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


def held_and_sent(model: str, dp: int, tp: int, m: int) -> tuple[int, float, float]:
    """From the shapes: fp32 bytes of parameters rank 0 holds, and the bytes it sends per step
    across dp and across tp."""
    size, blocks = F.SIZES[model], F.SIZES[model].blocks
    gathered = [0] * (blocks + 1)  # bytes of each group's all-gather output: dp padded shards
    for group, rows, cols in shards(model, dp, tp):
        gathered[group] += 4 * rows * cols * dp
    # FSDP2, per micro-batch: each block gathered in forward and again in backward, the root once
    # (kept through backward); every group's gradients reduce-scattered
    dp_sent = m * (dp - 1) / dp * (3 * sum(gathered[:-1]) + 2 * gathered[-1])
    tp_sent = m * 4 * blocks * 2 * (tp - 1) / tp * size.seq * size.dim * 4  # (1, seq, dim) fp32 activations
    return sum(gathered) // dp, dp_sent, tp_sent


@pytest.mark.parametrize("name", RUNS)
def test_rank_0_holds_its_padded_shards_fp32(runs, name):
    _, metrics, _ = runs[name]
    model, dp, tp, m, _ = RUNS[name]
    held = held_and_sent(model, dp, tp, m)[0]
    assert metrics["per_rank"]["held_bytes"] == {"parameters": held, "gradients": held, "optimizer_state": 2 * held}
    assert metrics["world_size"] == dp * tp and metrics["mesh_shape"] == [dp, tp]


@pytest.mark.parametrize("name", RUNS)
def test_collectives_and_bytes_per_dimension_equal_the_formulas(runs, name):
    """FSDP2 gathers and reduce-scatters in every micro-batch (tiny-1024 runs 2)."""
    _, metrics, _ = runs[name]
    model, dp, tp, m, _ = RUNS[name]
    blocks, per_rank = F.SIZES[model].blocks, metrics["per_rank"]
    assert per_rank["collectives"] == {"all_gather": m * (2 * blocks + 1), "reduce_scatter": m * (blocks + 1),
                                       "all_reduce": m * 4 * blocks * (tp > 1)}  # tp: 2 forward + 2 backward a block
    _, dp_sent, tp_sent = held_and_sent(model, dp, tp, m)
    assert per_rank["sent_bytes"]["dp"] == pytest.approx(dp_sent, abs=1)
    assert per_rank["sent_bytes"]["tp"] == pytest.approx(tp_sent, abs=1)


@pytest.mark.parametrize("model,dp,tp", [("tiny", 256, 4), ("1b", 128, 8), ("tiny", 2, 2)])
def test_planner_given_the_shapes_counts_fsdp2s_padding(model, dp, tp):
    """No run: lesson 19's planner, given the model's shapes (cluster_report.planner_model),
    gives to the byte what the shapes say FSDP2 holds and sends (the runs measure the same).
    Without the shapes it divides evenly: 7.9 times too little for the tiny model on 256 x 4."""
    lay, m = planner.Layout(dp=dp, tp=tp, zero=3), 2
    shaped, even = R.planner_model(F.SIZES[model], m), R.planner_model(F.SIZES[model], m, shapes=False)
    held, dp_sent, tp_sent = held_and_sent(model, dp, tp, m)
    assert planner.memory(shaped, lay, planner.FP32) == {"parameters": held, "gradients": held, "optimizer_state": 2 * held}
    sent = planner.comm(shaped, lay, element=4)
    assert sent["dp"] == pytest.approx(dp_sent, abs=1) and sent["tp"] == pytest.approx(tp_sent, abs=1)
    padding = held / planner.memory(even, lay, planner.FP32)["parameters"]
    assert padding > 7 if (model, dp) == ("tiny", 256) else padding == pytest.approx(1)
    for zero in (0, 1, 2):  # ZeRO-1/2 deal whole tensors (lesson 15): the shapes change nothing
        other = planner.Layout(dp=dp, tp=tp, zero=zero)
        assert planner.memory(shaped, other, planner.FP32) == pytest.approx(planner.memory(even, other, planner.FP32))
        assert planner.comm(shaped, other, 4) == pytest.approx(planner.comm(even, other, 4))


def test_planner_pads_each_tensor_as_torch_chunk_does():
    """FSDP2 cuts dim 0 with torch.chunk and pads every rank to chunk 0's size: ceil(rows / dp)."""
    shapes = [planner.Tensor((3, 5)), planner.Tensor((10,)), planner.Tensor((8, 6), split="cols", group="root")]
    model = planner.Model(sum(math.prod(t.shape) for t in shapes), 1, 8, 8, microbatches=1, shapes=shapes)
    for dp in (1, 2, 4, 16):
        per_rank = sum(torch.chunk(torch.empty(t.rows_cols(2)), dp)[0].numel() for t in shapes)
        assert planner.memory(model, planner.Layout(dp=dp, tp=2, zero=3), (1, 1, 1))["parameters"] == per_rank
    assert planner.fsdp2_shard(model, planner.Layout(dp=4, tp=2), "root") == 2 * 3  # ceil(8 / 4) rows, 6 / 2 columns


def test_planner_within_10_percent_at_1b_on_1024_ranks(runs):
    out, metrics, _ = runs["1b-1024"]
    assert metrics["max_relative_difference"] <= 0.10
    assert metrics["parameters"] > 0.9e9 and metrics["per_rank"]["sent_bytes"]["tp"] > 0
    for group in ("held_bytes", "sent_bytes"):  # the planner's keys, and the same numbers as it gives
        for key, value in metrics["planner"][group].items():
            assert metrics["per_rank"][group][key] == pytest.approx(value, rel=0.10)
    assert "over 10%" not in out and "largest difference from the planner" in out
    assert "7,380,968 bytes of parameters, an even split 7,380,968 (+0.00%)" in out  # every 1b tensor's rows divide by 128


def test_planner_counts_the_padding_of_a_small_model_on_many_ranks(runs):
    """tiny on 256 x 4: most of what rank 0 holds and gathers is padding, and the planner, given
    the shapes, agrees to the byte (it was 689% off when it divided evenly)."""
    out, metrics, _ = runs["tiny-1024"]
    assert metrics["max_relative_difference"] <= 0.10
    assert metrics["per_rank"]["held_bytes"] == metrics["planner"]["held_bytes"]
    held, even = metrics["per_rank"]["held_bytes"]["parameters"], metrics["planner"]["even_held_bytes"]["parameters"]
    assert held > 7 * even and f"holds {held:,} bytes of parameters, an even split {even:,}" in out
    assert "ceil(rows / dp)" in out and "over 10%" not in out


def test_real_gloo_ranks_count_what_the_fake_group_counts(runs):
    out, metrics, _ = runs["real-4"]
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
    import cluster_pictures
    to = tmp_path / "bytes.png"
    assert cluster_pictures.draw([runs["tiny-1024"][2], runs["1b-1024"][2]], to).startswith("wrote")
    assert to.stat().st_size > 10_000


def test_a_mesh_built_inside_fake_tensor_mode_fails(tmp_path):
    """Step 2's rule: the mesh reads numbers out of its tensor of ranks; a fake one has none.
    (A script file, not -c: conftest's run forks it from the test zygote, torch imported.)"""
    script = tmp_path / "mesh_in_fake_mode.py"
    script.write_text("import torch.distributed as dist\n"
                      "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
                      "from torch._subclasses.fake_tensor import FakeTensorMode\n"
                      "dist.init_process_group('fake', rank=0, world_size=4, store=FakeStore())\n"
                      "with FakeTensorMode():\n"
                      "    dist.init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n")
    proc = run([sys.executable, script], check=False, timeout=120)
    assert proc.returncode != 0 and "DataDependentOutputException" in proc.stderr, proc.stderr[-2000:]
