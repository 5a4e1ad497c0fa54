"""Lesson 20: the profiler's traces and the flight recorder's dumps say what the lesson prints.

Two runs, started together and shared by every test (module fixture): a normal one (1 epoch)
and one where rank 1 stops early (--skip-rank 1) with a 5 s timeout. The tests read the
traces and the dumps themselves, with their own few lines of code, and compare.
"""
import json
import re
import sys
import threading

import pytest

from common import recipe
from conftest import (import_lesson, lesson_path, load_run, max_abs_diff, parse_error,
                      run_with_line_times)

SKIP_TIMEOUT = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (threads), each line of output with the second it appeared."""
    base = tmp_path_factory.mktemp("lesson20")
    flags = {"normal": ["--epochs", "1"],
             "skip": ["--epochs", "1", "--skip-rank", "1", "--timeout", str(SKIP_TIMEOUT)]}
    done = {}

    def one(name):
        cmd = [sys.executable, str(lesson_path("20")), "--out", str(base / name), *flags[name]]
        rc, lines, err = run_with_line_times(cmd, timeout=150)
        done[name] = {"rc": rc, "lines": lines, "out": "".join(line for _, line in lines[:-1]),
                      "err": err, "folder": base / name}

    threads = [threading.Thread(target=one, args=(name,)) for name in flags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def test_normal_run_ends_on_lesson_01s_weights(runs):
    run = runs["normal"]
    assert run["rc"] == 0, run["err"][-3000:]
    state, metrics = load_run(run["folder"])
    assert max_abs_diff(state, recipe.train_reference(epochs=1)) <= 1e-4
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


@pytest.mark.parametrize("flags, expect", [(["--skip-rank", "0"], "from 1 to 1"),
                                           (["--skip-rank", "2"], "from 1 to 1"),
                                           (["--world-size", "5"], "cannot split the global batch")])
def test_bad_flags_are_one_clear_line(flags, expect, monkeypatch, capsys):
    line = parse_error(import_lesson("20"), flags, monkeypatch, capsys)
    assert expect in line
