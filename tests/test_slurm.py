"""Lessons 06 and 07 as Slurm jobs, on a real 2-node Slurm cluster on this machine.

tools/slurm_cluster.py brings up Debian's Slurm 22.05 as nodes n1 and n2 (each in network,
UTS and mount namespaces of its own) once for this file, and takes it down at the end. The
jobs are submitted as a user submits them, from the repository root, with the scripts the
docs show: `sbatch --gpus-per-node=0 --cpus-per-task=2 docs/examples/lesson06.sbatch ...`
(the overrides doc 06 gives for a CPU-only partition) and docs/examples/lesson07_requeue.sbatch.
Every job is submitted at the start and Slurm runs them in turn; each test waits for its
own (scontrol show job: without an accounting database there is no sacct). --output goes to
the test's folder instead of the repo root.

It needs root and the Debian packages (slurmctld slurmd slurm-client munge). Without them
every test here is skipped with the reason, except under CI (the CI variable set), where
that is a failure: CI must run them (.ci/run installs the packages). Plain subprocess.run
with timeouts, no test zygote: the commands here are Slurm's, and the Pythons are the jobs'.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import recipe
from conftest import ROOT, load_run, max_abs_diff

TOOL = [sys.executable, str(ROOT / "tools" / "slurm_cluster.py")]
CPU_ONLY = ["--gpus-per-node=0", "--cpus-per-task=2"]  # doc 06's overrides for a CPU-only partition
LESSON06 = "docs/examples/lesson06.sbatch"
LESSON07 = "docs/examples/lesson07_requeue.sbatch"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}
JOB_TIMEOUT = 240  # seconds a test waits for its job: each took 17-35 s on 2 cores, 60-85 s at load 20+


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: tools/slurm_cluster.py makes network namespaces and starts Slurm's daemons"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    absent = [p for p in ("slurmctld", "slurmd", "sbatch", "munged", "unshare", "nsenter", "ip")
              if not shutil.which(p, path=path)]
    if absent:
        return (f"Slurm's Debian packages are missing ({', '.join(absent)}): "
                f"apt-get install -y slurmctld slurmd slurm-client munge")
    return None


def machine_state() -> dict:
    """What the cluster must leave as it found it: this machine's network interfaces and
    addresses, and every file under /etc (path, size, modification time)."""
    etc = {}
    for folder, _, files in os.walk("/etc"):
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            etc[path] = (st.st_size, st.st_mtime_ns)
    links = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, timeout=10).stdout
    return {"etc": etc, "ip": links}


class Cluster:
    """The cluster's tool, for the cluster in `home`; `on_n1` runs a command on the login node."""

    def __init__(self, home: Path):
        self.home = home

    def tool(self, *args, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*TOOL, "--state", str(self.home), *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            pytest.fail(f"slurm_cluster.py {' '.join(map(str, args))} exited {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def on_n1(self, *cmd, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*TOOL, "--state", str(self.home), "exec", *map(str, cmd)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env={**os.environ, **(env or {})})
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(map(str, cmd))} on n1 exited {proc.returncode}: {proc.stderr[-3000:]}")
        return proc

    def sbatch(self, *args, env: dict | None = None) -> str:
        return self.on_n1("sbatch", "--parsable", *args, env=env).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """scontrol show job, as a dict: JobState, Reason, ExitCode, Restarts, RunTime, ..."""
        text = self.on_n1("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, output: Path, timeout: float = JOB_TIMEOUT) -> dict:
        """Poll until the job has ended (as `squeue` would show it gone); its final state."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id))["JobState"] not in ENDED:
            if time.monotonic() > deadline:
                self.on_n1("scancel", job_id, check=False)
                text = output.read_text(errors="replace")[-3000:] if output.exists() else "(no output)"
                pytest.fail(f"job {job_id} still {info['JobState']} ({info.get('Reason')}) after "
                            f"{timeout} s; its output:\n{text}")
            time.sleep(1)
        return info


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the Slurm tests")
        pytest.skip(why)
    home = tmp_path_factory.mktemp("slurm") / "cluster"
    before = machine_state()
    cluster = Cluster(home)
    started = time.monotonic()
    cluster.tool("up")
    cluster.up_seconds = time.monotonic() - started
    cluster.before = before
    yield cluster
    cluster.tool("down", check=False)  # test_down_... has taken it down already when it passed


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job, submitted at once: Slurm runs them on both nodes, in turn where each takes all
    their CPUs (2-core machines). First, doc 06's script unchanged on this CPU-only cluster."""
    folder = tmp_path_factory.mktemp("jobs")
    found = {}
    # unchanged: no GPUs here at all, so Slurm refuses the GPU request at once
    found["unchanged"] = cluster.on_n1("sbatch", LESSON06, check=False)
    # no GPUs asked for, but 8 CPUs per task on 2-CPU nodes: accepted, and pending forever
    if os.cpu_count() < 8:  # (the nodes have this machine's CPUs)
        pending = cluster.sbatch("--gpus-per-node=0", LESSON06)
        deadline = time.monotonic() + 10
        while (info := cluster.job(pending))["Reason"] == "None" and time.monotonic() < deadline:
            time.sleep(0.2)
        found["too_many_cpus"] = info
        cluster.on_n1("scancel", pending)

    def submit(name, script, *flags, env=None, sbatch=()):
        output = folder / f"{name}.out"
        job_id = cluster.sbatch(*CPU_ONLY, f"--output={output}", *sbatch, script, *flags, env=env)
        found[name] = {"id": job_id, "output": output, "out": folder / name}

    # lesson 07 first: its test requeues it as soon as it has a snapshot, and while it waits
    # to start again (cred_expire), the nodes run the next job
    submit("requeue", LESSON07, "--fail-at-step", "0", "--step-delay", "0.05", "--out", folder / "requeue",
           env={"NPROC_PER_NODE": "1"})
    submit("c10d", LESSON06, "--epochs", "1", "--out", folder / "c10d")
    submit("static", LESSON06, "--epochs", "1", "--out", folder / "static", env={"RDZV": "static"})
    submit("crash", LESSON06, "--crash-rank", "3", "--out", folder / "crash")
    return found


def assert_left_no_tmpdir(job_id: str) -> None:
    """The job's TMPDIR (runs/slurm/tmp-JOBID.XXXX, for torchrun's torchelastic_* folders) is gone."""
    assert not list((ROOT / "runs" / "slurm").glob(f"tmp-{job_id}.*"))


def test_the_cluster_comes_up_quickly_with_two_idle_nodes(cluster):
    assert cluster.up_seconds < 15, cluster.up_seconds  # about 1-2 s on an idle machine
    nodes = cluster.on_n1("sinfo", "-h", "-N", "-o", "%N %T %c").stdout.split("\n")
    assert [line.split()[:2] for line in nodes if line] == [["n1", "idle"], ["n2", "idle"]]
    # the login node's own view: its host name, and its address only inside its namespace
    seen = cluster.on_n1("bash", "-c", "hostname; ip -br addr show veth0").stdout
    assert seen.startswith("n1\n") and "198.51.100.1/24" in seen
    assert "198.51.100." not in machine_state()["ip"]


@pytest.mark.timeout(600)  # two runs of lesson 07, and lesson 06's c10d job between them
def test_lesson_07_is_requeued_by_its_signal_and_resumes_from_its_snapshot(cluster, jobs, reference_3_epochs):
    job = jobs["requeue"]
    snapshot = job["out"] / "snapshot.pt"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not snapshot.exists():  # the first run has saved (step 10, then every 10 steps)
        info = cluster.job(job["id"])
        assert info["JobState"] not in ENDED, (info, job["output"].read_text()[-3000:])
        assert time.monotonic() < deadline, "no snapshot appeared"
        time.sleep(0.1)
    # what --signal=B:USR1@90 does 90 s before the time limit: USR1 to the batch shell only
    cluster.on_n1("scancel", "--batch", "--signal=USR1", job["id"])
    info = cluster.wait(job["id"], job["output"])
    text = job["output"].read_text()
    assert info["JobState"] == "COMPLETED", (info, text[-3000:])
    assert info["Restarts"] == "1"  # Slurm's own count: requeued once
    assert "USR1: the time limit is near; requeueing job" in text
    assert "CANCELLED AT" in text and "DUE TO JOB REQUEUE" in text  # slurmstepd, on the first run
    assert f"job {job['id']}, run 2 on n[1-2]" in text  # the same job id, started again
    assert "found a snapshot left by an earlier job" in text
    state, metrics = load_run(job["out"])
    step = metrics["resumed_from_step"]
    assert step > 0 and step % 10 == 0, step  # from a snapshot, not from scratch
    assert f"resuming from snapshot at epoch {step // 32 + 1} step {step % 32}/32" in text
    assert metrics["world_size"] == 2 and metrics["every_sample_once_per_epoch"] is True
    assert len(metrics["losses"]) == 96  # the whole loss curve, across both runs
    assert max_abs_diff(state, reference_3_epochs) <= 1e-4  # the uninterrupted run's weights
    assert not snapshot.exists()  # the job finished: the snapshot is deleted
    assert_left_no_tmpdir(job["id"])


def test_lesson_06_with_c10d_on_two_nodes_matches_lesson_01(cluster, jobs):
    job = jobs["c10d"]
    info = cluster.wait(job["id"], job["output"])
    text = job["output"].read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    state, metrics = load_run(job["out"])
    # node ranks handed out at the rendezvous: sorted by host name, so n1 is node 0
    assert [(r["rank"], r["node"], r["local_rank"], r["host"]) for r in metrics["ranks"]] == \
        [(0, 0, 0, "n1"), (1, 0, 1, "n1"), (2, 1, 0, "n2"), (3, 1, 1, "n2")]
    assert metrics["epochs"] == 1  # the flags after the script reached the lesson
    assert max_abs_diff(state, recipe.train_reference(epochs=1)) <= 1e-4
    assert "rendezvous: c10d" in text
    # the store is the batch script's, so no agent can find it gone at the end
    for noise in ("recvVector failed", "failed to shutdown the rendezvous", "Error waiting on exit barrier",
                  "Traceback", "hostname of the client socket cannot be retrieved"):
        assert noise not in text, noise
    assert_left_no_tmpdir(job["id"])


def test_lesson_06_with_static_rendezvous_on_two_nodes_matches_lesson_01(cluster, jobs):
    job = jobs["static"]
    info = cluster.wait(job["id"], job["output"])
    text = job["output"].read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert "rendezvous: static" in text
    state, metrics = load_run(job["out"])
    # --node-rank from SLURM_NODEID: node 0 is the first node of the allocation
    assert [(r["rank"], r["node"], r["host"]) for r in metrics["ranks"]] == \
        [(0, 0, "n1"), (1, 0, "n1"), (2, 1, "n2"), (3, 1, "n2")]
    assert max_abs_diff(state, recipe.train_reference(epochs=1)) <= 1e-4
    assert_left_no_tmpdir(job["id"])


def test_a_crashing_worker_ends_the_job_failed_and_is_named(cluster, jobs):
    job = jobs["crash"]
    info = cluster.wait(job["id"], job["output"])
    text = job["output"].read_text()
    assert info["JobState"] == "FAILED" and not info["ExitCode"].startswith("0:"), (info, text[-3000:])
    # rank 3 (on n2) raised at step 5; its own traceback names it (torch prefixes [rank3]:)
    assert "[rank3]: RuntimeError: deliberate crash of rank 3 at step 5 (--crash-rank)" in text
    # the agent that saw a failure first printed torchrun's summary, with the error files that
    # @record wrote in the job's TMPDIR; srun --kill-on-bad-exit=1 then stopped the other node
    assert "lessons/06_torchrun_multinode.py FAILED" in text and "Root Cause (first observed failure)" in text
    assert f"error_file: {ROOT}/runs/slurm/tmp-{job['id']}." in text
    assert re.search(r"^srun: error: n[12]: task [01]: Exited with exit code 1$", text, re.M), text[-3000:]
    # within a bound: the job ends seconds after the first failure (2 s on an idle machine),
    # long before the lesson's process-group timeout (60 s) could have ended a hung rank
    first = min(datetime.datetime.strptime(t, "%Y-%m-%d_%H:%M:%S")
                for t in re.findall(r"^\s*time\s*: (\S+)$", text, re.M))
    ended = datetime.datetime.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S")
    assert (ended - first).total_seconds() < 45, (first, ended)
    assert_left_no_tmpdir(job["id"])  # ... and that folder is gone
    assert not (job["out"] / "final.pt").exists()


def test_doc_06s_script_unchanged_does_not_fit_a_cpu_only_cluster(jobs):
    # what doc 06 warns about, seen here: with no GPUs in the cluster, the GPU request is refused ...
    refused = jobs["unchanged"]
    assert refused.returncode == 1 and "Invalid generic resource (gres) specification" in refused.stderr
    # ... and without it, 8 CPUs per task on nodes of 2 can never start
    if "too_many_cpus" not in jobs:
        pytest.skip(f"this machine has {os.cpu_count()} CPUs: 8 per task fit on a node")
    assert jobs["too_many_cpus"]["JobState"] == "PENDING"
    assert jobs["too_many_cpus"]["Reason"] == "PartitionConfig"


def test_the_scripts_output_file_is_ignored_by_git():
    for script, name in ((LESSON06, "lesson06"), (LESSON07, "lesson07")):
        text = (ROOT / script).read_text()
        assert "#SBATCH --output=slurm-%x-%j.out" in text and f"#SBATCH --job-name={name}" in text
        ignored = subprocess.run(["git", "check-ignore", "-q", f"slurm-{name}-1234.out"], cwd=ROOT,
                                 timeout=30)
        assert ignored.returncode == 0, f"slurm-{name}-1234.out is not ignored by git"
    assert "#SBATCH --requeue" in (ROOT / LESSON07).read_text()
    assert "#SBATCH --signal=B:USR1@" in (ROOT / LESSON07).read_text()


def test_without_root_or_the_packages_it_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "tools" / "slurm_cluster.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a learner's own account sees
    with pytest.raises(SystemExit) as exited:  # (status: harmless, should the check ever go)
        tool.main(["--state", str(tmp_path / "none"), "status"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: tools/slurm_cluster.py must run as root") and err.count("\n") == 1, err
    monkeypatch.undo()
    if os.geteuid() != 0:
        pytest.skip("not root: the packages are checked after root")
    # sbatch (slurm-client) lives in /usr/bin: with no PATH it is "missing", as without the package
    missing = subprocess.run([*TOOL, "--state", str(tmp_path / "none"), "status"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={"PATH": "/nonexistent"}, stdin=subprocess.DEVNULL)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == ("error: Slurm's Debian packages are missing (sbatch not found): "
                              "apt-get install -y slurmctld slurmd slurm-client munge\n")


def test_down_stops_everything_and_changes_nothing(cluster, jobs):
    state = json.loads((cluster.home / "state.json").read_text())
    pids = [pid for pid, _ in [*state["holders"].values(), *state["daemons"]]]
    assert len(pids) == 7  # 2 namespace holders, 2 munged, slurmctld, 2 slurmd
    started = time.monotonic()
    down = cluster.tool("down")
    assert time.monotonic() - started < 15
    assert "removed" in down.stdout and not cluster.home.exists()
    for pid in pids:  # gone, or only a zombie waiting for init to reap it
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"), pid
    after = machine_state()
    assert after["ip"] == cluster.before["ip"]
    changed = {p for p in after["etc"].keys() | cluster.before["etc"].keys()
               if after["etc"].get(p) != cluster.before["etc"].get(p)}
    assert not changed, sorted(changed)
    assert cluster.tool("status").stdout.startswith("no cluster is up")
