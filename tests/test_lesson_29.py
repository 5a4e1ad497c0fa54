"""Lesson 29: torch.compile with DDP and FSDP2. One run through make, as a learner types it:
the default (DDP, inductor; --steps shortened) with TMPDIR and HOME pointed at empty folders,
which must stay empty; most assertions read its metrics.json. In this process: FSDP2 with each
block compiled against eager (a world of one), the fallback to aot_eager on a machine without
a C++ compiler (the lesson's main() up to its ranks), the helpers (timing in turns, the names of
breaks, the caches' folders), and the claims the lesson and its doc make about torch's source."""
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, max_abs_diff, parse_error, run

STEPS = 6  # rounds of eager and compiled: the first compiles, five are timed
TORCH = Path(torch.__file__).parent


def make_lesson(folder: Path, args: str, env: dict, timeout: float = 1200):
    """`make -s lesson-29 ARGS=...`, a new Python (make is not forked from the test zygote): a
    cold compile on a busy machine takes minutes, a warm one (runs/.torchinductor) seconds."""
    return run(["make", "-s", "lesson-29", f"ARGS={args} --out {folder}"], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    folder, tmp, home = (tmp_path_factory.mktemp(name) for name in ("lesson29", "tmp", "home"))
    proc = make_lesson(folder, f"--steps {STEPS}", {"TMPDIR": str(tmp), "HOME": str(home)})
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics, tmp, home


def test_compiled_weights_equal_eager_weights(ddp_run):
    out, state, metrics = ddp_run[:3]
    assert (metrics["wrap"], metrics["compile"], metrics["region"]) == ("ddp", "inductor", "block")
    assert metrics["max_abs_diff_vs_eager"] <= 1e-5 and metrics["max_loss_diff_vs_eager"] <= 1e-5
    assert f"max |w_compiled - w_eager| = {metrics['max_abs_diff_vs_eager']:.1e} (allowed 1e-05)" in out
    assert state.keys() == T.make_model().state_dict().keys()  # no _orig_mod. or module. prefix
    assert len(metrics["losses"]) == STEPS and metrics["losses"][-1] < metrics["losses"][0]


def test_metrics_has_the_issues_keys_measured(ddp_run):
    out, _, metrics = ddp_run[:3]
    assert metrics["graph_breaks"] == 0 and metrics["recompiles"] == 0  # lesson 13's model: one graph
    assert [g["calls"] for g in metrics["graphs"]] == [20]  # Block.forward, shared by both blocks
    assert metrics["graphs"][0]["first_input"] == "norm1.weight"
    assert metrics["compile_seconds"] > 0 and metrics["compile_cache"]["state"] in ("cold", "warm", "partly warm")
    for name in ("eager", "compiled"):
        times = metrics["step_seconds_all"][name]
        assert len(times) == STEPS and metrics[f"step_seconds_{name}"] == pytest.approx(sorted(times[1:])[2])
    assert metrics["step_seconds_all"]["compiled"][0] > metrics["compile_seconds"]  # the compile is in step 1
    ratio = metrics["compiled_over_eager"]
    assert ratio["q1"] <= ratio["median"] <= ratio["q3"] and ratio["n"] == STEPS - 1
    verdict = re.search(r"compiled / eager, round by round: median ([\d.]+) \(middle half ([\d.]+)-([\d.]+)\): (.+)", out)
    assert verdict and float(verdict[1]) == pytest.approx(ratio["median"], abs=0.006), out
    expected = "faster" if ratio["q3"] < 1 else "slower" if ratio["q1"] > 1 else "no clear difference"
    assert verdict[4].startswith(expected)  # said as measured, whichever way it went
    assert re.search(r"load average [\d.]+ before, [\d.]+ after, on \d+ cores", out)


def test_a_run_leaves_nothing_in_tmpdir_or_home(ddp_run):
    """The caches went to runs/.torchinductor, TMPDIR's too (precompiled headers, gcc's files)."""
    _, _, metrics, tmp, home = ddp_run
    assert not list(tmp.iterdir()), [p.name for p in tmp.iterdir()]
    assert not list(home.iterdir()), [p.name for p in home.iterdir()]
    cache = ROOT / "runs" / ".torchinductor"
    assert metrics["compile_cache"]["misses"] == 0 or any(cache.rglob("*.so"))  # what it compiled is there


def test_a_new_shape_recompiles_once_and_mark_dynamic_avoids_it(ddp_run):
    out, _, metrics = ddp_run[:3]
    plain, marked = metrics["new_shape"]["plain"], metrics["new_shape"]["mark_dynamic"]
    assert (plain["graphs"], plain["recompiles"]) == (2, 1)  # 24 rows, 16 (recompiled, dynamic), 8 (no)
    assert plain["reasons"] == ["tensor 'x' size mismatch at index 0. expected 24, actual 16"]
    assert (marked["graphs"], marked["recompiles"]) == (1, 0)
    assert "batches of 24, 16, 8 rows: 2 graphs, 1 recompile (tensor 'x' size mismatch" in out


def test_the_bucket_trap_is_one_explained_line(ddp_run):
    out, _, metrics = ddp_run[:3]
    small, big = metrics["bucket_trap"]
    assert small["error"] == ("AssertionError: First bucket should be smaller/equal to other buckets "
                              "to get comms warmed up ASAP")
    assert small["bucket_cap_bytes"] == int(0.1 * 2**20) and small["first_bucket_bytes_dynamo"] == 2**20
    assert big["cap_mb"] == 1.0 and big["error"] is None
    assert f"first forward: {small['error']}" in out and "Traceback" not in out
    assert "DDP(bucket_cap_mb=1): no error" in out


def test_ddp_optimizer_cuts_the_graph_where_buckets_fill(ddp_run):
    """Every parameter in one piece, in reverse order; each piece but the first (in forward
    order, the last one filled) holds at least a bucket's bytes."""
    _, state, metrics = ddp_run[:3]
    pieces = metrics["ddp_pieces"]
    names = [name for piece in pieces for name in piece["params"]]
    assert sorted(names) == sorted(state) and len(pieces) == 4
    assert sum(p["bytes"] for p in pieces) == 4 * sum(t.numel() for t in state.values())
    assert all(p["bytes"] >= 0.1 * 2**20 for p in pieces[1:])
    assert pieces[-1]["params"][:2] == ["head.weight", "head.bias"]  # backward's first bucket


def test_fsdp_whole_model_skips_its_forward_at_the_hooks(ddp_run):
    out, _, metrics = ddp_run[:3]
    block, whole = metrics["fsdp"]["block"], metrics["fsdp"]["model"]
    assert block == {"graphs": 1, "breaks": []}
    assert whole["graphs"] == 1 and len(whole["breaks"]) == 1
    skip = whole["breaks"][0]
    assert (skip["kind"], skip["reason"], skip["then"]) == ("skipped frame", "skipping FSDP hooks", "graph break in loop")
    assert skip["skipped"] == "forward (transformer.py line 119)"
    source = Path(T.__file__).read_text().splitlines()
    assert source[118].strip().startswith("def forward(")  # line 119: Transformer.forward, the frame
    assert [s for s in source[:118] if s.startswith("class ")][-1].startswith("class Transformer")  # dynamo gave up on
    assert "dynamo gave up on forward (transformer.py line 119), which runs eagerly" in out
    assert "not run here" in out  # SimpleFSDP


def test_prints_its_own_steps_in_order(ddp_run):
    out = ddp_run[0]
    marked = re.findall(r"^\s*# Step (\d+): (.+?)\s*$", (ROOT / "lessons" / "29_compile.py").read_text(), re.M)
    printed = re.findall(r"^Step (\d+): (.+?)\s*$", out, re.M)
    assert printed == marked and [int(n) for n, _ in printed] == list(range(1, len(marked) + 1))


def test_without_a_cxx_compiler_it_says_so_and_uses_aot_eager(tmp_path, monkeypatch, capsys):
    """main() up to its ranks, with inductor's compiler search pointed at no compiler (as CXX
    naming none does): one line says so, and the ranks are started with aot_eager."""
    import tempfile

    module = import_lesson("29")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # main() sets them; restored after
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, "/nonexistent/g++"))
    started = []
    monkeypatch.setattr(module, "spawn", lambda worker, args, world: started.append(args[1]))
    monkeypatch.setattr(sys, "argv", ["29_compile.py", "--wrap", "fsdp", "--out", str(tmp_path / "out")])
    module.main()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "C++ compiler" in line and not line.startswith("Step 1:")]
    assert lines == ["no C++ compiler found ($CXX, else g++; clang++ on macOS): inductor cannot build CPU "
                     "kernels here, so this run compiles with aot_eager (install g++ to use inductor)"]
    assert [(args.wrap, args.compile) for args in started] == [("fsdp", "aot_eager")]


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # our logits are a view, as in lesson 15
def test_fsdp_with_each_block_compiled_equals_eager():
    """Lesson 29's own wrap, compile_model and full_state, FSDP2 on a world of one, aot_eager:
    three steps of each model on the same batches, the weights gathered and compared."""
    import torch.distributed as dist

    module = import_lesson("29")
    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = dist.init_device_mesh("cpu", (1,))
        models = {}
        for name in ("eager", "compiled"):
            model = T.make_model()
            forward = module.wrap(model, "fsdp", mesh, torch.device("cpu"))
            if name == "compiled":
                forward = module.compile_model(forward, model, "aot_eager", "block")
            models[name] = (model, forward, T.make_optimizer(model))
        for step in range(3):
            x, y = T.batch(step, T.SEED)
            for model, forward, optimizer in models.values():
                loss = T.loss_fn(forward(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        states = {name: module.full_state(model, "fsdp") for name, (model, _, _) in models.items()}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert states["eager"].keys() == T.make_model().state_dict().keys()
    assert max_abs_diff(states["compiled"], states["eager"]) <= 1e-5
    assert max_abs_diff(states["eager"], T.make_model().state_dict()) > 1e-3  # it trained


# --- in this process ---------------------------------------------------------------------

def test_turns_alternate_and_the_spread_is_read_from_the_numbers():
    import compile_timing

    assert [compile_timing.turn(s) for s in range(3)] == [("eager", "compiled"), ("compiled", "eager"),
                                                           ("eager", "compiled")]
    s = compile_timing.spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"]) == (3.0, 2.0, 4.0, 1.0, 5.0)
    assert compile_timing.ratios([1.0, 3.0], [2.0, 2.0])["median"] == 1.0
    assert compile_timing.payback(10.0, 0.3, 0.2) == pytest.approx(100.0)
    assert compile_timing.payback(10.0, 0.2, 0.3) is None  # slower: never


def test_graph_inputs_and_breaks_are_named():
    from collections import Counter

    import graph_census

    assert graph_census.nice_name("L_self_modules_blocks_modules_0_modules_attn_modules_q_parameters_weight_") \
        == "blocks.0.attn.q.weight"
    assert graph_census.nice_name("L_self_modules_tok_emb_parameters_weight_") == "tok_emb.weight"
    assert graph_census.nice_name("l_x_") == "x"
    message = ("Call to `torch._dynamo.disable()`\n  Explanation: called inside a compiled region.\n  Developer debug context: Called "
               "`torch._dynamo.disable()` with args `[...]`, kwargs `{'recursive': ConstantVariable(bool: True), "
               "'reason': ConstantVariable(str: 'skipping FSDP hooks')}`")
    counters = {"graph_break": Counter(), "unimplemented": Counter({
        message: 1, message + "\n\n*** While handling this graph break, another graph break occurred: ***\n\n"
        "graph break in loop\n  Developer debug context: frame skipped: forward (/x/common/transformer.py line 119)": 1})}
    assert graph_census.named_breaks(counters) == [{
        "kind": "skipped frame", "what": "Call to `torch._dynamo.disable()`", "explanation": "called inside a compiled region.",
        "reason": "skipping FSDP hooks",
        "then": "graph break in loop", "skipped": "forward (transformer.py line 119)"}]


def test_graph_breaks_and_recompiles_are_counted_by_dynamo():
    """A graph break (print) and a recompile (a new shape), seen in dynamo's own books."""
    import graph_census
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = graph_census.Counted("eager")

    def noisy(x):
        x = x * 2
        print("a graph break")
        return x + 1

    compiled = torch.compile(noisy, backend=backend)
    compiled(torch.ones(3))
    compiled(torch.ones(4))
    breaks = graph_census.named_breaks(counters)
    assert [b["kind"] for b in breaks] == ["break"] and "`print`" in breaks[0]["explanation"]
    assert set(graph_census.recompile_reasons()) == {"tensor 'x' size mismatch at index 0. expected 3, actual 4"}
    assert len(backend.graphs) == 4  # 2 graphs (before and after the print) for each shape
    torch._dynamo.reset()


def test_caches_and_tmpdir_go_where_the_lesson_says(tmp_path, monkeypatch):
    import tempfile

    import compile_setup

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    cold = tmp_path / "cold-cache"
    (cold / "old").mkdir(parents=True)
    assert compile_setup.keep_caches(cold) == cold and not (cold / "old").exists()  # emptied
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cold) and os.environ["TMPDIR"] == str(cold / "tmp")
    assert tempfile.gettempdir() == str(cold / "tmp")
    assert compile_setup.folder_size(cold) == (0, 0)


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    module = import_lesson("29")
    for flags, expect in ((["--compile", "tvm"], "--compile"), (["--wrap", "zero1"], "--wrap"),
                          (["--region", "layer"], "--region"), (["--steps", "0"], "--steps")):
        assert expect in parse_error(module, flags, monkeypatch, capsys)
    line = parse_error(module, ["--world-size", "5"], monkeypatch, capsys)
    assert line.startswith("error: --world-size must divide the global batch of 48 rows"), line


# --- what the lesson and its doc say about torch's source ------------------------------------

def test_the_trap_is_where_the_lesson_says_in_the_pinned_source():
    """DDPOptimizer asserts first <= cap; convert_frame builds it without first_bucket_cap, so
    the first cap is _DEFAULT_FIRST_BUCKET_BYTES (1 MiB); DDP given bucket_cap_mb uses the cap."""
    import torch.distributed as dist

    distributed = (TORCH / "_dynamo" / "backends" / "distributed.py").read_text().splitlines()
    assert "First bucket should be smaller/equal to other buckets" in distributed[466]  # line 467
    assert distributed[464].strip() == "if self.first_bucket_cap > self.bucket_bytes_cap:"  # line 465
    convert = (TORCH / "_dynamo" / "convert_frame.py").read_text()
    call = convert[convert.index("ddp_optimizer = DDPOptimizer("):]
    assert "bucket_bytes_cap=ddp_module.bucket_bytes_cap" in call[:300] and "first_bucket_cap" not in call[:300]
    assert convert.splitlines()[2626].strip() == "ddp_optimizer = DDPOptimizer("  # line 2627
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    ddp = (TORCH / "nn" / "parallel" / "distributed.py").read_text().splitlines()
    assert "dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap" in ddp[108]  # line 109
    assert torch._dynamo.config.optimize_ddp is True


def test_the_hooks_and_the_header_folder_are_where_the_lesson_says():
    common = (TORCH / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_common.py").read_text()
    assert 'func, recursive=True, reason="skipping FSDP hooks"' in common
    codecache = (TORCH / "_inductor" / "codecache.py").read_text().splitlines()
    assert codecache[3681] == '_HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")'  # line 3682
    from torch._inductor.runtime import cache_dir_utils
    assert "TORCHINDUCTOR_CACHE_DIR" not in cache_dir_utils.default_cache_dir.__code__.co_consts
