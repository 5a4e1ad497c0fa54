"""The benchmark suite (`make bench`): it runs end to end in --quick mode, its results.json is
well-formed and plausible, and docs/PERFORMANCE.md can be generated from it.

Speedup thresholds (2 ranks >= 1.6x one rank) are not asserted: they depend on the machine
and on what else runs on it. Counts and bytes do not, so those are checked exactly.
"""
import json
import math
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

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
        if r["variant"] == "ddp":
            assert r["threads_per_rank"] == 1
        assert r["per_rank_batch"] * r["world_size"] == sec["config"]["global_batch"]
        assert r["rank_spread"] == 0.0  # DDP keeps every rank's weights identical
        # samples/s and ms/step are two views of the same timings
        sps = r["global_batch"] * 1e3 / r["step_ms"]["median"]
        assert sps == pytest.approx(r["samples_per_s"]["median"], rel=0.05)
    # one process on 1 thread, and on as many threads as each larger world has ranks
    plain = sorted(r["threads_per_rank"] for r in sec["rows"] if r["variant"] == "no_ddp")
    assert plain == [1] + [n for n in sec["config"]["worlds"] if n > 1]
    one, two = rows[("ddp", 1)], rows[("ddp", 2)]
    assert "speedup_vs_same_cores" in two
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
        # the two were timed in turn: A B, B A, A B (each repetition's place in the order run)
        assert naive["timed_in_turn"] == [0, 3, 4] and quiet["timed_in_turn"] == [1, 2, 5]
    # so were the bucket settings: one repetition of each per round, every round complete
    rows = res["benchmarks"]["bucketing"]["rows"]
    places = sorted(p for r in rows for p in r["timed_in_turn"])
    assert places == list(range(3 * len(rows)))
    assert all(r * len(rows) <= p < (r + 1) * len(rows)
               for row in rows for r, p in enumerate(row["timed_in_turn"]))


def test_methods_are_timed_in_turn():
    """in_turn() runs one repetition of each method per round, the order reversed every other
    round, and gives each method its own clock readings (a fake clock records the calls)."""
    from bench import measure

    ran = []
    windows = {"naive": lambda: ran.append("naive"), "no_sync": lambda: ran.append("no_sync")}

    def clock(window):  # a fake timer: runs the window, reads 1.0, 2.0, 3.0, ...
        window()
        return float(len(ran))

    got = measure.in_turn(windows, 4, clock)
    assert ran == ["naive", "no_sync", "no_sync", "naive", "naive", "no_sync", "no_sync", "naive"]
    assert got.times == {"naive": [1.0, 4.0, 5.0, 8.0], "no_sync": [2.0, 3.0, 6.0, 7.0]}
    assert got.places == {"naive": [0, 3, 4, 7], "no_sync": [1, 2, 5, 6]}
    ran.clear()
    three = {k: (lambda k=k: ran.append(k)) for k in "abc"}
    measure.in_turn(three, 2, clock)
    assert ran == ["a", "b", "c", "c", "b", "a"]


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
    from bench import doc as bench_doc

    for path in (ROOT / "docs" / "PERFORMANCE.md", ROOT / "docs" / "zh" / "PERFORMANCE.md"):
        assert path.exists(), f"{path} is missing: run `make bench-docs`"
        text = path.read_text()
        assert bench_doc.GENERATED in text
        assert "make bench" in text


def test_a_learners_run_writes_under_runs_only(quick, tmp_path):
    """--write-doc without --publish: both pages beside results.json, docs/ untouched."""
    out, _, _ = quick
    committed = [ROOT / "docs" / "PERFORMANCE.md", ROOT / "docs" / "zh" / "PERFORMANCE.md",
                 *sorted((ROOT / "docs" / "img" / "bench").glob("*.png"))]
    before = {p: p.stat().st_mtime_ns for p in committed if p.exists()}
    proc = run([sys.executable, "-m", "bench.run", "--write-doc", "--out", str(out)], timeout=60)
    assert (out / "PERFORMANCE.md").exists() and (out / "zh" / "PERFORMANCE.md").exists()
    assert "docs/" not in proc.stdout
    assert before == {p: p.stat().st_mtime_ns for p in before}


def test_publish_without_matplotlib_refuses_and_keeps_the_plots(quick, tmp_path, monkeypatch, capsys):
    """The committed page is only rewritten when every plot can be redrawn."""
    out, _, _ = quick
    # --publish with --quick is refused before matplotlib is looked for: a forked command
    line = one_error_line(run([sys.executable, "-m", "bench.run", "--publish", "--quick"],
                              timeout=60, check=False))
    assert "--publish" in line and "--quick" in line  # a full run only
    # Without matplotlib: bench.run's main() in this process, where `import matplotlib` fails
    # (sys.modules[name] = None), instead of a new Python with a fake matplotlib on
    # PYTHONPATH (about 5 CPU s of imports: PYTHONPATH rules out the zygote)
    from bench import run as bench_run
    docs = tmp_path / "docs"
    (docs / "img" / "bench").mkdir(parents=True)
    plot = docs / "img" / "bench" / "scaling.png"
    plot.write_bytes(b"\x89PNG committed")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sys, "argv", ["bench.run", "--publish", "--write-doc", "--out", str(out),
                                      "--doc", str(docs / "PERFORMANCE.md")])
    with pytest.raises(SystemExit) as exit_info:
        bench_run.main()
    assert exit_info.value.code not in (0, None)
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.out + captured.err, captured
    assert "matplotlib" in lines[0] and "requirements-bench.txt" in lines[0]
    assert plot.read_bytes() == b"\x89PNG committed"
    assert not (docs / "PERFORMANCE.md").exists() and not (docs / "zh").exists()


def test_mistakes_get_one_line():
    line = one_error_line(run([sys.executable, "-m", "bench.run", "--only", "speed"],
                              timeout=60, check=False))
    assert "--only speed" in line and "scaling" in line


# ---------------------------------------------------------------------------------------
# The hand-written hook behind "overlap: no" gives DDP's own gradients
# ---------------------------------------------------------------------------------------

def _compare_hooks(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from apparatus.comm import CommLog
    from bench import measure

    g = torch.Generator().manual_seed(rank)  # each rank its own data
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    grads = {}
    for name in ("default", "counting", "deferred"):
        model = measure.deep_mlp(64, 3)
        if name == "default":
            ddp = DDP(model, bucket_cap_mb=0.01)
        elif name == "counting":  # PyTorch's allreduce_hook, counted by apparatus/comm.py
            ddp = measure.wrap_counted(model, None, 0.01)
        else:
            state = measure.HookState(None)
            ddp = measure.wrap_ddp(model, None, torch.device("cpu"), 0.01, measure.deferred_hook,
                                   state)
        for _ in range(2):  # the second backward uses the rebuilt buckets
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            log = CommLog()
            with log.recording():  # backward only: the second forward broadcasts the new buckets
                loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        # one all-reduce per bucket, each counted by CommLog: through a Python hook, or from
        # DDP's C++ reducer (default), whose calls pass the dispatcher too
        assert [c.kind for c in log.calls] == ["all_reduce"] * measure.expected_buckets(model, 0.01)
        assert measure.expected_buckets(model, 0.01) > 2
        if name == "deferred":
            assert not state.held
        del ddp
    for name in ("counting", "deferred"):
        for a, b in zip(grads[name], grads["default"]):
            torch.testing.assert_close(a, b)
    dist.barrier()
    del model


def test_deferred_hook_gives_ddps_gradients():
    from common.distributed import run_ranks

    run_ranks(_compare_hooks, 2, timeout_s=120, group_timeout_s=60)  # raises if a rank fails


# ---------------------------------------------------------------------------------------
# Every interpretive sentence of PERFORMANCE.md follows the data: fabricated results that
# flip a conclusion must flip the sentence (in English and in Chinese)
# ---------------------------------------------------------------------------------------

def stat(median: float, spread: float = 0.02) -> dict:
    lo, hi = median * (1 - spread), median * (1 + spread)
    return {"values": [lo, median, hi], "median": median, "min": lo, "max": hi}


def scaling_rows(one: float, same_cores: float, ddp: dict[int, float]) -> list[dict]:
    rows = [{"variant": "no_ddp", "world_size": 1, "threads_per_rank": 1, "samples_per_s": stat(one)},
            {"variant": "no_ddp", "world_size": 1, "threads_per_rank": 2,
             "samples_per_s": stat(same_cores)}]
    for n, sps in ddp.items():
        rows.append({"variant": "ddp", "world_size": n, "threads_per_rank": 1,
                     "samples_per_s": stat(sps)})
    from bench.run import derive_scaling
    derive_scaling(rows, cpus=8, threads=1)
    return rows


def both(fn, *args) -> tuple[str, str]:
    """fn's sentences in English and in Chinese."""
    from bench.words import LANG
    out = []
    for lang in ("en", "zh"):
        LANG.current = lang
        try:
            out.append(" ".join(fn(*args)))
        finally:
            LANG.current = "en"
    return out[0], out[1]


def test_scaling_sentences_follow_the_data():
    from bench import doc
    m = {"cpu_count": 8}
    # 2 ranks beat one process on the same 2 cores, and vice versa
    rows = scaling_rows(100, 150, {1: 100, 2: 190})
    en, zh = both(doc.scaling_lines, {"rows": rows}, m)
    assert "splitting the batch between processes used the cores better" in en
    assert "把批次分给多个进程" in zh
    rows = scaling_rows(100, 250, {1: 100, 2: 190})
    en, zh = both(doc.scaling_lines, {"rows": rows}, m)
    assert "one process's own threads used the same cores better" in en
    assert "一个进程用自己的线程更好地利用了同样的核心" in zh
    rows = scaling_rows(100, 190, {1: 100, 2: 190})
    en, _ = both(doc.scaling_lines, {"rows": rows}, m)
    assert "did no better and no worse" in en
    # only N = 1, 2 measured: no claim about a trend in N
    rows = scaling_rows(100, 190, {1: 100, 2: 160})
    en, zh = both(doc.scaling_lines, {"rows": rows}, m)
    assert "cannot say how efficiency changes as N grows" in en and "fell as N grew" not in en
    assert "无法说明效率如何随 N 变化" in zh
    assert "Why it falls short of 100%" in en
    # N = 2 and 4 measured, efficiency falling: now the trend is stated
    rows = scaling_rows(100, 190, {1: 100, 2: 180, 4: 300})
    en, zh = both(doc.scaling_lines, {"rows": rows}, m)
    assert "fell as N grew" in en and "随着 N 增大而下降" in zh
    # perfect scaling: no "falls short" explanation
    rows = scaling_rows(100, 190, {1: 100, 2: 200})
    en, _ = both(doc.scaling_lines, {"rows": rows}, m)
    assert "not below 100%" in en and "falls short" not in en


def bucket_section(speeds: dict, deferred: dict) -> dict:
    """speeds: cap -> (calls, samples/s) with overlap; deferred: cap -> (calls, samples/s)."""
    rows = [{"bucket_cap_mb": cap, "overlap": True, "calls_per_backward": k,
             "buckets_expected": k, "samples_per_s": stat(s)} for cap, (k, s) in speeds.items()]
    rows += [{"bucket_cap_mb": cap, "overlap": False, "calls_per_backward": k,
              "buckets_expected": k, "samples_per_s": stat(s)} for cap, (k, s) in deferred.items()]
    return {"config": {"default_first_bucket_bytes": MIB, "default_bucket_cap_mb": 25},
            "rows": rows}


def test_bucket_sentences_follow_the_data():
    from bench import doc
    tiny_slow = bucket_section({0.001: (19, 80), 1.0: (9, 110), 100.0: (1, 105)},
                               {1.0: (9, 90)})
    en, zh = both(doc.bucket_lines, tiny_slow)
    assert "tiny buckets pay the fixed cost" in en and "one huge bucket" not in en
    assert "很小的桶" in zh
    assert "overlap paid for every bucket size" in en and "重叠都带来了收益" in zh
    huge_slow = bucket_section({0.001: (19, 110), 1.0: (9, 108), 100.0: (1, 80)},
                               {1.0: (9, 108)})
    en, zh = both(doc.bucket_lines, huge_slow)
    assert "one huge bucket cannot start" in en and "tiny buckets" not in en
    assert "一个巨大的桶" in zh
    assert "gained nothing measurable" in en and "gloo's adding" in en
    same = bucket_section({0.001: (19, 100), 1.0: (9, 101), 100.0: (1, 99)}, {100.0: (1, 200)})
    en, _ = both(doc.bucket_lines, same)
    assert "made no measurable difference" in en
    # one bucket: nothing can overlap either way, so the pair is no evidence at all
    assert "only shows the run-to-run noise" in en and "overlap paid" not in en
    assert "gained nothing" not in en
    en, _ = both(doc.bucket_lines, same, True)  # on GPUs: no CPU explanation
    assert "gloo's adding" not in en


def test_no_sync_and_allreduce_sentences_follow_the_data():
    from bench import doc

    def no_sync(comm: tuple, compute: tuple) -> dict:
        rows = []
        for config, (naive, quiet) in (("communication-bound", comm), ("compute-bound", compute)):
            rows += [{"config": config, "method": "naive", "calls_per_step": 4,
                      "step_ms": stat(naive)},
                     {"config": config, "method": "no_sync", "calls_per_step": 1,
                      "step_ms": stat(quiet), "saved_fraction": 1 - quiet / naive}]
        return {"config": {"accum": 4}, "rows": rows}

    en, zh = both(doc.no_sync_lines, no_sync((10, 4), (100, 80)))
    assert "follows communication's share" in en and "取决于通信在一步中所占的比例" in zh
    en, zh = both(doc.no_sync_lines, no_sync((10, 8), (100, 50)))
    assert "does not show the saving following" in en and "没有显示出" in zh
    # no_sync slower on the wide model, beyond the spread: the words follow the sign
    en, zh = both(doc.no_sync_lines, no_sync((10, 5), (141, 181)))
    assert "cost 28% more time" in en and "多花了 28%" in zh
    assert "saved -" not in en and "-28%" not in en and "省下了 -" not in zh
    assert "does not explain" in en and "重新运行" in zh


def test_no_sync_saving_follows_the_sign():
    """The sentence for no_sync's effect: saved, cost more, or no difference within the
    repetitions' spread (the noise), in English and in Chinese."""
    from bench import doc
    from bench.words import LANG

    def words(naive: dict, quiet: dict) -> tuple[str, str]:
        out = []
        for lang in ("en", "zh"):
            LANG.current = lang
            try:
                out.append(doc.saving(*doc.saving_range({"step_ms": naive}, {"step_ms": quiet})))
            finally:
                LANG.current = "en"
        return out[0], out[1]

    assert words(stat(100), stat(50)) == ("saved 50% of the time", "省下了 50% 的时间")
    assert words(stat(141), stat(181)) == ("cost 28% more time", "反而多花了 28% 的时间")
    en, zh = words(stat(100, spread=0.1), stat(95, spread=0.1))  # spreads overlap: noise
    assert en == "made no measurable difference (the medians differ by 5%, inside the repetitions' spread)"
    assert zh.startswith("没有带来可测量的差别") and "5%" in zh
    en, _ = words(stat(100, spread=0.1), stat(105, spread=0.1))  # slower, within the noise
    assert en.startswith("made no measurable difference") and "more" not in en
    # the saving's range: least and most it could have been over the repetitions
    f, lo, hi = doc.saving_range({"step_ms": stat(100)}, {"step_ms": stat(50)})
    assert f == pytest.approx(0.5) and lo == pytest.approx(1 - 51 / 98) and hi == pytest.approx(1 - 49 / 102)
    from bench.report import time_change
    assert (time_change(0.51), time_change(-0.28), time_change(0.0), time_change(None)) == \
        ("-51%", "+28%", "+0%", "-")

    def allreduce(ring_ms: float, server_small: float) -> dict:
        rows = []
        for size in (1_000, 1_000_000):
            for algo in ("server", "ring", "dist.all_reduce"):
                ms = {"server": server_small if size == 1_000 else 10.0,
                      "ring": 5.0 if size == 1_000 else ring_ms,
                      "dist.all_reduce": 4.0 if size == 1_000 else 9.0}[algo]
                per = None if algo == "dist.all_reduce" else [
                    {"rank": r, "sent": b, "received": b}
                    for r, b in enumerate(((server_bytes if algo == "server" else ring_bytes)
                                           (size, 2, r)[0] for r in range(2)))]
                rows.append({"world_size": 2, "size": size, "algorithm": algo,
                             "time_ms": stat(ms), "per_rank": per,
                             "busiest_sent": None if per is None else max(p["sent"] for p in per),
                             "matches_formula": None if per is None else True})
        return {"rows": rows}

    en, zh = both(doc.allreduce_lines, allreduce(5.0, 1.0), {"cpu_count": 8})
    assert "that showed in the time" in en and "体现在了耗时上" in zh
    assert "the server beat the ring beyond the spread" in en
    en, zh = both(doc.allreduce_lines, allreduce(12.0, 4.0), {"cpu_count": 8})
    assert "the bytes matter less" in en and "字节数不如跨网络时重要" in zh
    assert "gloo's own all-reduce won" not in en  # 4.0 vs the server's 4.0: within the spread


# ---------------------------------------------------------------------------------------
# Part 2: FSDP2 vs DDP, tensor parallel, pipeline schedules (bench/sharded_transformer.py)
# ---------------------------------------------------------------------------------------

def test_sharded_transformer_measures_bytes_exactly(quick):
    """Counts and bytes do not depend on the machine: DDP on 2 ranks sends 2(N-1)/N of the
    gradients = their bytes once; ZeRO-3 1.5x that; ZeRO-2-like as DDP; FSDP2 halves what a
    rank holds (the recipe's dims are even: no padding)."""
    out, res, stdout = quick
    b = res["benchmarks"]
    params = b["fsdp"]["model"]["params"] * 4
    rows = {(r["strategy"], r["world_size"]): r for r in b["fsdp"]["rows"]}
    assert set(rows) == {(s, n) for s in ("ddp", "fsdp-zero3", "fsdp-zero2") for n in (1, 2)}
    for r in rows.values():
        check_summary(r["sequences_per_s"], 3)
    assert rows["ddp", 2]["sent_bytes_per_step"] == params
    # ZeRO-3: the blocks' parameters gathered twice (forward, backward) and their gradients
    # reduce-scattered, 1.5x their bytes on 2 ranks; the root at its default, not resharded
    # after forward: gathered once, 1x (lesson 15)
    from common import transformer as T
    blocks = sum(p.numel() for p in T.make_model(T.SEED).blocks.parameters()) * 4
    assert rows["fsdp-zero3", 2]["sent_bytes_per_step"] == 1.5 * blocks + (params - blocks)
    assert rows["fsdp-zero2", 2]["sent_bytes_per_step"] == params
    for s in ("ddp", "fsdp-zero3", "fsdp-zero2"):
        assert rows[s, 1]["sent_bytes_per_step"] == 0  # a world of one sends nothing
        assert rows[s, 1]["held_bytes"] == {"parameters": params, "gradients": params,
                                            "optimizer_state": 2 * params}
    assert rows["fsdp-zero3", 2]["held_bytes"] == {"parameters": params // 2, "gradients": params // 2,
                                                   "optimizer_state": params}
    tp = b["tp"]["rows"]
    assert tp and all(r["block_sent_bytes"] > 0 and r["step_calls"] > 0 for r in tp)
    # lesson 17's count: per block 2 collectives' worth of one (batch, seq, dim) activation
    # each way, by hand and with sequence parallel alike (786,432 bytes on 2 ranks)
    activation = T.GLOBAL_BATCH * T.SEQ * T.DIM * 4
    for r in tp:
        sent = r["block_sent_bytes_by_phase"]
        assert sent["forward"] == sent["backward"] == 2 * activation == 786_432, r
        if r["impl"] == "manual" and r["sequence_parallel"]:  # the sum of lesson 17's Step 4
            assert r["block_after_in"] == ["between"] and r["block_calls"]["after"]["all_reduce"] > 0
    check_summary(b["tp"]["plain_step_ms"], 3)
    pipe = {r["schedule"]: r for r in b["pipeline"]["rows"]}
    assert pipe["gpipe"]["predicted_idle"] == pipe["gpipe"]["formula_idle"] == 0.2  # (2-1)/(4+2-1)
    assert pipe["zero-bubble"]["predicted_idle"] < pipe["gpipe"]["predicted_idle"]
    assert "FSDP2 vs DDP on the transformer" in stdout and "Pipeline schedules on 2 ranks" in stdout


def test_sharded_transformer_sections_on_the_page(quick, tmp_path):
    from bench import doc as bench_doc

    out, _, _ = quick
    doc = tmp_path / "PERFORMANCE.md"  # in this process: --write-doc is tested above
    bench_doc.write_doc(out / "results.json", doc, tmp_path / "img")
    en, zh = doc.read_text(), (tmp_path / "zh" / "PERFORMANCE.md").read_text()
    for heading in ("## 6. FSDP2 vs DDP", "## 7. Tensor parallel", "## 8. Pipeline schedules"):
        assert heading in en
    assert "## 6. Transformer 上的 FSDP2 与 DDP" in zh and "## 8. 流水线调度" in zh
    table = lambda t: [line for line in t.splitlines() if line.startswith("|")]  # noqa: E731
    assert table(en) == table(zh)


def fsdp_sec(ddp: tuple, z3: tuple, z2_sent: float, ddp1: float = 100.0) -> dict:
    """ddp, z3: (sequences/s, bytes sent, bytes held) on 2 ranks."""
    def row(strategy, n, sps, sent, held):
        return {"strategy": strategy, "world_size": n, "sequences_per_s": stat(sps),
                "sent_bytes_per_step": sent,
                "held_bytes": {"parameters": held, "gradients": held, "optimizer_state": 2 * held}}
    return {"rows": [row("ddp", 1, ddp1, 0, 400), row("ddp", 2, *ddp), row("fsdp-zero3", 2, *z3),
                     row("fsdp-zero2", 2, z3[0], z2_sent, z3[2])]}


def test_sharded_transformer_fsdp_sentences_follow_the_data():
    from bench import sharded_transformer
    en, zh = both(sharded_transformer.fsdp_lines, fsdp_sec((180, 400, 400), (80, 600, 200), 400))
    assert "held 50% of what a DDP rank" in en and "按秩切分" in zh
    assert "sent 1.50x DDP's bytes" in en and "1.50 倍" in zh
    assert "sent 33% less than ZeRO-3" in en and "少发送 33%" in zh
    assert "cost more than sharding saves" in en and "FSDP 才划算" in zh
    assert "1.80x the sequences/s" in en
    en, zh = both(sharded_transformer.fsdp_lines, fsdp_sec((100, 400, 400), (150, 400, 400), 400, ddp1=200))
    assert "sharding saved nothing" in en and "没有节省内存" in zh
    assert "about the same" in en and "cost more than" not in en
    assert "sent no less than ZeRO-3" in en and "不比 ZeRO-3 少" in zh
    assert "FSDP2 was also faster" in en and "更快" in zh
    en, _ = both(sharded_transformer.fsdp_lines, fsdp_sec((100, 400, 400), (101, 700, 300), 700))
    assert "not the 50%" in en and "no different from DDP beyond" in en


def test_sharded_transformer_tp_and_pipeline_sentences_follow_the_data():
    from bench import sharded_transformer

    def tp_row(impl: str, sp: bool, both_ways: float, step: float, comm: float,
               after: tuple = (0, 0.0), where: str = "between") -> dict:
        calls = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2},
                 "after": {"all_reduce": after[0]} if after[0] else {}}
        return {"impl": impl, "sequence_parallel": sp, "block_calls": calls,
                "block_after_in": [where] if after[0] else [],
                "block_sent_bytes_by_phase": {"forward": both_ways / 2, "backward": both_ways / 2,
                                              "after": after[1]},
                "block_sent_bytes": both_ways + after[1], "step_ms": stat(step),
                "step_comm_ms": stat(comm), "block_comm_ms": stat(comm / 2 * (1.5 if sp else 1))}

    def tp_sec(step: float, comm: float, plain: float, sp_bytes: float = 100.0) -> dict:
        rows = [tp_row("manual", sp, sp_bytes if sp else 100.0, step, comm) for sp in (False, True)]
        return {"rows": rows, "plain_step_ms": stat(plain), "model": {"dim": 64}}

    en, zh = both(sharded_transformer.tp_lines, tp_sec(100, 70, 50))
    assert "more than half of the step's time in every variant" in en and "一半以上" in zh
    assert "made it slower" in en and "反而更慢" in zh
    assert "1.00x the bytes" in en and "moves what one all-reduce moves" in en
    assert "higher than plain TP by 50%" in en
    en, zh = both(sharded_transformer.tp_lines, tp_sec(40, 10, 100, sp_bytes=50))
    assert "less than half" in en and "paid off" in en and "划算" in zh
    assert "0.50x the bytes" in en and "all-reduce moves" not in en
    # DTensor against by hand: the same bytes are said to be the same, and the sums after
    # backward (by hand: once; DTensor: in AdamW's step) are counted, not explained away
    rows = [tp_row("manual", False, 1_572_864, 40, 10), tp_row("dtensor", False, 1_572_864, 80, 20),
            tp_row("manual", True, 1_572_864, 90, 50, (6, 1_536.0)),
            tp_row("dtensor", True, 1_572_864, 190, 30, (12, 3_072.0), "optimizer")]
    sec = {"rows": rows, "plain_step_ms": stat(35), "model": {"dim": 64}}
    en, zh = both(sharded_transformer.tp_lines, sec)
    assert "DTensor's plan sent what the by-hand plan sent per block: 786,432 bytes in forward " \
           "and 786,432 in backward" in en
    assert "DTensor's plan with sequence parallel sent what the by-hand plan sent" in en
    assert "6 small all-reduces per block" in en and "12 calls, 3,072 bytes" in en
    assert "DTensor 的方案每个块发送的字节与手写方案相同" in zh
    table = sharded_transformer.tp_table(sec)
    assert table[2][2][1] == "2 all_reduce / 2 all_reduce / 6 all_reduce (sum)"
    assert table[2][3][1] == "2 all_reduce / 2 all_reduce / 12 all_reduce (AdamW's step)"
    rows[1] = tp_row("dtensor", False, 2 * 1_572_864, 80, 20)  # were DTensor to send more
    en, _ = both(sharded_transformer.tp_lines, sec)
    assert "DTensor's plan sent 2.00x the by-hand plan's bytes per block in forward" in en

    def pipe_sec(times: dict, measured: dict, plain: float = 150.0) -> dict:
        pred = {"gpipe": 0.2, "1f1b": 0.2, "interleaved": 0.11, "zero-bubble": 0.04}
        return {"rows": [{"schedule": s, "predicted_idle": pred[s], "step_ms": stat(t),
                          "measured_idle": measured[s]} for s, t in times.items()],
                "plain_step_ms": stat(plain)}

    good = pipe_sec({"gpipe": 100, "1f1b": 100, "interleaved": 95, "zero-bubble": 80},
                    {"gpipe": 0.22, "1f1b": 0.22, "interleaved": 0.12, "zero-bubble": 0.06})
    en, zh = both(sharded_transformer.pipeline_lines, good)
    assert "(zero-bubble, 4% idle) was also the fastest" in en and "也确实最快" in zh
    assert "came within 5 points" in en and "lost more" not in en and "lost less" not in en
    assert "used its 2 ranks to go faster" in en
    bad = pipe_sec({"gpipe": 80, "1f1b": 100, "interleaved": 120, "zero-bubble": 110},
                   {"gpipe": 0.3, "1f1b": 0.4, "interleaved": 0.5, "zero-bubble": 0.6}, plain=60)
    en, zh = both(sharded_transformer.pipeline_lines, bad)
    assert "The prediction did not hold" in en and "预测没有成立" in zh
    assert "Every schedule lost more time" in en and "did not buy speed" in en
    tie = pipe_sec({"gpipe": 100, "1f1b": 100, "interleaved": 100, "zero-bubble": 99},
                   {"gpipe": 0.3, "1f1b": 0.22, "interleaved": 0.12, "zero-bubble": 0.06})
    en, _ = both(sharded_transformer.pipeline_lines, tie)
    assert "cannot confirm" in en and "gpipe lost more time than predicted" in en
    low = pipe_sec({"gpipe": 100, "1f1b": 100, "interleaved": 100, "zero-bubble": 99},
                   {"gpipe": -0.1, "1f1b": 0.22, "interleaved": 0.12, "zero-bubble": 0.06})
    en, zh = both(sharded_transformer.pipeline_lines, low)
    assert "gpipe lost less than predicted" in en and "只是一个估计" in zh
    assert "1f1b, interleaved, zero-bubble came within 5 points" in en and "lost more" not in en
