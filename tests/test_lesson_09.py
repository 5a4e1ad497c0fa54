"""Lesson 09: checkpoint keys under wrappers, run as a learner would."""
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

from common import recipe
from conftest import ROOT, lesson_path, load_run, make_lesson, max_abs_diff, one_error_line, run_lesson


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson09")
    proc = make_lesson("09", "--out", folder, timeout=150)
    state, metrics = load_run(folder)
    return proc, state, metrics, folder


def test_ddp_keys_carry_the_prefix_and_a_plain_model_refuses_them(default_run):
    proc, _, m, _ = default_run
    assert m["ddp_keys"] and all(k.startswith("module.") for k in m["ddp_keys"])
    assert m["plain_load_error"].startswith("Error(s) in loading state_dict for MLP")
    # the real error text, printed for the learner
    assert 'Missing key(s) in state_dict: "fc1.weight"' in proc.stdout
    assert 'Unexpected key(s) in state_dict: "module.fc1.weight"' in proc.stdout
    assert "it returned None" in proc.stdout  # consume_prefix_in_state_dict_if_present


def test_replace_is_a_bug_and_prefix_strip_is_not(default_run):
    _, _, m, _ = default_run
    assert m["replace_bug"] == {
        "module.stem.submodule.weight": "stem.subweight",
        "module.stem.submodule.bias": "stem.subbias",
        "module.block.module.weight": "block.weight",
        "module.block.module.bias": "block.bias",
    }
    assert "stem.subweight" in m["load_into_errors"]["the k.replace keys"]


def test_wrapper_prefixes(default_run):
    _, _, m, _ = default_run
    assert m["first_keys"] == {
        "plain": "fc1.weight",
        "DataParallel": "module.fc1.weight",
        "DDP": "module.fc1.weight",
        "torch.compile": "_orig_mod.fc1.weight",
        "DDP(torch.compile)": "module._orig_mod.fc1.weight",
        "torch.compile(DDP)": "_orig_mod.module.fc1.weight",
    }


def test_load_into_every_pair(default_run):
    _, _, m, _ = default_run
    assert len(m["load_into"]) == 20 and m["load_into_max_abs_diff"] == 0.0
    assert m["load_into"]["DDP(torch.compile) -> DataParallel"] == "module._orig_mod."
    assert m["load_into"]["plain -> DDP"] == "(nothing)"
    assert "missing" in m["load_into_errors"]["a TinyNet checkpoint"]


def test_reloaded_model_is_the_trained_one(default_run):
    _, state, m, folder = default_run
    assert all(k.startswith(("fc1.", "fc2.", "head.")) for k in state)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest on a busy machine
    try:
        reference = recipe.train_reference(epochs=recipe.EPOCHS)
    finally:
        torch.set_num_threads(threads)
    assert max_abs_diff(state, reference) <= 1e-4  # DDP on a world of 1 = lesson 01
    assert m["max_abs_diff_vs_single_device"] <= 1e-4
    assert m["final_accuracy"] == m["accuracy_before_saving"] > 0.85
    # the device tag torch.save recorded: where rank 0 trained (--device auto: cuda:0 when
    # there is a GPU for every rank, else the CPU)
    assert m["checkpoint_locations"] == [m["device"]] and m["device"] in ("cpu", "cuda:0")
    assert (folder / "ddp_model.pt").exists() and (folder / "model.pt").exists()


def test_rank_0_saves_and_every_rank_loads_after_the_barrier(default_run):
    _, _, m, _ = default_run
    before, after = m["resume_checksums"]["before"], m["resume_checksums"]["after"]
    assert len(before) == len(after) == 2
    assert before[0] != before[1]          # different random weights on each rank
    assert after[0] == after[1]            # the same file, read after the barrier


def test_steps_and_weights_only(default_run):
    out = default_run[0].stdout
    steps = [int(n) for n in re.findall(r"^Step (\d+):", out, re.M)]
    assert steps == list(range(1, 12))
    assert "Unsupported global" in out and "TrainConfig" in out
    assert "Traceback" not in out + default_run[0].stderr


def test_too_many_ranks_is_one_clear_line():
    line = one_error_line(run_lesson("09", "--world-size", "9", check=False, timeout=60))
    assert line.startswith("error:") and "--world-size 9" in line


def test_a_killed_rank_ends_the_job_with_one_line(tmp_path):
    """spawn() (common/distributed.py) starts the ranks: kill rank 1 with SIGKILL once the
    world table names its pid, and the job stops rank 0 and ends with one line, saving nothing."""
    proc = subprocess.Popen([sys.executable, str(lesson_path("09")), "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120",
                                                           "PYTHONUNBUFFERED": "1"})
    watchdog, found = threading.Timer(150, proc.kill), None
    watchdog.start()
    try:
        for line in proc.stdout:
            found = re.match(r"│ 1\s+│ 1\s+│ \S+\s+│ (\d+)", line)  # rank 1's row: its pid
            if found:
                os.kill(int(found[1]), signal.SIGKILL)
                break
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
    assert found, out
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["error: rank 1 died (SIGKILL); the other ranks were stopped"], err
    assert not (tmp_path / "final.pt").exists()
