"""tools/gpu_check.py (make gpu-check), without a GPU: the no-CUDA line, the plans for 1, 2 and
8 GPUs, the weight comparison, the timeout that kills a whole process group and goes on, and
the whole pipeline end to end with the CPU as the device under test (lesson 01 twice)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, import_lesson, parse_error, run

TOOL = ROOT / "tools" / "gpu_check.py"
NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a machine that has one


def load_tool():
    from tools import gpu_check
    return gpu_check


gc = load_tool()
LESSONS = [f"{n:02d}" for n in range(1, 25)]


@pytest.fixture(autouse=True)
def lessons_01_to_24(monkeypatch):
    """Plan the lessons SPECS knows: one newer than it costs its --help (seconds each), which
    its own test below checks once."""
    monkeypatch.setattr(gc, "lesson_numbers", lambda: LESSONS)


def flag(run_, name):
    """The value after `name` in a run's command (None if absent)."""
    return run_.argv[run_.argv.index(name) + 1] if name in run_.argv else None


def plan_for(gpus, tmp_path):
    return {c.lesson: c for c in gc.build_plan(gpus, "cuda", tmp_path)}


# --- no CUDA, dry run ---------------------------------------------------------------

NO_CUDA_LINE = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"


def test_without_cuda_it_says_so_in_one_line_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [NO_CUDA_LINE] and not err
    assert not (tmp_path / "out").exists()  # nothing run, nothing written


def test_make_gpu_check_without_cuda_is_the_same_one_line():
    proc = subprocess.run(["make", "-s", "gpu-check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **NO_CUDA}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [NO_CUDA_LINE] and not proc.stderr.strip()


@pytest.mark.parametrize("gpus", [1, 2])
def test_dry_run_prints_a_command_for_every_lesson_and_the_estimate(gpus, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--dry-run", "--gpus", str(gpus)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"gpu-check: {gpus} GPU") and " about " in lines[0], lines[0]
    for num in LESSONS:
        lesson = str(next((ROOT / "lessons").glob(f"{num}_*.py")).relative_to(ROOT))
        commands = [x.split() for x in lines if lesson in x.split() and "--out" in x.split()]
        assert commands, f"no command for lesson {num}"
        for words in commands:  # runnable as printed: this Python, a path from the repo root
            assert words[0] == gc.shown_path(sys.executable)
            assert words[words.index("--out") + 1].startswith("runs/gpu-check/runs/")
    if gpus == 1:
        assert any("--world-size 1" in x and "--device cuda" in x and "05_ddp_spawn" in x for x in lines)
    else:
        assert any("--world-size 2" in x and "--device cuda" in x and "05_ddp_spawn" in x for x in lines)


def test_one_gpu_plan_runs_each_distributed_lesson_at_world_size_1_on_nccl(tmp_path):
    plan = plan_for(1, tmp_path)
    assert sorted(plan) == LESSONS
    for num in ("05", "08", "09", "14", "15", "16", "17", "18", "20"):
        gpu, cpu = plan[num].runs
        assert (flag(gpu, "--device"), flag(gpu, "--world-size"), plan[num].backend) == ("cuda", "1", "nccl"), num
        assert (flag(cpu, "--device"), flag(cpu, "--world-size")) == ("cpu", "1"), num
        assert plan[num].tolerance == (1e-3 if int(num) <= 12 else 1e-2)
    for num in ("01", "04", "13"):
        assert flag(plan[num].runs[0], "--device") == "cuda" and len(plan[num].runs) == 2
    # lesson 06 and 07 through tools/nodes.py, one rank
    assert plan["06"].runs[0].argv[2:7] == ["--nnodes", "1", "--nproc-per-node", "1", "--"]
    assert "--elastic" in plan["07"].runs[0].argv and flag(plan["07"].runs[0], "--nproc-per-node") == "1"
    assert (flag(plan["19"].runs[0], "--dp"), flag(plan["19"].runs[0], "--tp")) == ("1", "1")
    # 03 needs 2 GPUs for nn.DataParallel: the table says so, and records what auto did
    assert flag(plan["03"].runs[0], "--device") == "auto" and "needs 2 GPUs" in plan["03"].note
    # 02 writes no final.pt: one run; 10, 11, 12 refuse cuda: one run with auto
    assert len(plan["02"].runs) == 1 and plan["02"].tolerance is None
    for num in ("10", "11", "12"):
        assert len(plan[num].runs) == 1 and flag(plan[num].runs[0], "--device") == "auto"
    # 16's checkpoint goes into the run's own folder, not runs/lesson-16
    assert flag(plan["16"].runs[0], "--checkpoint") == str(tmp_path / "16-gpu" / "checkpoint")
    assert gc.plan_seconds(list(plan.values())) <= 8 * 60


def test_a_lesson_needing_more_ranks_than_gpus_runs_them_on_the_cpu_and_says_so(tmp_path):
    """Lesson 27 needs 2 ranks (HSDP's replicas, a 2-stage pipeline) and NCCL puts one rank on
    each GPU: with 1 GPU its 2 ranks run on the CPU (one run, no comparison), the note says so."""
    check = gc.build_plan(1, "cuda", tmp_path, only=["27"])[0]
    assert [flag(check.runs[0], f) for f in ("--device", "--world-size")] == ["cpu", "2"]
    assert len(check.runs) == 1 and check.tolerance is None and "needs 2 GPUs" in check.note
    two = gc.build_plan(2, "cuda", tmp_path, only=["27"])[0]
    assert flag(two.runs[0], "--device") == "cuda" and two.backend == "nccl" and len(two.runs) == 2


def test_two_and_eight_gpu_plans_put_one_rank_on_each_gpu(tmp_path):
    two, eight = plan_for(2, tmp_path), plan_for(8, tmp_path)
    for num in ("05", "08", "09", "14", "15", "16", "17", "18", "20"):
        assert flag(two[num].runs[0], "--world-size") == "2" and two[num].backend == "nccl", num
        assert flag(two[num].runs[1], "--world-size") == "2", num  # the CPU run: the same world
    assert flag(eight["05"].runs[0], "--world-size") == "8"
    assert flag(eight["17"].runs[0], "--world-size") == "4"  # 4 heads: 1, 2 or 4
    assert flag(eight["15"].runs[0], "--world-size") == "8"
    assert two["06"].runs[0].argv[2:7] == ["--nnodes", "2", "--nproc-per-node", "1", "--"]
    assert eight["06"].runs[0].argv[2:7] == ["--nnodes", "2", "--nproc-per-node", "4", "--"]
    assert (flag(two["19"].runs[0], "--dp"), flag(two["19"].runs[0], "--tp")) == ("1", "2")
    assert (flag(eight["19"].runs[0], "--dp"), flag(eight["19"].runs[0], "--tp")) == ("4", "2")
    assert flag(two["03"].runs[0], "--device") == "cuda" and flag(two["03"].runs[0], "--devices") == "2"


def test_only_picks_lessons_and_rejects_a_wrong_one(tmp_path):
    assert gc.parse_args(["--only", "5,15"]).only == ["05", "15"]
    with pytest.raises(SystemExit):
        gc.parse_args(["--only", "99"])


def test_a_flag_gone_from_a_lesson_costs_the_flag_not_the_lesson(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "has_flag", lambda path, f: f != "--repeats")
    check = gc.plan_lesson("04", 1, "cuda", tmp_path, sys.executable)
    assert "--repeats" not in check.runs[0].argv and "--epochs" in check.runs[0].argv
    assert "--repeats is gone" in check.note


def test_a_lesson_newer_than_the_table_is_planned_from_its_help_not_skipped(tmp_path, monkeypatch):
    monkeypatch.delitem(gc.SPECS, "14")
    plan = {c.lesson: c for c in gc.build_plan(2, "cuda", tmp_path, only=["14"])}
    gpu, cpu = plan["14"].runs
    assert (flag(gpu, "--device"), flag(gpu, "--world-size"), flag(gpu, "--steps")) == ("cuda", "2", "30")
    assert flag(cpu, "--device") == "cpu" and plan["14"].tolerance == 1e-2
    assert "planned from its --help" in plan["14"].note


# --- the comparison -----------------------------------------------------------------

def test_max_abs_diff_of_two_tiny_state_dicts():
    a = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5])}
    b = {"w": torch.tensor([[1.0, 2.5], [3.0, 4.0]]), "b": torch.tensor([0.25])}
    assert gc.max_abs_diff(a, b) == 0.5
    assert gc.max_abs_diff(a, a) == 0.0
    with pytest.raises(ValueError):
        gc.max_abs_diff(a, {"w": a["w"]})
    with pytest.raises(ValueError):
        gc.max_abs_diff(a, {"w": a["w"].T.reshape(4), "b": a["b"]})


def test_compare_passes_rounding_and_fails_a_real_difference(tmp_path):
    w = {"fc.weight": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    for name, state in (("gpu", w), ("near", {"fc.weight": w["fc.weight"] + 1e-6}),
                        ("far", {"fc.weight": w["fc.weight"] + 0.1}),
                        ("nan", {"fc.weight": w["fc.weight"] * float("nan")})):
        (tmp_path / name).mkdir()
        torch.save(state, tmp_path / name / "final.pt")
    ok, diff, _ = gc.compare(tmp_path / "gpu", tmp_path / "near", 1e-3)
    assert ok and 0 < diff < 1e-5
    ok, diff, why = gc.compare(tmp_path / "gpu", tmp_path / "far", 1e-3)
    assert not ok and abs(diff - 0.1) < 1e-6 and "more than 0.001" in why
    assert not gc.compare(tmp_path / "gpu", tmp_path / "nan", 1e-3)[0]
    ok, diff, why = gc.compare(tmp_path / "gpu", tmp_path / "missing", 1e-3)
    assert not ok and diff is None and "cannot compare" in why


def test_compare_refuses_a_final_pt_its_metrics_do_not_name(tmp_path):
    """metrics.json names the sha256 of its run's final.pt: a final.pt from another run (or
    changed since) is not compared as if it were this run's."""
    import hashlib
    import json
    for name in ("gpu", "cpu"):
        (tmp_path / name).mkdir()
        torch.save({"w": torch.zeros(3)}, tmp_path / name / "final.pt")
        digest = hashlib.sha256((tmp_path / name / "final.pt").read_bytes()).hexdigest()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"final_pt_sha256": digest}))
    assert gc.compare(tmp_path / "gpu", tmp_path / "cpu", 1e-3)[0]
    torch.save({"w": torch.ones(3) * 1e-6}, tmp_path / "cpu" / "final.pt")  # another run's weights
    ok, diff, why = gc.compare(tmp_path / "gpu", tmp_path / "cpu", 1e-3)
    assert not ok and diff is None and "not the one its metrics.json names" in why, why


# --- the timeout --------------------------------------------------------------------

def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(pid, 0): it has exited
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def fake_check(tmp_path, name, code):
    out = tmp_path / name
    r = gc.Run("gpu", [sys.executable, "-c", code], out, tmp_path / f"{name}.log")
    return gc.Check(name, f"fake {name}", "cpu", "-", "1", [r], None, 1.0)


def test_timeout_kills_the_whole_process_group_and_goes_on(tmp_path, capsys):
    # a parent that starts a sleeping child (a rank) and sleeps itself: both must die at 1 s
    sleeper = ("import subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
               "time.sleep(60)\n")
    plan = [fake_check(tmp_path, "98", sleeper),
            fake_check(tmp_path, "99", "print('the next lesson ran')")]
    info = {"torch": torch.__version__, "cuda": None, "python": "3", "gpus": 1,
            "device_under_test": "cpu", "gpu_names": []}
    start = time.monotonic()
    code = gc.execute(plan, tmp_path / "out", info, timeout=1.0, budget=60.0)
    assert time.monotonic() - start < 30
    assert code == 1
    assert plan[0].runs[0].timed_out and plan[0].result.startswith("FAIL: gpu run timed out")
    child = int((tmp_path / "child.pid").read_text())
    time.sleep(0.2)
    assert not alive(child), "the timed-out run's child process is still running"
    assert plan[1].result == "pass" and plan[1].runs[0].rc == 0
    assert "the next lesson ran" in (tmp_path / "99.log").read_text()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [x["result"][:4] for x in results["lessons"]] == ["FAIL", "pass"]
    assert "| 98 fake 98 |" in (tmp_path / "out" / "table.md").read_text()


def test_the_budget_stops_a_lesson_and_no_lesson_starts_after_it(tmp_path):
    plan = [fake_check(tmp_path, "98", "import time; time.sleep(60)"),
            fake_check(tmp_path, "99", "print(1)")]
    info = {"torch": "", "cuda": None, "python": "3", "gpus": 1, "device_under_test": "cpu", "gpu_names": []}
    start = time.monotonic()
    gc.execute(plan, tmp_path / "out", info, timeout=60.0, budget=2.0)
    assert time.monotonic() - start < 30
    assert plan[0].result.startswith("FAIL: gpu run timed out after 2 s"), plan[0].result
    assert plan[1].result == "not run: --budget spent" and plan[1].runs[0].rc is None


# --- end to end, the CPU as the device under test ----------------------------------

def test_the_whole_pipeline_runs_lesson_01_twice_and_finds_no_difference(tmp_path):
    out = tmp_path / "gpu-check"
    proc = run([sys.executable, str(TOOL), "--device-under-test", "cpu", "--only", "01",
                "--out", str(out), "--timeout", "200"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    (row,) = results["lessons"]
    assert row["lesson"] == "01" and row["result"] == "pass" and row["diff"] == 0.0
    assert row["device"] == "cpu" and [r["rc"] for r in row["runs"]] == [0, 0]
    assert [r["role"] for r in row["runs"]] == ["gpu", "cpu"]
    assert row["numbers"].startswith("acc 9") and "cpu:" not in row["numbers"]
    table = (out / "table.md").read_text()
    assert "| 01 " in table and "| pass |" in table
    assert "self-test" in table  # never mistaken for a GPU run
    assert table in proc.stdout  # printed as well as written


def test_sigterm_to_the_check_stops_the_runs_it_started(tmp_path):
    # A time limit that ends the check must not leave its lessons running: each run has a
    # session of its own, which nothing else would stop.
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    (tmp_path / "check.py").write_text(
        "import signal, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tools import gpu_check as gc\n"
        "signal.signal(signal.SIGTERM, gc.interrupted)  # as main() does\n"
        f"run = gc.Run('gpu', [sys.executable, '-c', {sleeper!r}], gc.Path({str(tmp_path / 'o')!r}), "
        f"gc.Path({str(tmp_path / 'o.log')!r}))\n"
        "check = gc.Check('98', 'fake', 'cpu', '-', '1', [run], None, 1.0)\n"
        "info = {'torch': '', 'cuda': None, 'python': '3', 'gpus': 1, 'device_under_test': 'cpu', 'gpu_names': []}\n"
        f"sys.exit(gc.execute([check], gc.Path({str(tmp_path / 'out')!r}), info, 60.0, 60.0))\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "check.py")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    sleeper_pid = int(pid_file.read_text())
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted: every run was stopped" in err
    time.sleep(0.2)
    assert not alive(sleeper_pid), "a run outlived the check"


@pytest.mark.parametrize("num", sorted(n for n, spec in gc.SPECS.items() if spec.kind == "cpu"))
def test_a_lesson_the_table_calls_cpu_by_design_refuses_cuda(num, monkeypatch, capsys):
    """The "cpu" rows say the lesson refuses --device cuda: it does, in one line, before any
    work (lesson 23 used to accept the flag and ignore it)."""
    line = parse_error(import_lesson(num), ["--device", "cuda"], monkeypatch, capsys)
    assert "--device" in line, line


@pytest.mark.parametrize("num", sorted(n for n, spec in gc.SPECS.items() if spec.kind == "ranks"))
def test_every_planned_command_passes_the_lessons_own_flag_checks(num, monkeypatch):
    """A row's short flags at each world size it may use are flags the lesson accepts (lesson
    24's --steps must be a multiple of its --sync-every, for one): parsed in-process."""
    spec, lesson = gc.SPECS[num], import_lesson(num)
    for world in spec.sizes:
        monkeypatch.setattr(sys, "argv", [lesson.__file__, "--device", "cpu", *spec.short, "--world-size", str(world)])
        lesson.parse_args()  # exits 2 with one line if the plan asks for what the lesson refuses
