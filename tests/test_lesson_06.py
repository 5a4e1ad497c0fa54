"""Lesson 06: the same script under two simulated nodes, plain torchrun, and plain python.

Each `python ...` command here is forked from the test zygote (tests/zygote.py); the agents
tools/nodes.py starts and the workers each agent starts are new Pythons, as on a learner's
machine (about 3 CPU s of imports apiece). Beyond make lesson-06's own command (2 nodes x 2
workers, the Makefile's RUN_06) the jobs are as small as their claim allows: plain torchrun
with 2 workers, the crash with one worker per node."""
import sys
import time
from pathlib import Path

from common import recipe
from conftest import load_run, make_command, max_abs_diff, run, run_lesson

NODES = [sys.executable, "tools/nodes.py"]
LESSON = "lessons/06_torchrun_multinode.py"


def own_tmpdir(tmp_path: Path) -> dict:
    """An empty $TMPDIR for one command. A torchrun agent makes a folder there and leaves it
    behind (torchelastic_...); tools/nodes.py gives its agents one in the job's folder instead,
    removed when the job ends: see left_in()."""
    (tmp_path / "tmp").mkdir()
    return {"TMPDIR": str(tmp_path / "tmp")}


def left_in(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").iterdir())


def test_make_lesson_06_runs_two_nodes_and_matches_one_device(tmp_path, reference_3_epochs):
    # make lesson-06's command (the agents and workers it starts are new Pythons)
    proc = run(make_command("06", "--out", tmp_path / "out"), timeout=240, env=own_tmpdir(tmp_path))
    assert left_in(tmp_path) == []
    assert not (tmp_path / "out" / "nodes" / "tmp").exists()
    state, metrics = load_run(tmp_path / "out")
    assert metrics["world_size"] == 4 and metrics["nodes"] == 2
    # static rendezvous: global rank = node * nproc_per_node + local rank
    assert [(r["rank"], r["node"], r["local_rank"]) for r in metrics["ranks"]] == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4
    assert "torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1" in proc.stdout  # shown to copy
    assert "terminate called" not in proc.stderr


def test_plain_torchrun_standalone_and_plain_python(tmp_path):
    # the agent is forked from the test's zygote (python -m ...); its 2 workers are new Pythons
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         LESSON, "--epochs", "1", "--out", tmp_path / "tr"], timeout=180,
        env=own_tmpdir(tmp_path))  # its torchelastic_... folder lands there, not in /tmp
    state, metrics = load_run(tmp_path / "tr")
    assert metrics["world_size"] == 2 and metrics["nodes"] == 1
    reference = recipe.train_reference(epochs=1)
    assert max_abs_diff(state, reference) <= 1e-4
    proc = run_lesson("06", "--epochs", "1", "--out", tmp_path / "py")
    assert "a world of one" in proc.stdout
    assert max_abs_diff(load_run(tmp_path / "py")[0], reference) <= 1e-4


def test_a_missing_node_times_out_with_a_clear_message(tmp_path):
    start = time.time()
    proc = run([*NODES, "--nnodes", "2", "--only-node", "0", "--rdzv-timeout", "3", "--",
                LESSON, "--out", tmp_path], check=False, timeout=120)
    assert time.time() - start < 60
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: node 0 waited 3 s") and "only 1 of 2 nodes" in last


def test_a_crashing_worker_is_named_and_stops_every_node(tmp_path):
    """One worker per node (make lesson-06 above checks the 2 x 2 rank layout): node 1's
    rank 1 crashes; node 0's rank 0 and both agents must stop, and the summary names it."""
    start = time.time()
    proc = run([*NODES, "--nnodes", "2", "--nproc-per-node", "1", "--", LESSON,
                "--crash-rank", "1", "--out", tmp_path / "out"], check=False, timeout=180,
               env=own_tmpdir(tmp_path))
    assert left_in(tmp_path) == []
    assert time.time() - start < 120
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "rank 1 on node 1 failed first: RuntimeError: deliberate crash" in last
    assert not (tmp_path / "out" / "final.pt").exists()
