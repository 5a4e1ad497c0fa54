"""The benchmark suite (`make bench`): it runs end to end in --quick mode, its results.json is
well-formed and plausible, and docs/PERFORMANCE.md can be generated from it.

Speedup thresholds (2 ranks >= 1.6x one rank) are not asserted: they depend on the machine
and on what else runs on it. Counts and bytes do not, so those are checked exactly.
"""
import datetime
import json
import math
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ROOT, one_error_line, run

QUICK_TIMEOUT = 240  # a quick run takes well under a minute; more only on a very busy machine
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
               timeout=QUICK_TIMEOUT)
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def check_summary(s: dict, n: int) -> None:
    """A repetition summary: n positive values, min <= median <= max, consistent."""
    assert len(s["values"]) == n, s
    assert all(math.isfinite(v) and v > 0 for v in s["values"]), s
    assert s["min"] == min(s["values"]) and s["max"] == max(s["values"]), s
    assert s["min"] <= s["median"] <= s["max"], s


def greedy_buckets(sizes_in_ready_order: list[int], first: int, cap: int) -> int:
    """DDP's bucket rule, written out independently of bench/ (reducer.cpp,
    compute_bucket_assignment_by_size): add tensors in the order backward makes their
    gradients; close the bucket once it reaches its limit; the first limit is `first`."""
    buckets, size, limit = 0, 0, first
    for nbytes in sizes_in_ready_order:
        size += nbytes
        if size >= limit:
            buckets, size, limit = buckets + 1, 0, cap
    return buckets + (1 if size else 0)


def ring_bytes(size: int, n: int, rank: int) -> tuple[int, int]:
    """Chunk i has size//n floats, plus one for the first size % n chunks. A rank sends all
    chunks but r+1, then all but r+2; it receives all but r, then all but r+1."""
    c = [size // n + (1 if i < size % n else 0) for i in range(n)]
    return (4 * (2 * size - c[(rank + 1) % n] - c[(rank + 2) % n]),
            4 * (2 * size - c[rank] - c[(rank + 1) % n]))


def server_bytes(size: int, n: int, rank: int) -> tuple[int, int]:
    return ((n - 1) * 4 * size,) * 2 if rank == 0 else (4 * size,) * 2


def test_machine_and_settings(quick):
    _, res, _ = quick
    assert res["schema"] == 1 and res["mode"] == "quick"
    m = res["machine"]
    assert m["cpu_count"] == os.cpu_count()
    assert m["torch"] == torch.__version__
    assert m["cpu_model"] and m["platform"] and m["date"]
    assert isinstance(m["gpus"], list)
    assert res["settings"]["reps"] == 3 and res["settings"]["threads_per_rank"] == 1
    assert 0 < res["wall_seconds"] < QUICK_TIMEOUT


def test_scaling_rows_are_plausible(quick):
    _, res, _ = quick
    sec = res["benchmarks"]["scaling"]
    assert sec["strong_scaling"] is True
    rows = {(r["variant"], r["world_size"]): r for r in sec["rows"]}
    assert {("ddp", 1), ("no_ddp", 1), ("ddp", 2)} <= set(rows)
    for r in sec["rows"]:
        check_summary(r["samples_per_s"], 3)
        check_summary(r["step_ms"], 3)
        assert r["threads_per_rank"] == 1
        assert r["per_rank_batch"] * r["world_size"] == sec["config"]["global_batch"]
        assert r["rank_spread"] == 0.0  # DDP keeps every rank's weights identical
        # samples/s and ms/step are two views of the same timings
        sps = r["global_batch"] * 1e3 / r["step_ms"]["median"]
        assert sps == pytest.approx(r["samples_per_s"]["median"], rel=0.05)
    one, two = rows[("ddp", 1)], rows[("ddp", 2)]
    assert one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(
        two["samples_per_s"]["median"] / one["samples_per_s"]["median"], abs=1e-3)
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2, abs=1e-3)
    check = sec["check"]
    assert check["required_speedup"] == 1.6 and check["speedup"] == two["speedup"]
    assert isinstance(check["met"], bool)  # reported, not asserted: it depends on the machine


def test_bucket_counts_follow_ddps_rule(quick):
    _, res, _ = quick
    sec = res["benchmarks"]["bucketing"]
    cfg = sec["config"]
    ready_order = cfg["param_bytes"][::-1]  # an MLP's gradients arrive last layer first
    assert {r["overlap"] for r in sec["rows"]} == {True, False}
    for r in sec["rows"]:
        cap = r["bucket_cap_mb"]
        limit = int((cfg["default_bucket_cap_mb"] if cap is None else cap) * MIB)
        first = cfg["default_first_bucket_bytes"] if cap is None else limit
        want = greedy_buckets(ready_order, first, limit)
        assert r["buckets_expected"] == want, r
        assert r["calls_per_backward"] == want, r  # counted by the comm hook
        if r["bucket_sizes_bytes"] is not None:    # what DDP says about itself
            assert len(r["bucket_sizes_bytes"]) == want
            assert sum(r["bucket_sizes_bytes"]) == sum(cfg["param_bytes"])
        assert r["bytes_per_backward"] == sum(cfg["param_bytes"])
        assert r["rank_spread"] == 0.0  # the deferred hook really all-reduces too
        check_summary(r["samples_per_s"], 3)
    by_cap = [r["calls_per_backward"] for r in sec["rows"] if r["overlap"] and r["bucket_cap_mb"]]
    assert by_cap == sorted(by_cap, reverse=True)  # bigger buckets, fewer calls


def test_allreduce_bytes_match_the_formulas(quick):
    _, res, _ = quick
    rows = res["benchmarks"]["allreduce"]["rows"]
    cfg = res["benchmarks"]["allreduce"]["config"]
    seen = {(r["world_size"], r["size"], r["algorithm"]) for r in rows}
    assert seen == {(n, s, a) for n in cfg["worlds"] for s in cfg["sizes"]
                    for a in ("server", "ring", "dist.all_reduce")}
    assert any(s % n for n in cfg["worlds"] for s in cfg["sizes"])  # unequal ring chunks too
    for r in rows:
        n, size = r["world_size"], r["size"]
        check_summary(r["time_ms"], 3)
        assert r["bytes"] == 4 * size
        algbw = r["bytes"] / (r["time_ms"]["median"] / 1e3) / 1e9
        assert r["algbw_GBps"] == pytest.approx(algbw, rel=1e-3)
        assert r["busbw_GBps"] == pytest.approx(algbw * 2 * (n - 1) / n, rel=1e-3)
        assert r["max_abs_diff"] < 1e-4
        if r["algorithm"] == "dist.all_reduce":
            assert r["busiest_sent"] is None  # gloo's own traffic is not counted
            continue
        formula = server_bytes if r["algorithm"] == "server" else ring_bytes
        assert [(p["sent"], p["received"]) for p in r["per_rank"]] == \
            [formula(size, n, rank) for rank in range(n)]
        assert r["matches_formula"] is True
        assert r["busiest_sent"] == max(formula(size, n, rank)[0] for rank in range(n))


def test_no_sync_saves_calls(quick):
    _, res, _ = quick
    sec = res["benchmarks"]["no_sync"]
    accum = sec["config"]["accum"]
    configs = {r["config"] for r in sec["rows"]}
    assert configs == {"compute-bound", "communication-bound"}
    for config in configs:
        naive, quiet = [next(r for r in sec["rows"] if r["config"] == config and r["method"] == m)
                        for m in ("naive", "no_sync")]
        assert quiet["calls_per_step"] >= 1 and quiet["calls_per_step"] == int(quiet["calls_per_step"])
        assert naive["calls_per_step"] == accum * quiet["calls_per_step"]
        assert naive["bytes_per_step"] == accum * quiet["bytes_per_step"]
        for r in (naive, quiet):
            check_summary(r["step_ms"], 3)
            assert r["rank_spread"] == 0.0
        assert quiet["saved_fraction"] == pytest.approx(
            1 - quiet["step_ms"]["median"] / naive["step_ms"]["median"], abs=1e-3)


def test_gpu_section_says_what_happened(quick):
    _, res, stdout = quick
    gpu = res["benchmarks"]["gpu"]
    if not torch.cuda.is_available():
        assert gpu == {"skipped": "no GPU on this machine"}
        assert "skipped: no GPU on this machine" in stdout  # said plainly, never silently
    else:
        assert gpu["backend"] == "nccl" and gpu["scaling"]


def test_tables_and_plots(quick):
    out, _, stdout = quick
    for title in ("DDP throughput", "DDP bucketing", "All-reduce of S float32", "Gradient accumulation"):
        assert title in stdout
    assert re.search(r"2 ranks vs 1: \d+\.\d\dx \(target 1\.6x", stdout)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "requirements-bench.txt" in stdout
        return
    for name in ("scaling.png", "bucketing.png", "allreduce_time.png", "allreduce_bytes.png",
                 "no_sync.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_doc_is_generated_from_the_json(quick, tmp_path):
    out, res, _ = quick
    doc = tmp_path / "PERFORMANCE.md"
    proc = run([sys.executable, "-m", "bench.run", "--write-doc", "--out", str(out),
                "--doc", str(doc)], timeout=60)
    assert "wrote" in proc.stdout
    text = doc.read_text()
    m = res["machine"]
    assert m["cpu_model"] in text and m["torch"] in text and m["date"] in text
    for heading in ("## The machine", "## Reproduce", "## How the numbers are measured",
                    "## 1. DDP throughput", "## 2. Gradient buckets", "## 3. All-reduce by hand",
                    "## 4. Gradient accumulation", "## 5. GPUs"):
        assert heading in text
    assert "`--quick` run" in text  # a quick run's page says its numbers mean nothing
    check = res["benchmarks"]["scaling"]["check"]
    assert f"{check['speedup']:.2f}x" in text  # the number comes from the JSON
    if not torch.cuda.is_available():
        assert "Skipped: no GPU on this machine" in text
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (doc.parent / link).exists(), link
    assert "None" not in text and "nan" not in text.lower().split()


def test_committed_doc_is_generated():
    doc = ROOT / "docs" / "PERFORMANCE.md"
    assert doc.exists(), "docs/PERFORMANCE.md is missing: run `make bench`"
    text = doc.read_text()
    assert "Generated by `python -m bench.run --write-doc`" in text
    assert "make bench" in text


def test_mistakes_get_one_line():
    line = one_error_line(run([sys.executable, "-m", "bench.run", "--only", "speed"],
                              timeout=60, check=False))
    assert "--only speed" in line and "scaling" in line


# ---------------------------------------------------------------------------------------
# The hand-written hook behind "overlap: no" gives DDP's own gradients
# ---------------------------------------------------------------------------------------

def _compare_hooks(rank: int, port: int) -> None:
    sys.path.insert(0, str(ROOT))
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import measure

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    grads = {}
    for name in ("default", "counting", "deferred"):
        model = measure.deep_mlp(64, 3)
        if name == "default":
            ddp = DDP(model, bucket_cap_mb=0.01)
        else:
            state = measure.HookState(None)
            hook = measure.counting_hook if name == "counting" else measure.deferred_hook
            ddp = measure.wrap_ddp(model, None, torch.device("cpu"), 0.01, hook, state)
        for _ in range(2):  # the second backward uses the rebuilt buckets
            model.zero_grad(set_to_none=True)
            if name != "default":
                state.reset()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        if name != "default":
            assert state.calls == measure.expected_buckets(model, 0.01) > 2
            assert not state.held
        del ddp
    for name in ("counting", "deferred"):
        for a, b in zip(grads[name], grads["default"]):
            torch.testing.assert_close(a, b)
    dist.barrier()
    del model
    import gc
    gc.collect()
    dist.destroy_process_group()


def test_deferred_hook_gives_ddps_gradients():
    from common.distributed import free_port

    ctx = mp.start_processes(_compare_hooks, args=(free_port(),), nprocs=2, join=False,
                             start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=120)
    while not ctx.join(timeout=5):
        if datetime.datetime.now() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 120 s")
