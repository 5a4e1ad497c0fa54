"""Lesson 12: every pitfall fixed by default; every --break mode ends on its own, in bound."""
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, make_lesson, one_error_line, run, run_lesson

pytestmark = pytest.mark.timeout(900)  # the module fixture below runs 14 jobs in one setup
BOUND_S = 60  # the promise: no broken mode takes longer, start-up included, on 2 cores

# (case id, flags, expected exit code). Errors exit 1; silent bugs exit 0 with wrong numbers.
# A hang (mostly waiting) sits next to a busy case: they run two at a time below.
CASES = [
    ("collective-missing", ["--break", "collective-missing"], 1),
    ("default", [], 0),
    ("collective-order", ["--break", "collective-order"], 1),
    ("set-epoch", ["--break", "set-epoch"], 0),
    ("same-seed", ["--break", "same-seed"], 0),
    ("busy-port", ["--break", "busy-port"], 1),
    ("rank-crash", ["--break", "rank-crash"], 1),
    ("unused-params", ["--break", "unused-params"], 1),
    ("batchnorm", ["--break", "batchnorm"], 0),
    ("eval-padding", ["--break", "eval-padding"], 0),
    ("save-every-rank", ["--break", "save-every-rank"], 1),
    ("no-barrier", ["--break", "no-barrier"], 1),
    ("collective-order-detail", ["--break", "collective-order", "--debug-detail"], 1),
    ("default-3-ranks", ["--world-size", "3"], 0),
]
BROKEN = [case for case in CASES if "--break" in case[1]]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Run every case once, two at a time (the hang cases mostly wait), each one timed.

    Two at once load the 2 cores more than a learner's single run does, so the time bound
    is checked under harder conditions than the promise needs.
    """
    # the folders first, from this thread: two threads making pytest's first temporary
    # folder of this worker at once collide (FileExistsError, seen under pytest-xdist)
    folders = {case[0]: tmp_path_factory.mktemp(case[0]) for case in CASES}

    def one(case):
        name, flags, _ = case
        out = folders[name]
        start = time.monotonic()
        try:
            # the default run as a learner starts it (make, a new Python); the others forked
            launch = make_lesson if name == "default" else run_lesson
            proc = launch("12", *flags, "--out", out, check=False, timeout=2 * BOUND_S)
        except subprocess.TimeoutExpired as exc:  # reported by the test, not as a crash here
            text = [t.decode(errors="replace") if isinstance(t, bytes) else (t or "")
                    for t in (exc.stdout, exc.stderr)]  # run() may hand back bytes here
            proc = subprocess.CompletedProcess(exc.cmd, None, *text)
        return name, (proc, time.monotonic() - start, out)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, CASES))


def metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("name,flags,code", BROKEN, ids=[c[0] for c in BROKEN])
def test_every_broken_mode_ends_in_bound_and_explains_itself(broken, name, flags, code):
    proc, seconds, _ = broken[name]
    report = f"{name}: exit {proc.returncode} after {seconds:.1f}s\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    assert seconds < BOUND_S, report
    assert proc.returncode == code, report
    assert "Traceback" not in proc.stdout + proc.stderr, report
    mode = flags[1]
    paragraph = proc.stdout.split(f"What went wrong (--break {mode};", 1)
    assert len(paragraph) == 2, report
    for word in ("Symptom:", "Cause:", "Fix:"):
        assert word in paragraph[1], report
    if code:  # the job's last word is one line on stderr that names the failing rank
        assert re.search(r"^error: rank \d+ (exited with code 1|failed with)", proc.stderr, re.M), report


def test_set_epoch_forgotten_repeats_the_order(broken):
    proc, _, out = broken["set-epoch"]
    orders = re.findall(r"^  epoch (\d+): (\[.*\])$", proc.stdout, re.M)
    assert len(orders) == 3 and len({o for _, o in orders}) == 1, proc.stdout
    m = metrics(out)["set_epoch"]
    assert m["same_every_epoch"] is True
    assert m["distinct_seen_by_rank_0"] == 1536  # half of 3072, the same half every epoch


def test_same_seed_gives_every_rank_the_same_noise(broken):
    proc, _, out = broken["same-seed"]
    rows = re.findall(r"^  rank (\d): (\[.*\]) \.\.\.$", proc.stdout, re.M)
    assert len(rows) == 2 and rows[0][1] == rows[1][1], proc.stdout
    assert metrics(out)["same_seed"]["distinct_noise_vectors"] == 48


def test_hang_ends_at_the_timeout_and_names_the_collective(broken):
    proc, _, _ = broken["collective-missing"]
    waits = re.findall(r"\[rank (\d)\] (all_reduce\(loss_sum\) \(only rank 0 calls it\)|barrier\(\)) "
                       r"gave up after ([\d.]+)s: .*Timed out waiting 10000ms", proc.stdout)
    assert waits, proc.stdout
    for _, _, seconds in waits:
        assert 9.5 <= float(seconds) <= 20, waits  # the 10 s --timeout, not forever


def test_collectives_in_another_order_swap_values_silently_then_hang(broken):
    proc, _, _ = broken["collective-order"]
    assert "(no error was raised)" in proc.stdout
    sums = [float(s) for s in re.findall(r"^  rank \d: loss_sum\s+([\d.]+)", proc.stdout, re.M)]
    right = float(re.search(r"^  right:  loss_sum\s+([\d.]+)", proc.stdout, re.M).group(1))
    assert len(sums) == 2 and all(abs(s - right) > 1 for s in sums), proc.stdout
    assert re.search(r"(all_reduce\(loss_sum\)|broadcast\(weights\)) gave up after [\d.]+s: "
                     r".*Timed out waiting 10000ms", proc.stdout), proc.stdout


def test_debug_detail_names_the_mismatch_at_once_but_not_the_swap(broken):
    proc, _, _ = broken["collective-order-detail"]
    assert "(no error was raised)" in proc.stdout  # the same-shaped swap still passes DETAIL
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in proc.stdout
    found = re.findall(r"gave up after ([\d.]+)s: Detected mismatch between collectives on ranks",
                       proc.stdout)
    assert found and all(float(s) < 5 for s in found), proc.stdout  # well before the 10 s timeout
    assert "Rank 0 is running collective: CollectiveFingerPrint" in proc.stdout or \
        "Rank 1 is running collective: CollectiveFingerPrint" in proc.stdout
    # the closing explanation says what this run did: failed at once, not hung
    explanation = " ".join(proc.stdout.split("What went wrong", 1)[1].split())  # unwrapped
    assert "failed both at once" in explanation and "hung until" not in explanation


def test_unused_parameters_give_ddps_real_error(broken):
    proc, _, _ = broken["unused-params"]
    assert "Expected to have finished reduction in the prior iteration" in proc.stdout
    assert "aux.weight, aux.bias" in proc.stdout
    assert "step 1: DDP raised RuntimeError" in proc.stdout  # the forward *after* the bad step


def test_batchnorm_per_rank_statistics_disagree(broken):
    m = metrics(broken["batchnorm"][2])["batchnorm"]
    assert m["ranks_agree"] is False
    assert m["max_diff_running_stats"] > 1e-3 and m["max_diff_batch_mean"] > 1e-2


def test_eval_padding_counts_samples_twice(broken):
    proc, _, out = broken["eval-padding"]
    m = metrics(out)["eval"]
    assert m["samples"] == 101 and m["predictions"] == 102  # 2 ranks x 51: sample 0 twice
    assert m["distributed_accuracy"] != m["one_process_accuracy"]
    assert "samples [0] twice" in proc.stdout


def test_saving_races_fail_the_way_the_doc_says(broken):
    proc, _, _ = broken["save-every-rank"]
    assert re.search(r"\[rank 0\] torch\.load\(.*\) while rank 1 is still writing it: \w+", proc.stdout)
    assert "rank 0 exited with code 1" in proc.stderr  # the reader is the one that fails
    proc, _, _ = broken["no-barrier"]
    assert "no barrier: FileNotFoundError" in proc.stdout
    assert "rank 1 exited with code 1" in proc.stderr


def test_busy_port_and_crash_name_the_cause(broken):
    proc, _, _ = broken["busy-port"]
    assert "is already in use" in proc.stdout  # common.distributed's one-line check
    assert "EADDRINUSE" in proc.stdout  # what the store says without it
    proc, _, _ = broken["rank-crash"]
    assert "rank 1 failed with RuntimeError: rank 1 crashed on purpose" in proc.stderr


def test_default_run_fixes_every_pitfall(broken):
    proc, seconds, out = broken["default"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(n) for n in re.findall(r"^Step (\d+):", proc.stdout, re.M)]
    assert steps == list(range(1, 11)), proc.stdout
    assert "\x1b[" not in proc.stdout and "What went wrong" not in proc.stdout
    m = metrics(out)
    assert m["break"] is None and m["world_size"] == 2
    assert m["set_epoch"]["same_every_epoch"] is False
    assert m["set_epoch"]["distinct_seen_by_rank_0"] > 2000  # 3 epochs, 3 different halves
    assert m["same_seed"]["distinct_noise_vectors"] == 96
    assert m["collectives"]["count"] == 96
    assert abs(m["collectives"]["mean_loss"] - m["collectives"]["one_process_loss"]) < 1e-5
    assert m["unused_params"]["ms_per_step_with"] > 0 and m["unused_params"]["ms_per_step_without"] > 0
    assert m["batchnorm"]["ranks_agree"] is True
    assert m["batchnorm"]["max_diff_running_stats"] < 1e-5
    assert m["eval"]["predictions"] == m["eval"]["samples"] == 101
    assert m["eval"]["distributed_accuracy"] == m["eval"]["one_process_accuracy"]  # exactly
    assert m["saving"] == {"writes": 1, "max_diff_after_load": 0.0}
    assert (out / "checkpoint.pt").exists()
    assert seconds < 90, f"the default run took {seconds:.1f}s"


def test_three_ranks_split_without_padding(broken):
    """World size is a flag like any other: 3 ranks evaluate 34 + 34 + 33 samples."""
    proc, _, out = broken["default-3-ranks"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(out)
    assert m["world_size"] == 3 and m["eval"]["predictions"] == 101
    assert m["eval"]["distributed_accuracy"] == m["eval"]["one_process_accuracy"]
    assert m["same_seed"]["distinct_noise_vectors"] == 96
    assert m["batchnorm"]["max_diff_running_stats"] < 1e-5 and m["saving"]["writes"] == 1


@pytest.mark.parametrize("flags,expect", [
    (["--world-size", "1"], "--world-size 1"),
    (["--device", "cuda"], "--device cpu"),
    (["--debug-detail"], "TORCH_DISTRIBUTED_DEBUG=DETAIL"),
    (["--break", "no-such-pitfall"], "--break"),
    (["--only", "saving", "--break", "set-epoch"], "--only saving"),
])
def test_bad_flags_are_one_clear_line(flags, expect):
    line = one_error_line(run_lesson("12", *flags, check=False, timeout=60))
    assert line.startswith("error:") and expect in line, line


def test_a_pitfall_file_runs_on_its_own(tmp_path):
    """lessons/12_pitfalls/NAME.py: the lesson's Steps 1, 2 and 10, and that file's step only."""
    folder = ROOT / "lessons" / "12_pitfalls"
    for path in folder.glob("*.py"):  # every file but the helpers names its step and modes
        if path.stem not in ("kit", "start"):
            text = path.read_text()
            assert re.search(r"^STEP = \d$", text, re.M) and "def run(" in text, path.name
    proc = run([sys.executable, str(folder / "set_epoch.py"), "--break", "set-epoch", "--out",
                str(tmp_path)], timeout=2 * BOUND_S)
    steps = [int(n) for n in re.findall(r"^Step (\d+):", proc.stdout, re.M)]
    assert steps == [1, 2, 3, 10], proc.stdout
    m = metrics(tmp_path)
    assert m["set_epoch"]["same_every_epoch"] is True and "eval" not in m
    assert "What went wrong (--break set-epoch;" in proc.stdout
