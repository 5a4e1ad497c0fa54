"""Lesson 20: the profiler's traces and the flight recorder's dumps say what the lesson prints.

Two runs, started together and shared by every test (module fixture): a normal one (1 epoch,
with --fsdp: it also traces FSDP2) and one where rank 1 stops early (--skip-rank 1) with a 5 s
timeout. The tests read the traces and the dumps themselves, with their own few lines of code,
and compare.
"""
import json
import re
import shlex
import sys
import threading

import pytest
import torch

from common import recipe
from conftest import (import_lesson, lesson_path, load_run, max_abs_diff, parse_error,
                      run_with_line_times)

SKIP_TIMEOUT = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (threads), each line of output with the second it appeared; lesson 01's
    weights, computed meanwhile (the skip run spends most of its time waiting for its timeout)."""
    base = tmp_path_factory.mktemp("lesson20")
    flags = {"normal": ["--epochs", "1", "--fsdp"],
             "skip": ["--epochs", "1", "--skip-rank", "1", "--timeout", str(SKIP_TIMEOUT)]}
    done = {}

    def one(name):
        # the normal run through make, as a learner runs it (the skip run directly: its exit
        # code and last line are the lesson's, not make's); 120 columns, as run() gives: on a
        # busy machine the FSDP2 table's times grow wide
        args = ["--out", str(base / name), *flags[name]]
        cmd = [sys.executable, str(lesson_path("20")), *args]
        if name == "normal":
            cmd = ["make", "-s", "--no-print-directory", "lesson-20", f"ARGS={shlex.join(args)}"]
        rc, lines, err = run_with_line_times(cmd, timeout=300, env={"COLUMNS": "120"})
        done[name] = {"rc": rc, "lines": lines, "out": "".join(line for _, line in lines[:-1]),
                      "err": err, "folder": base / name}

    def reference():
        done["reference"] = recipe.train_reference(epochs=1)

    threads = [threading.Thread(target=one, args=(name,)) for name in flags]
    threads.append(threading.Thread(target=reference))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def test_normal_run_ends_on_lesson_01s_weights(runs):
    run = runs["normal"]
    assert run["rc"] == 0, run["err"][-3000:]
    state, metrics = load_run(run["folder"])
    assert max_abs_diff(state, runs["reference"]) <= 1e-4
    assert metrics["lesson"] == "20" and metrics["max_abs_diff_vs_single_device"] <= 1e-4
    assert "every rank recorded the same" in run["out"] and "nobody is missing" in run["out"]


def _union_ms(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000


def test_each_rank_wrote_a_trace_and_the_printed_numbers_come_from_it(runs):
    run = runs["normal"]
    for rank in (0, 1):
        events = [e for e in json.loads((run["folder"] / f"trace_rank{rank}.json").read_text())
                  ["traceEvents"] if e.get("ph") == "X"]
        steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
        assert len(steps) == 2, [s["name"] for s in steps]  # the schedule: 2 active steps
        for step in steps:
            t0, t1 = step["ts"], step["ts"] + step["dur"]
            runs_ = sorted((e for e in events if e["name"] == "gloo:all_reduce" and e["tid"] != step["tid"]
                            and t0 <= e["ts"] < t1), key=lambda e: e["ts"])
            # 3 buckets of the MLP's gradients (5,508 floats) in every step
            assert len(runs_) == 3
            line = re.search(rf"rank {rank}, {step['name']} \(([\d.]+) ms\): communication ([\d.]+) ms",
                             run["out"])
            assert line, run["out"][-3000:]
            assert float(line[1]) == pytest.approx(step["dur"] / 1000, abs=0.006)
            comm = _union_ms([(e["ts"], min(e["ts"] + e["dur"], t1)) for e in runs_])
            assert float(line[2]) == pytest.approx(comm, abs=0.006)
            if rank == 0:  # rank 0's table: one row per all-reduce, starts in ms from the step
                table = run["out"].split(f"rank 0, {step['name']}: backward")[1].split("rank 0, ")[0]
                rows = re.findall(r"│ (bucket \d|after backward) +│ ([\d,]+) +│ ([\d.]+) +│ ([\d.]+) +│", table)
                assert len(rows) == len(runs_)
                for row, e in zip(rows, runs_):
                    assert float(row[2]) == pytest.approx((e["ts"] - t0) / 1000, abs=0.006)
                assert sorted(int(r[1].replace(",", "")) for r in rows) == [324, 1088, 4096]


def test_fsdp_trace_shows_each_blocks_gathers_and_reduce_scatter_beside_its_compute(runs):
    """--fsdp: per block two all-gathers (before forward, before backward) and one
    reduce-scatter, read from FSDP2's own labels; the printed cells are the trace's times."""
    run = runs["normal"]
    assert run["rc"] == 0, run["err"][-3000:]
    table = run["out"].split("rank 0, FSDP2, ")[1].split("rank 0, FSDP2, ")[0]
    rows = {r[0]: r[1:] for r in re.findall(r"│ (root|blocks\.\d) +│ (\S+) +│ (\S+) +│ (\S+) +│ (\S+) +│ (\S+) +│", table)}
    assert list(rows) == ["root", "blocks.0", "blocks.1"], table
    for rank in (0, 1):
        path = run["folder"] / f"fsdp_trace_rank{rank}.json"
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        step = next(e for e in events if e["name"].startswith("ProfilerStep#"))  # one active step
        main, t0 = step["tid"], step["ts"]
        inside = [e for e in events if t0 <= e["ts"] < t0 + step["dur"]]
        named = lambda name: sorted((e for e in inside if e["tid"] == main and e["name"] == name),  # noqa: E731
                                    key=lambda e: e["ts"])
        for block in ("blocks.0", "blocks.1"):
            assert len(named(f"FSDP::all_gather ({block})")) == 2  # freed after forward: gathered again
            assert len(named(f"FSDP::post_backward_reduce ({block})")) == 1
        assert len(named("FSDP::all_gather")) == 1  # the root is kept gathered from forward to backward
        # what ran on gloo's threads: 5 all-gathers, and the 3 reduce-scatters as all-reduces
        off_main = [e["name"] for e in inside if e["tid"] != main and e["name"].startswith("gloo:")]
        assert (off_main.count("gloo:all_gather"), off_main.count("gloo:all_reduce")) == (5, 3), off_main
        assert f"rank {rank}, FSDP2, {step['name']}: all-gathers and reduce-scatters" in run["out"]
        if rank == 0:  # block 0's forward: weights in place (copy-out ends) -> its post-forward hook
            copied = named("FSDP::all_gather_copy_out (blocks.0)")[0]
            start = round((copied["ts"] + copied["dur"] - t0) / 1000, 3)  # µs -> ms, as printed
            end = round((named("FSDP::post_forward (blocks.0)")[0]["ts"] - t0) / 1000, 3)
            assert rows["blocks.0"][1] == f"{start:.1f}-{end:.1f}", rows
            assert rows["root"][1:4] == ("-", "-", "-")  # the root's hooks wrap the whole model


def test_a_rank_that_skips_a_collective_is_named_from_the_dumps(runs):
    run = runs["skip"]
    assert run["rc"] == 1, run["err"][-3000:]
    # the hang ends by itself: from the start of training to the exit, the 5 s timeout and
    # the dumps, never the minutes a process group waits by default (gloo: 30 minutes)
    training = next(t for t, line in run["lines"] if line.startswith("Step 5: Train"))
    assert run["lines"][-1][1] == "<exit>" and run["lines"][-1][0] - training < 40
    assert not (run["folder"] / "final.pt").exists()  # nothing saved by a failed run
    dumps = {r: json.loads((run["folder"] / f"fr_rank_{r}.json").read_text()) for r in (0, 1)}
    seqs = {r: {e["collective_seq_id"]: e for e in d["entries"] if not e["is_p2p"]}
            for r, d in dumps.items()}
    first_missing = max(seqs[1]) + 1  # rank 1 stopped: rank 0 went on to the next collective
    assert first_missing in seqs[0] and all(n in seqs[1] for n in range(1, first_missing))
    name = seqs[0][first_missing]["profiling_name"]
    line = re.search(r"collective #(\d+), (\S+) #\d+ \(input (\d+)\): called by rank\(s\) 0; "
                     r"rank 1 never arrived", run["out"])
    assert line, run["out"][-3000:]
    assert int(line[1]) == first_missing and line[2] == name == "gloo:all_reduce"
    assert [int(line[3])] == seqs[0][first_missing]["input_sizes"][0]
    assert run["err"].strip().splitlines()[-1].startswith("error: rank ")
    # rank 1 waited at monitored_barrier, which reports that rank 0 never answered
    assert "monitoredBarrier" in run["err"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one process group with NCCL and gloo")
def test_on_gpus_one_group_serves_nccl_and_the_monitored_barrier(tmp_path):
    """On GPUs the group is cpu:gloo,cuda:nccl: training on NCCL, monitored_barrier on gloo,
    with no second group; the run ends on lesson 01's weights."""
    rc, lines, err = run_with_line_times([sys.executable, str(lesson_path("20")), "--device", "cuda",
                                          "--epochs", "1", "--out", str(tmp_path)], timeout=300)
    assert rc == 0, err[-3000:]
    state, metrics = load_run(tmp_path)
    assert metrics["backend"] == "cpu:gloo,cuda:nccl" and metrics["max_abs_diff_vs_single_device"] <= 1e-4


@pytest.mark.parametrize("flags, expect", [(["--skip-rank", "0"], "from 1 to 1"),
                                           (["--skip-rank", "2"], "from 1 to 1"),
                                           (["--world-size", "5"], "cannot split the global batch"),
                                           # issue 35: a step past the end skipped nothing ("nobody is missing")
                                           (["--skip-rank", "1", "--skip-at-step", "1000000"],
                                            "--skip-at-step 1000000: this run has steps 0 to 95"),
                                           (["--skip-rank", "1", "--epochs", "1", "--skip-at-step", "32"],
                                            "steps 0 to 31 (32 per epoch)")])
def test_bad_flags_are_one_clear_line(flags, expect, monkeypatch, capsys):
    line = parse_error(import_lesson("20"), flags, monkeypatch, capsys)
    assert expect in line
