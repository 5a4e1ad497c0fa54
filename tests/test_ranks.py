"""common/distributed.py's run_ranks, the one way checks, bench and tests start N ranks: every
rank's result, or the failing rank's error, within a timeout, and nothing left behind."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from common.distributed import RankFailed, run_ranks
from conftest import ROOT

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)


def _sum_of_ranks(rank: int, world: int, extra: int) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the ranks are in one group
    return {"rank": rank, "sum": t.item() + extra, "world": dist.get_world_size()}


def _misbehave(rank: int, world: int, how: str) -> None:
    if rank == 1 and how == "raise":
        raise ValueError("rank one   is\nwrong")
    if rank == 1 and how == "die":
        os._exit(3)
    if how == "sleep":
        time.sleep(60)


def _print_pid_and_wait(rank: int, world: int) -> None:
    os.write(1, f"pid {os.getpid()}\n".encode())  # one write: two ranks' lines never mix
    time.sleep(120)


def _collector(rank: int, world: int) -> dict:
    import gc
    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}


def _parent_after_a_parallel_op(rank: int, world: int) -> list:
    torch.set_num_threads(2)
    torch.ones(1 << 22).exp().sum()  # on 2 OpenMP threads
    return [os.getppid(), str(dist.get_debug_level())]


def test_ranks_are_forked_from_a_process_that_said_so_until_it_starts_a_thread():
    """forkable_from_here(), said once the imports are done (common.cli.run before a lesson's
    main(), an exercise check's answer): the ranks are forked from that process itself, no
    fork server. Not while a variable torch reads as it is imported differs (a forked rank
    keeps the value torch was imported with: lesson 12's TORCH_DISTRIBUTED_DEBUG=DETAIL did
    nothing there), and not after a thread more (here OpenMP's, started by a 2-thread
    operation; in lesson 08, the store the parent hosts): then from a fork server, where the
    ranks still compute on 2 threads (forked from that process, their first parallel
    operation waited forever)."""
    code = ("import json, os, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import torch\n"
            "from common.distributed import run_ranks\n"
            "from common.processes import forkable_from_here\n"
            "from test_ranks import _parent_after_a_parallel_op as op\n"
            "forkable_from_here()\n"
            "seen = [run_ranks(op, 2, timeout_s=60)]\n"
            "os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'\n"
            "seen.append(run_ranks(op, 2, timeout_s=60))\n"
            "del os.environ['TORCH_DISTRIBUTED_DEBUG']\n"
            "seen.append(run_ranks(op, 2, timeout_s=60))\n"
            "torch.set_num_threads(2)\n"
            "torch.ones(1 << 22).exp().sum()  # OpenMP's threads start here\n"
            "seen.append(run_ranks(op, 2, timeout_s=60))\n"
            "print(json.dumps([os.getpid(), seen]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ROOT / "tests")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid, seen = json.loads(proc.stdout.strip().splitlines()[-1])
    forked, debug, again, openmp = [[(parent == pid, level) for parent, level in run] for run in seen]
    assert forked == again == [(True, "DebugLevel.OFF")] * 2, seen  # from the process itself
    assert debug == [(False, "DebugLevel.DETAIL")] * 2, seen  # from a fork server, DETAIL on
    assert [itself for itself, _ in openmp] == [False] * 2, seen  # that server again


def test_a_machine_with_a_gpu_driver_keeps_the_fork_server(monkeypatch):
    """CUDA does not survive a fork, and torch.cuda.is_available() alone "poisons fork": where a
    GPU driver is (NVIDIA's /dev/nvidiactl, AMD's /dev/kfd), the ranks come from the server."""
    from common import processes

    monkeypatch.setattr(processes, "_FORKABLE", [1 << 20, processes._read_at_start()])
    monkeypatch.setattr(processes, "_GPU_DRIVERS", (str(ROOT / "no such driver"),))
    assert processes._may_fork_here()  # this test process, as if it had said so
    monkeypatch.setattr(processes, "_GPU_DRIVERS", (str(ROOT),))  # a path that exists
    assert not processes._may_fork_here()


def test_ranks_collect_garbage_but_not_what_the_fork_server_imported():
    """The fork server imports torch with the garbage collector off (common/fork_server_start.py,
    a third of its start-up) and freezes what it imported (common/fork_server_exit.py): every
    rank collects as usual, and never walks torch's objects."""
    for got in run_ranks(_collector, 2, (), timeout_s=120):
        assert got["enabled"] and got["frozen"] > 100_000, got


def test_run_turns_the_collector_back_on_before_main():
    """A lesson's script imports torch with the collector off (common/__init__.py); common.cli.run
    freezes what was imported and turns it back on before the lesson's main() runs."""
    import gc

    from common.cli import run

    from common import processes

    seen = {}
    gc.disable()
    try:
        run(lambda: seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count()))
    finally:
        gc.enable()
        gc.unfreeze()
        processes._FORKABLE.clear()  # run() said so for this test process: its ranks must
        # still come from a fork server (this process has started OpenMP's threads)
    assert seen["enabled"] and seen["frozen"] > 0, seen


def test_every_ranks_result_by_rank():
    got = run_ranks(_sum_of_ranks, 3, (10,), timeout_s=120)
    assert got == [{"rank": r, "sum": 13.0, "world": 3} for r in range(3)]


@pytest.mark.parametrize("how", ["raise", "die", "sleep"])
def test_the_failing_rank_is_named(how):
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        # (a whole run's limit of 5 s: what is tested is that the limit ends it, and the test
        # worker waits for it with nothing else to do)
        run_ranks(_misbehave, 2, (how,), timeout_s=5 if how == "sleep" else 120)
    f = failed.value
    if how == "raise":
        assert (f.kind, f.rank, f.error) == ("raised", 1, "ValueError")
        assert f.text == "rank one   is\nwrong" and "rank one is wrong" in str(f)
        assert any(file == __file__ for file, _ in f.frames)  # where it was raised
    elif how == "die":
        assert (f.kind, f.rank, f.code) == ("died", 1, 3)
    else:
        assert f.kind == "timeout" and "did not finish within 5s" in str(f)
        assert time.monotonic() - started < 45  # the sleeping ranks (60 s) were not waited for


def _killed_mid_collective(rank: int, world: int, victim: int) -> None:
    """Every rank all-reduces in a loop; `victim` is killed (SIGKILL) in the middle."""
    for i in range(10_000):
        if rank == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1000))


@pytest.mark.parametrize("victim", [0, 1])
def test_the_killed_rank_is_blamed_not_the_peer_it_left_behind(victim):
    """A rank killed in a collective says nothing; its peer then fails ("Connection reset by
    peer") and says so first. The job must name the dead rank (issue 26: lessons 15-19
    named the survivor in 13 of 13 runs)."""
    with pytest.raises(RankFailed) as failed:
        run_ranks(_killed_mid_collective, 2, (victim,), timeout_s=60)
    f = failed.value
    assert (f.kind, f.rank, f.code) == ("died", victim, -signal.SIGKILL), str(f)


def test_a_parent_killed_with_sigkill_takes_its_ranks():
    """The ranks are forked by multiprocessing's fork server: they must not outlive it, and
    it must not outlive the process that called run_ranks."""
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "from common.distributed import run_ranks\n"
            "from test_ranks import _print_pid_and_wait\n"
            "run_ranks(_print_pid_and_wait, 2, timeout_s=300)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(ROOT / "tests")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        pids = [int(parent.stdout.readline().split()[1]) for _ in range(2)]
    finally:
        parent.kill()
        parent.wait(timeout=30)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
            return f.read().split(")")[-1].split()[0] != "Z"

    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)  # do not leave them to the next test
    assert not left, f"ranks {left} outlived their killed parent"
