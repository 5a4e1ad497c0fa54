"""Checked exercises: each check fails on the shipped starter and passes on a real solution,
and a file that tries to fool it does not.

A check that passes on the starter could not tell a learner anything; one that fails on the
solution would reject correct work. Both directions are tested for every checked exercise,
with the command a learner or a teacher types (tools/check_exercise.py NN [FILE]). Then the
tricks issue 35 found, each in a file of its own: the check must say "not yet" in one line,
within a bound, and leave no process of the answer running.
"""
import os
import re
import signal
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "tools"))
from check_exercise import IMPORT_LIMIT_S, all_checks  # noqa: E402

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

CHECKS = all_checks()

CHECK = [sys.executable, "tools/check_exercise.py"]


def check_cli(number: str, path: Path | None, timeout: float = 600) -> tuple[int, str]:
    """`tools/check_exercise.py NN FILE`, as a teacher runs it, or `tools/check_exercise.py NN`
    (path None: the exercise's own file, as `make check-NN` runs it for a learner): (exit
    code, stdout + stderr)."""
    proc = run([*CHECK, number, *([] if path is None else [str(path)])], check=False, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


NUMBERS = sorted(CHECKS)


@pytest.mark.parametrize("number", NUMBERS)
def test_starter_is_not_yet_right(number):
    """What a learner types first (`make check-NN`, no FILE: the starter in exercises/, in a
    process of its own): "not yet", exit code 1, one line."""
    code, text = check_cli(number, None)
    assert code == 1, text
    assert text.startswith("not yet: ") and "Traceback" not in text and text.count("\n") == 1, text


@pytest.mark.parametrize("number", NUMBERS)
def test_reference_solution_passes_wherever_it_is(number, tmp_path):
    """A teacher checks a learner's copy from anywhere (make check-15 FILE=~/ana.py): the
    solution, copied outside the repository, passes (exercise 15's starter once found lesson
    15 through its own path, and a correct answer elsewhere failed with StopIteration)."""
    starter = ROOT / CHECKS[number][0]
    copy = tmp_path / "submissions" / f"ana_{starter.name}"
    copy.parent.mkdir()
    copy.write_text((ROOT / "tests" / "solutions" / starter.name).read_text())
    code, text = check_cli(number, copy)
    assert code == 0 and text.startswith("ok: ") and text.count("\n") == 1, text


def test_every_lesson_from_05_has_a_checked_exercise():
    lessons = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    missing = [n for n in lessons if n >= "05" and n not in CHECKS]
    assert not missing, f"lessons without a checked exercise: {missing}"


def test_make_check_and_unknown_lesson():
    out = run(["make", "-s", "checks"]).stdout
    assert all(f"make check-{n}" in out for n in CHECKS)
    proc = run([*CHECK, "99"], check=False)
    assert proc.returncode == 2 and "has no checked exercise" in proc.stderr


# --- a file that tries to fool the check (issue 35) --------------------------------------------

def hostile(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / "submissions" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def not_yet(code: int, text: str, *fragments: str) -> str:
    """One line, "not yet: ...", exit code 1, no traceback: the verdict, and nothing else."""
    assert code == 1 and text.startswith("not yet: ") and text.count("\n") == 1, (code, text)
    assert "Traceback" not in text and "ok:" not in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


@pytest.mark.parametrize("number, name", [("05", "05_set_epoch.py"), ("24", "24_outer_step.py")])
def test_ok_printed_and_exit_0_at_import_is_not_yet(number, name, tmp_path):
    """print("ok: passed"); os._exit(0) passed checks 21-24 (and any check that loaded the
    file in its own process): the exit status and the output were the verdict."""
    path = hostile(tmp_path, name, """\
        import os
        print("ok: passed", flush=True)
        os._exit(0)
        """)
    not_yet(*check_cli(number, path), "ended the check's process (exit code 0) before the check had its results")


def test_system_exit_0_at_import_is_not_yet(tmp_path):
    """SystemExit(0) at import passed silently (exit code 0, no line at all)."""
    path = hostile(tmp_path, "05_set_epoch.py", "raise SystemExit(0)\n")
    not_yet(*check_cli("05", path), "exits as it is imported (SystemExit(0))")


def test_an_atexit_handler_cannot_replace_the_verdict(tmp_path):
    """An atexit handler ran in the checker after its "not yet", printed "ok:" and exited 0."""
    path = hostile(tmp_path, "05_set_epoch.py", """\
        import atexit
        import os


        def lie():
            print("\\rok: every epoch has a new order", flush=True)
            os._exit(0)


        atexit.register(lie)


        def epoch_orders(size, world, rank, epochs):
            return [list(range(rank, size, world)) for _ in range(epochs)]
        """)
    not_yet(*check_cli("05", path), "reads the same order in two epochs")


def test_patching_random_in_the_answer_does_not_choose_the_straggler(tmp_path, monkeypatch):
    """Check 20 draws the slow rank with random.choice; an answer loaded in the checker's own
    process replaced it, always drew rank 1, and answered 1. The draw is the check's alone now
    (here it draws rank 2, as it does half of the time)."""
    import check_20
    from check_exercise import NotYet

    monkeypatch.setattr(check_20.random, "choice", lambda seq: seq[-1])
    path = hostile(tmp_path, "20_slowest_rank.py", """\
        import random

        random.choice = lambda seq: seq[0]


        def slowest_rank(traces):
            return 1
        """)
    with pytest.raises(NotYet, match="rank 2 slept .* but slowest_rank answered 1"):
        check_20.check(path)


def test_the_expected_value_is_not_in_any_frame_the_answer_can_read(tmp_path):
    """Check 10's ranks held dist.all_reduce's sums in the caller's frame; a ring that copied
    them from there (and sent nothing) passed. The sums are made by the check, elsewhere."""
    path = hostile(tmp_path, "10_ring_all_reduce.py", """\
        import sys


        def ring_all_reduce(tensor):
            frame = sys._getframe(1)
            while frame is not None:  # the caller's answer, under any of the usual names
                for name in ("expected", "want", "truth", "whole", "reference"):
                    value = frame.f_locals.get(name)
                    if getattr(value, "shape", None) == tensor.shape:
                        tensor.copy_(value)
                        return
                frame = frame.f_back
        """)
    not_yet(*check_cli("10", path), "result differs from dist.all_reduce's")


def test_a_sleep_at_import_and_a_function_that_never_returns_are_stopped_in_time(tmp_path):
    """The keeper is another process with its own clock: an answer that sleeps as it is
    imported is stopped at IMPORT_LIMIT_S, a function that never returns at the probe's limit
    (30 s for check 18), each with its own one line. The function waits, not spins (a
    spinning loop took a whole core for the 30 s, from every other test of the suite). The
    two checks run at once: each mostly waits for its limit."""
    asleep = hostile(tmp_path, "05_set_epoch.py", "import time\ntime.sleep(3600)\n")
    endless = hostile(tmp_path, "18_one_f_one_b.py", """\
        import time


        def schedule(p, m):
            while True:
                time.sleep(1)
        """)

    def timed(number, path, timeout):
        start = time.monotonic()
        return check_cli(number, path, timeout=timeout), time.monotonic() - start

    with ThreadPoolExecutor(max_workers=2) as pool:
        at_import = pool.submit(timed, "05", asleep, IMPORT_LIMIT_S + 90)
        in_probe = pool.submit(timed, "18", endless, IMPORT_LIMIT_S + 120)
        (import_verdict, import_s), (probe_verdict, probe_s) = at_import.result(), in_probe.result()
    not_yet(*import_verdict, f"did not finish importing within {IMPORT_LIMIT_S}s")
    assert import_s < IMPORT_LIMIT_S + 60
    not_yet(*probe_verdict, "the check stopped your code after 30s")
    assert probe_s < IMPORT_LIMIT_S + 90


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the keeper's subreaper is Linux's")
def test_every_process_the_answer_started_ends_with_the_check(tmp_path):
    """Processes an answer forked outlived the check (3 left after check-24; a daemonised fork
    survived). A plain fork, a daemon (fork, setsid, fork) and another program in a session of
    its own, each ignoring SIGTERM, started at import: in the answer's process and in each of
    its ranks. None is left once the check has answered."""
    path = hostile(tmp_path, "24_outer_step.py", """\
        import os
        import signal
        import subprocess
        import time
        from pathlib import Path

        PIDS = Path(__file__).with_suffix(".pids")


        def note(pid):
            with open(PIDS, "a") as f:
                f.write(f"{pid}\\n")


        def forever():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(0.2)


        if os.fork() == 0:  # a plain fork
            note(os.getpid())
            forever()
        if os.fork() == 0:  # a daemon
            os.setsid()
            if os.fork() == 0:
                note(os.getpid())
                forever()
            os._exit(0)
        note(subprocess.Popen(["sleep", "1000"], start_new_session=True).pid)


        def outer_step(model, outer, optimizer):
            pass  # not the answer: the check says so, and ends everything above
        """)
    not_yet(*check_cli("24", path), "with 2 ranks")
    pids = [int(p) for p in path.with_suffix(".pids").read_text().split()]
    assert len(pids) >= 9, pids  # three in the answer's process, three in each of its 2 ranks
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # (so that a failure leaves nothing behind either)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the check: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task, as the harness does")
def test_ranks_are_forked_from_the_answer_unless_its_file_started_openmp(tmp_path):
    """The answer forks its ranks itself (no fork server importing torch again: about 2.5 s of
    CPU per check), but only while it has no thread its imports did not start. A file that
    computes on 2 threads as it is imported has started OpenMP's, which a fork breaks (the
    ranks' first parallel operation waited forever, and check-10 hung): its ranks come from a
    fork server, and the solution still passes. Each file notes the answer's pid as it is
    imported there, and each rank its parent's."""
    note = """\
        import multiprocessing
        import os
        from pathlib import Path

        _ring = ring_all_reduce
        _NOTES = Path(__file__).with_suffix(".pids")


        def ring_all_reduce(tensor):
            with open(_NOTES, "a") as f:
                f.write(f"rank {os.getppid()}\\n")
            return _ring(tensor)


        if multiprocessing.parent_process() is None:  # the answer's process, not a rank
            with open(_NOTES, "a") as f:
                f.write(f"answer {os.getpid()}\\n")
        """
    openmp = """\
        import torch
        torch.set_num_threads(2)
        torch.ones(1 << 20).exp()  # OpenMP's threads start here
        """
    solution = (ROOT / "tests" / "solutions" / "10_ring_all_reduce.py").read_text()
    files = {}
    for name, added in (("plain", ""), ("openmp", openmp)):
        (tmp_path / name).mkdir()
        files[name] = hostile(tmp_path / name, "10_ring_all_reduce.py",
                              solution + textwrap.dedent(added) + textwrap.dedent(note))
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = dict(zip(files, pool.map(lambda p: check_cli("10", p, timeout=300), files.values())))
    for name, path in files.items():
        code, text = verdicts[name]
        assert code == 0 and text.startswith("ok: "), (name, text)
        notes = [line.split() for line in path.with_suffix(".pids").read_text().splitlines()]
        [answer] = [int(pid) for kind, pid in notes if kind == "answer"]
        parents = {int(pid) for kind, pid in notes if kind == "rank"}
        assert parents == {answer} if name == "plain" else answer not in parents, (name, answer, parents)


def test_ranks_that_exit_0_are_one_line(tmp_path):
    """check-24 whose ranks exit 0 in outer_step: a TypeError traceback in the checker
    (check_24.py:90) before."""
    path = hostile(tmp_path, "24_outer_step.py", """\
        import os


        def outer_step(model, outer, optimizer):
            os._exit(0)
        """)
    not_yet(*check_cli("24", path), "with 2 ranks, rank 0 ended (exit code 0) before it returned its results")


def test_an_answer_that_returns_the_wrong_kind_of_thing_is_one_line(tmp_path):
    path = hostile(tmp_path, "05_set_epoch.py", """\
        def epoch_orders(size, world, rank, epochs):
            return None
        """)
    text = not_yet(*check_cli("05", path), "your code raised TypeError")
    assert re.search(r"\(05_set_epoch.py, line \d+\)", text) or "NoneType" in text, text


def test_check_29_counts_the_calls_of_compiled_code(tmp_path):
    """check-29: the first batch through `compiled`, the others through the plain model behind
    it: one graph, no recompile, the right outputs, and still not yet (the backend counts the
    calls of compiled code)."""
    path = hostile(tmp_path, "29_one_graph.py", """\
        def run_batches(compiled, batches):
            return [compiled(batches[0])] + [compiled._orig_mod(x) for x in batches[1:]]
        """)
    not_yet(*check_cli("29", path), "compiled code ran for 1 of the 4 batches")


def test_check_28_works_out_the_truth_from_the_learners_seed(tmp_path):
    """check-28, for a teacher who hands out --seed 7 --world-size 4: the truth comes from that
    SEED (rank 1 frozen there, not seed 0's rank 1 stuck in Python); the seed-0 answer is not
    yet, the right one, written as a learner might, is ok."""
    import hang_faults  # lessons/28_hang_lab/, on the path by conftest

    truth = hang_faults.truth(hang_faults.mystery(7, 4, 8))
    assert truth["operation"] != "get"  # another hang than seed 0's, or this proves nothing
    seed_0 = (ROOT / "tests" / "solutions" / "28_hang_mystery.py").read_text()
    path = hostile(tmp_path, "28_hang_mystery.py", seed_0.replace("SEED = 0", "SEED = 7").replace(
        "WORLD_SIZE = 3", "WORLD_SIZE = 4"))
    not_yet(*check_cli("28", path), "SEED 7: rank 1 is right; 'Queue.get' is not the call that went wrong")
    path.write_text(f'SEED = 7\nWORLD_SIZE = 4\nRANK = {truth["rank"]}\nOPERATION = "dist.{truth["operation"]}()"\n'
                    f'WHERE = "{truth["where"].replace("lessons/", "/home/ana/dist/lessons/")}"\n')
    code, text = check_cli("28", path)
    assert code == 0 and text.startswith(f"ok: SEED 7: rank {truth['rank']}, {truth['operation']} at "), text
