"""Lesson 28: every planted hang ends by itself within its bound, and the evidence names it.

Every --hang name runs for real once, as a subprocess of the lesson (the mystery through
`make lesson-28`, as a learner types it), all at once, shared by every test (module
fixture): each must end, non-zero, within --timeout plus the lesson's bound, with one last line
naming the culprit, the diagnosis in metrics.json equal to the planted truth, no process
left behind and nothing left in its own $TMPDIR. One more job is stopped with SIGTERM while a
rank is frozen. Then the reading of the evidence is tested in-process on the files those runs
left: the ranks relabelled (the culprit on rank 0 or 2), the check-ins, the stacks, the dump's
refusal to build anything but plain data, the mystery's draw and check-28's hints.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, import_lesson, lesson_path, parse_error, run_with_line_times

import hang_evidence  # noqa: E402  (lessons/28_hang_lab/, on the path by conftest)
import hang_faults  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "checks"))

LESSON = import_lesson("28")
BOUND = LESSON.CHECK_IN_S + LESSON.EXIT_S
TIMEOUT = 6.0  # the lesson's default
FLAGS = ["--steps", "4", "--hang-step", "2"]
HANGS = ["order", "skip", "die", "shapes", "p2p"]  # + stuck, through make (the mystery of seed 0)
MYSTERY = hang_faults.mystery(0, 3, 8)


def _own_tmpdir(folder: Path) -> Path:
    """An empty $TMPDIR for one job: whatever the lesson leaves there (a fork server's
    pymp-* folder after a killed job) is seen by the tests."""
    tmp = folder.with_name(f"{folder.name}_tmp")
    tmp.mkdir()
    return tmp


def _job(name: str, folder: Path) -> dict:
    tmp = _own_tmpdir(folder)
    if name == "mystery":
        cmd = ["make", "-s", "lesson-28", f"ARGS=--hang mystery --out {folder}"]
    else:
        cmd = [sys.executable, str(lesson_path("28")), "--out", str(folder), *FLAGS,
               *([] if name == "healthy" else ["--hang", name])]
    rc, lines, err = run_with_line_times(cmd, timeout=400, env={"COLUMNS": "120", "TMPDIR": str(tmp)})
    out = "".join(line for _, line in lines[:-1])
    pids = [int(p) for p in re.findall(r"│ \d+\s+│ \d+\s+│ \S+\s+│ (\d+)", out)]
    return {"rc": rc, "lines": lines, "out": out, "err": err, "folder": folder, "pids": pids,
            "alive_after": [p for p in pids if _alive(p)], "left_in_tmp": sorted(p.name for p in tmp.iterdir())}


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T: stopped, Z: a zombie), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _stopped(folder: Path) -> dict:
    """--hang die, and SIGTERM to the launcher once rank 1 has frozen itself (state T)."""
    tmp = _own_tmpdir(folder)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, str(lesson_path("28")), "--hang", "die", "--hang-step", "1",
                             "--out", str(folder)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, frozen, code = "", None, None
    try:
        deadline = time.monotonic() + 300
        while "step    1/" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()
        pids = [int(p) for p in re.findall(r"│ \d+\s+│ \d+\s+│ \S+\s+│ (\d+)", out)]
        while len(pids) == 3 and _state(pids[1]) != "T" and time.monotonic() < deadline:
            time.sleep(0.2)  # until rank 1 has frozen itself; the others wait for it
        frozen = _state(pids[1]) if len(pids) == 3 else None
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    return {"rc": code, "err": err, "pids": pids, "frozen": frozen, "folder": folder,
            "alive_after": [p for p in pids if _alive(p)], "left_in_tmp": sorted(p.name for p in tmp.iterdir())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job at once (most of a job is waiting for its timeout)."""
    base = tmp_path_factory.mktemp("lesson28")
    names = ["mystery", "sigterm", *HANGS, "healthy"]
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        jobs = {n: pool.submit(_stopped if n == "sigterm" else _job, *((base / n,) if n == "sigterm" else (n, base / n)))
                for n in names}
    return {n: job.result() for n, job in jobs.items()}


def metrics(run: dict) -> dict:
    return json.loads((run["folder"] / "metrics.json").read_text())


@pytest.mark.parametrize("name", HANGS)
def test_each_hang_ends_in_its_bound_and_is_named(runs, name):
    run = runs[name]
    assert run["rc"] == 1, run["err"][-3000:]
    found = metrics(run)
    truth = hang_faults.truth(hang_faults.Fault(name, 1, 2))
    assert found["hang"] == name and found["truth"] == truth and found["right"] is True, found
    assert (found["diagnosis"]["rank"], found["diagnosis"]["where"]) == (1, truth["where"])
    assert hang_faults.same_operation(found["diagnosis"]["operation"], truth["operation"])
    # it ended by itself: within the timeout plus the bound after the bug fired
    assert 0 < found["ended_after_seconds"] <= TIMEOUT + BOUND, found
    if name != "shapes":  # a hang waits for its timeout; gloo aborts a size mismatch at once
        assert found["ended_after_seconds"] >= TIMEOUT * 0.9
    # one clear last line names the culprit; nothing of the job is left running
    last = run["err"].strip().splitlines()[-1]
    assert last == (f"error: hang: rank 1, {found['diagnosis']['operation']} at {truth['where']} "
                    f"({found['diagnosis']['kind']}); the job ended {found['ended_after_seconds']:g}s "
                    f"after the hang began"), last
    assert "Traceback" not in run["err"] and len(run["pids"]) == 3 and not run["alive_after"], run["pids"]
    assert not run["left_in_tmp"], run["left_in_tmp"]
    assert not (run["folder"] / "final.pt").exists()


def test_every_hang_shows_the_evidence_that_names_it(runs):
    """What each step prints is what the files say (Steps 5-7), per hang."""
    order, skip, die = runs["order"]["out"], runs["skip"]["out"], runs["die"]["out"]
    where = {kind: hang_faults.site(kind).replace("lessons/", "") for kind in hang_faults.HANGS}
    # the recorders side by side: at the first odd row, rank 1 called another line
    assert re.search(rf"rank 1 called broadcast at lessons/{where['order']}, a line of its own", order)
    assert re.search(r"rank 1 called all_gather at \S+, the call that comes after it", skip)
    assert "the first difference is at #" in order and "ranks 0, 2 agree, rank 1 differ" in skip
    # everyone alive in order and skip; rank 1 missing in die (no dump, no stack, no check-in)
    for out in (order, skip):
        assert "every rank checked in: all were alive, each waiting in a collective" in out
    assert "never checked in: rank 1" in die and "no dump from rank 1" in die
    assert "rank 1: no stack: it never answered SIGUSR1" in die
    assert "Failed to suspend process" in die or "py-spy is not installed" in die
    # p2p: gloo records no send/recv; the stack does
    p2p = runs["p2p"]["out"]
    assert f"rank 1: in recv, called at lessons/{where['p2p']}" in p2p and "behind: rank 1" in p2p
    # shapes: gloo's size check aborts the culprit; the launcher's own line names the dead rank
    shapes = runs["shapes"]
    assert "died of SIGABRT" in shapes["out"] and "Received data size doesn't match" in \
        (shapes["folder"] / "log_rank_1.txt").read_text()
    assert "rank 1 died (SIGABRT)" in shapes["out"]


def test_the_mystery_through_make_prints_evidence_and_no_verdict(runs):
    run = runs["mystery"]
    assert run["rc"] != 0 and not run["alive_after"] and not run["left_in_tmp"], run["err"][-3000:]
    found = metrics(run)
    assert found["hang"] == "mystery" and found["diagnosis"] is None and found["truth"] is None
    assert found["ended_after_seconds"] <= TIMEOUT + BOUND
    assert "the culprit:" not in run["out"] and "Name the rank, the call" in run["out"]
    assert "Write RANK, OPERATION and WHERE in exercises/28_hang_mystery.py (SEED = 0, WORLD_SIZE = 3)" \
        in run["err"]
    # seed 0 plants `stuck` on rank 1: the lesson's own reading of these files names it
    assert (MYSTERY.kind, MYSTERY.rank) == ("stuck", 1)
    verdict = hang_evidence.diagnose(hang_evidence.collect(run["folder"], 3))
    assert hang_faults.matches(verdict, hang_faults.truth(MYSTERY)), verdict
    assert "never checked in: rank 1" in run["out"] and "rank 1: in get, called at" in run["out"]
    # the shipped solution says the same (tests/test_exercises.py runs check-28 on it)
    solution = (ROOT / "tests" / "solutions" / "28_hang_mystery.py").read_text()
    assert f'WHERE = "{hang_faults.site("stuck")}"' in solution


def test_a_healthy_job_agrees_everywhere_and_saves(runs):
    run = runs["healthy"]
    assert run["rc"] == 0, run["err"][-3000:]
    found = metrics(run)
    assert found["hang"] is None and found["steps"] == 4 and len(found["losses"]) == 4
    assert (run["folder"] / "final.pt").exists() and not run["alive_after"] and not run["left_in_tmp"]
    assert re.search(r"every rank recorded the same \d+ collectives, in the same order, all completed", run["out"])
    assert "no stack was taken" in run["out"] and "no watchdog fired" in run["out"]
    assert [int(n) for n in re.findall(r"^Step (\d+):", run["out"], re.M)] == list(range(1, 9))
    dumps = hang_evidence.read_dumps(run["folder"], 3)
    assert hang_evidence.first_divergence(dumps) is None and len(dumps) == 3
    # six collectives a step: 3 DDP buckets, the loss, the hits, the decision
    per_step = [hang_evidence.operation(e) for e in hang_evidence.collectives(dumps[0]).values()
                if hang_evidence.entry_place(e) and "28_hang_lab.py" in hang_evidence.entry_place(e)]
    assert per_step[-6:] == ["all_reduce"] * 4 + ["all_gather", "broadcast"]


def test_sigterm_during_a_frozen_rank_stops_every_process(runs):
    """Whatever stops the launcher stops every process, the frozen (SIGSTOPped) rank too."""
    run = runs["sigterm"]
    assert run["frozen"] == "T" and run["rc"] == 143, run
    assert "interrupted (SIGTERM): every rank was stopped" in run["err"], run["err"]
    assert len(run["pids"]) == 3 and not run["alive_after"] and not run["left_in_tmp"], run["left_in_tmp"]
    assert not (run["folder"] / "metrics.json").exists() and not (run["folder"] / "final.pt").exists()


# --- the reading of the evidence, in-process, on the files the runs left --------------------

def relabelled(folder: Path, to: Path, order: list[int]) -> Path:
    """The run's evidence with rank r's files given to rank order[r] (the same job, the
    culprit elsewhere); the check-in messages follow the ranks they name."""
    to.mkdir()
    for path in folder.iterdir():
        found = re.match(r"(.*_)(\d+)(\.\w+)$", path.name)
        if not found or not path.name.startswith(hang_evidence.STATES):
            continue
        text = path.read_text()
        if path.name.startswith("check_in_rank_"):
            text = re.sub(r"Ranks? ([\d, ]+) failed", lambda m: "Ranks " + ", ".join(
                str(order[int(r)]) for r in m[1].split(",")) + " failed", text)
            text = re.sub(r"from rank (\d)", lambda m: f"from rank {order[int(m[1])]}", text)
        (to / f"{found[1]}{order[int(found[2])]}{found[3]}").write_text(text)
    return to


@pytest.mark.parametrize("name", ["order", "skip", "die", "p2p"])
@pytest.mark.parametrize("order", [[2, 0, 1], [1, 2, 0]])  # the culprit (rank 1) as rank 0, then rank 2
def test_the_verdict_follows_the_culprit_to_another_rank(runs, name, order, tmp_path):
    ev = hang_evidence.collect(relabelled(runs[name]["folder"], tmp_path / "ev", order), 3)
    assert hang_evidence.never_checked_in(ev.check_ins, 3) == ([order[1]] if name == "die" else [])
    verdict = hang_evidence.diagnose(ev)
    truth = hang_faults.truth(hang_faults.Fault(name, order[1], 2))
    assert hang_faults.matches(verdict, truth), (verdict, truth)


def test_the_side_by_side_table_starts_before_the_first_difference(runs):
    dumps = hang_evidence.read_dumps(runs["order"]["folder"], 3)
    found = hang_evidence.first_divergence(dumps)
    columns, rows = hang_evidence.side_by_side(dumps, 3)
    assert columns == ["#", "rank 0", "rank 1", "rank 2"] and int(rows[0][0]) == found["seq"] - 3
    odd = next(r for r in rows if int(r[0]) == found["seq"])
    assert odd[2].startswith("broadcast [1]") and odd[1].startswith("all_reduce [2]") and "WAITING" in odd[1]
    assert found["majority"]["then"] == hang_faults.site("shapes")  # what follows the all_reduce: the all_gather


def test_check_ins_name_who_never_came():
    ok = {"passed": True, "error": None}
    assert hang_evidence.never_checked_in({}, 3) is None
    assert hang_evidence.never_checked_in({0: ok, 1: ok, 2: ok}, 3) == []
    named = {0: {"passed": False, "error": "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms"}}
    assert hang_evidence.never_checked_in(named, 4) == [1, 2, 3]  # rank 3 left no file either
    others = {r: {"passed": False, "error": f"Rank {r} successfully reached monitoredBarrier, but received "
                  f"errors while waiting for send/recv from rank 0."} for r in (1, 2)}
    assert hang_evidence.never_checked_in(others, 3) == [0]


def test_a_faulthandler_dump_is_read_thread_by_thread(tmp_path):
    """The main thread is the one threading did not start; frames innermost first."""
    text = ('Thread 0x00007f (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
            'Current thread 0x00007e (most recent call first):\n'
            '  File "/usr/lib/python3.11/queue.py", line 171 in get\n'
            f'  File "{ROOT}/lessons/28_hang_lab.py", line 212 in train\n'
            f'  File "{ROOT}/common/processes.py", line 300 in _rank_main\n')
    frames = hang_evidence.main_thread(text)
    assert frames[0] == ("queue.py:171", "get") and hang_evidence.ours(frames) == "lessons/28_hang_lab.py:212"
    assert hang_evidence.call_made(frames) == "get" and len(hang_evidence.threads(text)) == 2


def test_a_dump_is_plain_data_and_keeps_each_calls_line():
    entry = {"frames": [{"name": "all_reduce", "filename": f"{ROOT}/.venv/lib/python3.11/site-packages/torch/"
                         "distributed/distributed_c10d.py", "line": 3913},
                        {"name": "train", "filename": f"{ROOT}/lessons/28_hang_lab.py", "line": 229}],
             "profiling_name": "gloo:all_reduce", "collective_seq_id": 7, "retired": False}
    dump = json.loads(hang_evidence.dump_as_json(pickle.dumps({"entries": [entry]})))
    assert dump["entries"][0]["frames"] == ["torch/distributed/distributed_c10d.py:3913 in all_reduce",
                                            "lessons/28_hang_lab.py:229 in train"]
    assert hang_evidence.describe(dump["entries"][0]).endswith("28_hang_lab.py:229 WAITING")

    class Trap:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    with pytest.raises(pickle.UnpicklingError, match="plain data"):
        hang_evidence.dump_as_json(pickle.dumps({"entries": [Trap()]}))


def test_each_hang_is_marked_on_one_line_and_the_mystery_draws_them_all():
    lines = {kind: int(hang_faults.site(kind).split(":")[1]) for kind in hang_faults.HANGS}
    assert len(set(lines.values())) == len(lines)
    source = lesson_path("28").read_text().splitlines()
    assert "dist.broadcast" in source[lines["order"] - 1] and "dist.all_reduce" in source[lines["skip"] - 1]
    assert "loss.backward()" in source[lines["die"] - 1] and "dist.all_gather" in source[lines["shapes"] - 1]
    assert "dist.recv" in source[lines["p2p"] - 1] and ".get()" in source[lines["stuck"] - 1]
    draws = [hang_faults.mystery(seed, world, 8) for seed in range(200) for world in (3, 4)]
    assert {d.kind for d in draws} == set(hang_faults.HANGS)
    assert all(1 <= d.step <= 6 and (d.kind != "p2p" or d.rank != 0) for d in draws)
    assert {d.rank for d in draws if d.kind == "stuck"} >= {0, 1, 2, 3}


def test_operations_and_places_are_read_the_way_learners_write_them():
    assert all(hang_faults.same_operation(s, "all_reduce") for s in ("all_reduce", "dist.all_reduce()", "gloo:all_reduce"))
    assert hang_faults.same_operation("Queue.get", "get") and not hang_faults.same_operation("all_gather", "all_reduce")
    right = "lessons/28_hang_lab.py:212"
    assert all(hang_faults.same_place(s, right) for s in
               (right, "28_hang_lab.py:212", "/home/me/dist/lessons/28_hang_lab.py, line 212"))
    assert not hang_faults.same_place("lessons/28_hang_lab.py:213", right)
    assert not hang_faults.same_place("lessons/20_observability.py:212", right)


@pytest.mark.parametrize("said, hint", [
    ({"RANK": 2}, r"rank 2 is not the culprit\. Look again at Steps 6 and 7"),
    ({"OPERATION": "all_reduce"}, r"rank 1 is right; 'all_reduce' is not the call that went wrong"),
    ({"WHERE": "lessons/28_hang_lab.py:1"}, r"rank 1 and get are right; 'lessons/28_hang_lab.py:1' is not the line"),
    ({"RANK": 7}, r"RANK 7 is not a rank of a 3-rank job"),
    ({"WORLD_SIZE": 5}, r"WORLD_SIZE must be the --world-size you ran with"),
    ({"RANK": None}, r"RANK is not filled in yet"),
])
def test_check_28_hints_without_the_answer(said, hint, monkeypatch):
    """Each wrong answer is "not yet" with a hint that gives no answer away; the names are handed
    to the check as the harness's answer() would (tests/test_exercises.py runs it for real)."""
    import check_28
    import check_exercise

    right = hang_faults.truth(MYSTERY)
    names = {"SEED": 0, "WORLD_SIZE": 3, "RANK": 1, "OPERATION": "Queue.get", "WHERE": right["where"], **said}
    monkeypatch.setattr(check_exercise, "answer", lambda path, probe: names)
    with pytest.raises(check_exercise.NotYet, match=hint) as wrong:
        check_28.check(Path("28_hang_mystery.py"))
    assert right["where"] not in str(wrong.value)
    names.update(RANK=1, OPERATION="dist.Queue.get()", WHERE=right["where"].replace("lessons/", "/tmp/x/lessons/"),
                 WORLD_SIZE=3)  # the right names, written another way, pass
    assert check_28.check(Path("28_hang_mystery.py")).startswith("SEED 0: rank 1, get at ")


@pytest.mark.parametrize("flags, expect", [
    (["--world-size", "2"], "use one of 3, 4, 6, 8"),
    (["--world-size", "5"], "cannot split the global batch"),
    (["--device", "cuda"], "plants its hangs in gloo on the CPU"),
    (["--hang", "skip", "--hang-rank", "3"], "--hang-rank 3: choose a rank from 0 to 2"),
    (["--hang", "p2p", "--hang-rank", "0"], "choose a rank from 1 to 2 (rank 0 hands out the batches"),
    (["--hang", "order", "--hang-step", "8"], "--hang-step 8: choose a step before --steps 8"),
    (["--hang-step", "0"], "expected a whole number of 1 or more"),
    (["--hang", "nap"], "invalid choice: 'nap'"),
])
def test_bad_flags_are_one_clear_line(flags, expect, monkeypatch, capsys):
    assert expect in parse_error(LESSON, flags, monkeypatch, capsys)
