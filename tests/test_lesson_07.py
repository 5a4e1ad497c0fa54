"""Lesson 07: restarts after a failure, atomic snapshots, exact mid-epoch resume.

Each `python ...` command here is forked from the test zygote (conftest.run, tests/zygote.py);
tools/nodes.py's agent and each attempt's workers are new Pythons, as on a learner's machine.
make lesson-07 runs the Makefile's own command (RUN_07); the job killed from outside runs
tools/nodes.py through conftest.run in a thread, and finds its victim worker by its
/proc/PID/cmdline and environ (conftest.described)."""
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common import recipe
from conftest import (described, import_lesson, load_run, make_command, max_abs_diff, one_error_line,
                      parse_error, run, run_lesson)

LESSON = "lessons/07_elastic.py"
ELASTIC = [sys.executable, "tools/nodes.py", "--elastic", "--nnodes", "1",
           "--nproc-per-node", "2"]
STEPS_PER_EPOCH = recipe.N_TRAIN // recipe.GLOBAL_BATCH


def assert_every_sample_once_in_lesson_01_order(folder, epochs=recipe.EPOCHS):
    """samples.pt holds the ids each optimizer step used, gathered from every rank."""
    samples = torch.load(folder / "samples.pt", weights_only=True)
    assert samples.shape == (epochs * STEPS_PER_EPOCH, recipe.GLOBAL_BATCH)
    for epoch in range(epochs):
        rows = samples[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH]
        # no repeat, no skip: the epoch's steps together hold every sample exactly once ...
        assert sorted(rows.flatten().tolist()) == list(range(recipe.N_TRAIN))
        # ... and each step holds the same global batch as lesson 01's step
        order = recipe.epoch_order(recipe.N_TRAIN, recipe.SEED, epoch)
        for s, row in enumerate(rows):
            batch = order[s * recipe.GLOBAL_BATCH:(s + 1) * recipe.GLOBAL_BATCH]
            assert sorted(row.tolist()) == sorted(batch), (epoch, s)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 2-worker elastic job with no failure: what an interrupted run must equal. Plain
    torchrun --standalone (c10d rendezvous, like tools/nodes.py --elastic): the same 2
    workers and data shards; its agent is forked from the zygote, its workers are new."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    tmpdir = tmp_path_factory.mktemp("uninterrupted_tmp")  # the agent's torchelastic_... folder
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         LESSON, "--fail-at-step", "0", "--out", folder], timeout=180, env={"TMPDIR": str(tmpdir)})
    state, metrics = load_run(folder)
    assert metrics["world_size"] == 2
    assert metrics["restarts"] == 0 and metrics["resumed_from_step"] == 0
    return state


@pytest.fixture(scope="module")
def left_snapshot(tmp_path_factory):
    """A job without restarts (--max-restarts 0) dies at step 45 and leaves its step-40 snapshot."""
    folder = tmp_path_factory.mktemp("no_restarts")
    proc = run([*ELASTIC, "--max-restarts", "0", "--", LESSON, "--out", folder],
               check=False, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error:")  # one summary line last
    assert not (folder / "final.pt").exists()
    snap = torch.load(folder / "snapshot.pt", weights_only=True)
    assert snap["global_step"] == 40 and snap["world_size"] == 2
    return folder / "snapshot.pt"


def test_make_lesson_07_fails_once_restarts_and_resumes_exactly(tmp_path, reference_3_epochs,
                                                               uninterrupted):
    start = time.time()
    # make lesson-07's command (its agent's workers are new Pythons)
    proc = run(make_command("07", "--out", tmp_path), timeout=180)
    elapsed = time.time() - start
    state, metrics = load_run(tmp_path)
    # one injected failure, one restart, resumed mid-epoch from the step-40 snapshot
    assert metrics["restarts"] == 1 and metrics["max_restarts"] == 3
    assert metrics["resumed_from_step"] == 40 and metrics["world_size"] == 2
    assert "[rank 1] step 45: killing myself with SIGKILL" in proc.stdout
    assert "will restart worker group" in proc.stderr  # torchrun's agent says so
    assert "attempt 2 (restart count 1): resuming from snapshot at epoch 2 step 8/32" in proc.stdout
    # the same weights as without the failure, and as lesson 01
    assert max_abs_diff(state, uninterrupted) <= 1e-6
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    assert metrics["max_abs_diff_vs_single_device"] <= 1e-4
    # the loss curve is whole: one loss per step, none lost with the dead attempt
    assert len(metrics["losses"]) == recipe.EPOCHS * STEPS_PER_EPOCH
    assert metrics["every_sample_once_per_epoch"] is True
    assert_every_sample_once_in_lesson_01_order(tmp_path)
    # the job finished, so the snapshot is gone: the next make lesson-07 starts from scratch
    assert not (tmp_path / "snapshot.pt").exists()
    assert "terminate called" not in proc.stderr
    print(f"make lesson-07 took {elapsed:.1f} s")


def worker_pids(stdout_text):
    """rank -> pid from the lesson's 'Ranks and nodes' table (the last one printed):
    rank | node | local rank | host | pid | ..."""
    rows = re.findall(r"^│ (\d+)\s+│ \d+\s+│ \d+\s+│ \S+\s+│ (\d+)\s+│", stdout_text, re.M)
    return {int(rank): int(pid) for rank, pid in rows}


def first_attempt_worker(folder: Path, rank: int) -> int | None:
    """The pid of attempt 1's worker `rank` of the job writing to `folder` (its command line
    names the folder; torchrun gave it RANK and TORCHELASTIC_RESTART_COUNT)."""
    for entry in Path("/proc").iterdir():
        seen = described(int(entry.name)) if entry.name.isdigit() else None
        if seen is None:  # gone, or not ours
            continue
        cmdline, env = seen
        if str(folder) not in cmdline or "torch.distributed.run" in cmdline:
            continue
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return int(entry.name)
    return None


def test_a_worker_killed_from_outside_is_survived(tmp_path, reference_3_epochs, uninterrupted):
    folder = tmp_path / "run"
    result = {}

    def job():  # tools/nodes.py forked from the zygote, as a test's `python script.py` is
        try:
            result["proc"] = run([*ELASTIC, "--max-restarts", "3", "--", LESSON, "--fail-at-step",
                                  "0", "--step-delay", "0.05", "--out", folder],
                                 check=False, timeout=240)
        except BaseException as exc:  # noqa: BLE001 (a timeout, reported below)
            result["error"] = exc

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 120
        while not (folder / "snapshot.pt").exists():  # training is under way
            assert thread.is_alive(), result
            assert time.time() < deadline, "no snapshot appeared"
            time.sleep(0.05)
        time.sleep(0.7)  # somewhere in the middle, maybe in a save: any moment must do
        victim = first_attempt_worker(folder, 0)  # rank 0: the one that writes snapshots
        assert victim is not None, "attempt 1's rank 0 not found"
        os.kill(victim, signal.SIGKILL)
    finally:
        thread.join(250)
    assert "error" not in result, result["error"]
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    state, metrics = load_run(folder)
    stdout = proc.stdout
    first_attempt, _, _ = stdout.partition("Lesson 07: attempt 2 of")
    assert worker_pids(first_attempt)[0] == victim  # the rank 0 that attempt 1's table showed
    assert metrics["restarts"] >= 1
    assert metrics["resumed_from_step"] > 0 and metrics["resumed_from_step"] % 10 == 0
    assert re.search(r"attempt 2 \(restart count 1\): resuming from snapshot at epoch \d step \d+/32",
                     stdout)
    assert victim not in worker_pids(stdout).values()  # new processes after the restart
    assert max_abs_diff(state, uninterrupted) <= 1e-6
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    assert_every_sample_once_in_lesson_01_order(folder)


def test_a_killed_save_leaves_the_snapshot_intact_and_a_new_job_resumes_it(
        tmp_path, left_snapshot, reference_3_epochs):
    path = tmp_path / "snapshot.pt"
    shutil.copy(left_snapshot, path)
    before = path.read_bytes()
    # the lesson's save path (atomic_write + torch.save), killed halfway through writing
    crash = (
        "import os, signal, sys\n"
        "sys.path.insert(0, '.')\n"
        "from apparatus.results import atomic_write\n"
        "def half_then_die(f):\n"
        "    f.write(b'PK' + bytes(5000))\n"
        "    f.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"atomic_write({str(path)!r}, half_then_die)\n"
    )
    proc = run([sys.executable, "-c", crash], check=False, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before  # untouched
    assert torch.load(path, weights_only=True)["global_step"] == 40
    strays = list(tmp_path.glob(".snapshot.pt.*.tmp"))
    assert len(strays) == 1 and strays[0].stat().st_size > 0
    # The 2-worker job that wrote the snapshot died (no restarts left). Resubmitted as a
    # world of one, the new job deletes the stray file and resumes at step 40: progress is
    # kept in global steps, so the world size may change.
    proc = run_lesson("07", "--out", tmp_path, timeout=120)
    assert "a save that was cut short" in proc.stdout
    assert not list(tmp_path.glob(".snapshot.pt.*.tmp"))
    assert "left by an earlier job" in proc.stdout
    assert "resuming from snapshot at epoch 2 step 8/32 (global step 40, saved with 2 worker(s))" \
        in proc.stdout
    state, metrics = load_run(tmp_path)
    assert metrics["world_size"] == 1 and metrics["resumed_from_step"] == 40
    assert metrics["restarts"] == 0
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    assert_every_sample_once_in_lesson_01_order(tmp_path)


def test_corrupt_or_incompatible_snapshots_are_one_clear_error(tmp_path, left_snapshot):
    path = tmp_path / "snapshot.pt"
    good = left_snapshot.read_bytes()
    path.write_bytes(good[:len(good) // 2])  # cut short: what a non-atomic save would leave
    line = one_error_line(run_lesson("07", "--out", tmp_path, check=False, timeout=60))
    assert line.startswith(f"error: snapshot {path} cannot be read"), line
    assert "delete it or pass --fresh" in line
    # a readable snapshot made with another seed would resume a different sample order
    path.write_bytes(good)
    line = one_error_line(run_lesson("07", "--seed", "1", "--out", tmp_path, check=False, timeout=60))
    assert "was made with seed 0, this run uses 1" in line and "--fresh" in line
    # a snapshot whose weights do not fit the model
    snap = torch.load(path, weights_only=True)
    snap["model"]["fc1.weight"] = torch.zeros(3, 3)
    torch.save(snap, path)
    line = one_error_line(run_lesson("07", "--out", tmp_path, check=False, timeout=60))
    assert "does not fit this model" in line and "fc1.weight" in line
    # --fresh starts over instead
    path.write_bytes(b"garbage")
    proc = run_lesson("07", "--fresh", "--epochs", "1", "--out", tmp_path, timeout=120)
    assert "--fresh: deleted" in proc.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["resumed_from_step"] == 0


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    # parse_args() refuses a rank beyond the world (plain python: a world of one), in-process
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    line = parse_error(import_lesson("07"), ["--fail-rank", "2"], monkeypatch, capsys)
    assert "--fail-rank 2" in line, line
    # the step is checked against the data after start-up: end to end
    line = one_error_line(run_lesson("07", "--fail-at-step", "97", check=False, timeout=60))
    assert line.startswith("error:") and "beyond the last step" in line, line


def test_a_failing_worker_ignores_sigterm_while_its_error_file_is_written():
    """error_file_whole (under @record in lessons 06 and 07): once main raises, SIGTERM is
    ignored, so the agent's SIGTERM to the other workers cannot leave an empty error.json
    (which made the agent itself fail on it, seen once in this file's killed-worker test)."""
    from common.processes import error_file_whole
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert error_file_whole(lambda: 3)() == 3
        assert signal.getsignal(signal.SIGTERM) == before  # nothing changes while it works
        for leaving in (SystemExit(0), SystemExit(2), KeyboardInterrupt()):  # --help, a bad flag, Ctrl-C
            def leaves(exc=leaving):
                raise exc
            with pytest.raises(type(leaving)):
                error_file_whole(leaves)()
            assert signal.getsignal(signal.SIGTERM) == before, leaving  # not an error file's business

        @error_file_whole
        def fails():
            raise ValueError("a peer died")
        with pytest.raises(ValueError, match="a peer died"):
            fails()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
