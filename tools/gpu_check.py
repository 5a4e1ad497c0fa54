"""make gpu-check: run every lesson's GPU path this machine can hold, and compare it with the CPU.

Every lesson promises to use CUDA and NCCL unchanged when GPUs exist. This check runs each
lesson twice with the same short flags, once with --device cuda and once with --device cpu
(the two at the same time, --serial for one after the other), and compares the two final.pt
files: max |w - w_cpu|, the largest difference of any weight.

* One GPU: the single-device lessons on cuda, and every distributed lesson at world size 1
  (NCCL with one rank). No lesson puts several ranks on one GPU: NCCL refuses it and
  common/device.py plan_device stops such a job with one line, so none is planned. Lesson 03's
  nn.DataParallel needs 2 GPUs: on one, the lesson simulates its devices on the CPU, and the
  table says so.
* Two or more GPUs: the distributed lessons on NCCL, one rank per GPU (the largest world size
  the lesson accepts that fits), lesson 06 as two simulated nodes, 03 and 04 on real devices.
* Lessons 10, 11 and 12 run on the CPU by design (they refuse --device cuda): one run each with
  --device auto, to see that a GPU in the machine does not change that.

It prints the plan and how long it expects to take, stops each lesson at --timeout and goes on,
stops starting lessons when --budget is spent, and writes runs/gpu-check/table.md (what the
README's "Running on GPUs" quotes) and results.json (every command, exit code, seconds and the
end of its log), both rewritten after every lesson. Without CUDA it says so in one line and
exits 0, so CI can run it.

Run:
    make gpu-check
    make gpu-check ARGS="--dry-run --gpus 2"
    make gpu-check ARGS="--only 05,15 --timeout 60"
    .venv/bin/python tools/gpu_check.py --dry-run --gpus 1

On a machine where torch is installed without this repository's .venv, start this file with
that machine's Python: every lesson runs under the interpreter that runs this file.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# How close the GPU's weights must be to the CPU's. Not equal: cuBLAS sums a matrix product in
# another order than the CPU's kernels, so each product differs in its last bits (about 1e-7
# relative in float32), and training carries those differences forward.
# Part 1 (01-12): lesson 01's MLP with SGD for one epoch (32 steps). SGD moves each weight by
# lr x gradient, so a rounding difference stays rounding-sized (1e-6 or less after an epoch);
# 1e-3 leaves a wide margin, while a real bug (a gradient not averaged, a rank's samples lost)
# moves weights by 1e-2 or more.
# Part 2 (13 on): lesson 13's transformer with AdamW for 30 steps. AdamW divides each gradient by
# the root of its own running square, so a weight's step is about lr (1e-2) whatever its
# gradient's size: where a gradient is near zero, a rounding difference can change that step's
# direction. 1e-2 allows one such step; a missing all-reduce or a wrong shard leaves the ranks'
# models far further apart than that after 30 steps.
TOLERANCE = {1: 1e-3, 2: 1e-2}

RECIPE_SIZES = tuple(n for n in range(1, 17) if 96 % n == 0)    # common/recipe.py: GLOBAL_BATCH 96, 16 ranks at most
ACCUM_SIZES = tuple(n for n in RECIPE_SIZES if 96 // n % 4 == 0)  # 08: 4 equal micro-batches per rank (--accum-steps 4)
PART2_SIZES = tuple(n for n in range(1, 9) if 48 % n == 0)      # common/transformer.py: GLOBAL_BATCH 48, 8 at most
HEAD_SIZES = (1, 2, 4)                                          # 17 and 18: must also divide 4 heads / 4 pieces
CP_SIZES = (1, 2, 4, 8)                                         # 21: must divide half a sequence, 16 tokens
EXPERT_SIZES = (1, 2, 4)                                        # 22: must also divide its 4 experts


@dataclass(frozen=True)
class Spec:
    """How one lesson is run here.

    kind: one      a single process (--device)
          devices  one process driving --devices devices (lesson 03)
          ranks    --world-size N processes started by the lesson
          nodes    tools/nodes.py, static rendezvous (lesson 06, as make lesson-06)
          elastic  tools/nodes.py --elastic (lesson 07, as make lesson-07)
          mesh     --dp x --tp ranks (lesson 19)
          cpu      the CPU by design: refuses --device cuda; one run with --device auto
    estimate: seconds of (the GPU run, the CPU run) on a one-GPU machine, start-up included.
    Not yet measured on a GPU: scaled from the same runs on a 2-core CPU machine (each lesson's
    cost against lesson 01's), plus about 5 s for CUDA's and NCCL's start-up. Replace them with
    the seconds of results.json after the first real run.
    """
    kind: str
    short: tuple[str, ...] = ()           # flags that make the run short
    sizes: tuple[int, ...] = (1,)         # world sizes the lesson accepts
    weights: bool = True                  # writes final.pt
    estimate: tuple[float, float] = (15.0, 10.0)


SPECS = {
    "01": Spec("one", ("--epochs", "1"), estimate=(8, 5)),
    "02": Spec("one", weights=False, estimate=(8, 0)),
    "03": Spec("devices", ("--epochs", "1"), sizes=tuple(range(2, 9)), estimate=(8, 6)),
    "04": Spec("one", ("--epochs", "1", "--repeats", "2"), estimate=(10, 7)),
    "05": Spec("ranks", ("--epochs", "1"), RECIPE_SIZES, estimate=(14, 10)),
    "06": Spec("nodes", ("--epochs", "1"), RECIPE_SIZES, estimate=(15, 12)),
    "07": Spec("elastic", ("--epochs", "1"), RECIPE_SIZES, estimate=(30, 25)),
    "08": Spec("ranks", ("--epochs", "1"), ACCUM_SIZES, estimate=(35, 45)),
    "09": Spec("ranks", ("--epochs", "1"), RECIPE_SIZES, estimate=(20, 18)),
    "10": Spec("cpu", ("--world-size", "2", "--sizes", "1000,100000", "--repeats", "1"),
               weights=False, estimate=(15, 0)),
    "11": Spec("cpu", ("--world-size", "2", "--epochs", "1"), estimate=(15, 0)),
    "12": Spec("cpu", weights=False, estimate=(20, 0)),
    "13": Spec("one", ("--steps", "30"), estimate=(12, 10)),
    "14": Spec("ranks", ("--steps", "30"), PART2_SIZES, estimate=(18, 15)),
    "15": Spec("ranks", ("--steps", "30"), PART2_SIZES, estimate=(18, 15)),
    "16": Spec("ranks", ("--steps", "30", "--checkpoint", "{out}/checkpoint"), PART2_SIZES,
               estimate=(20, 17)),
    "17": Spec("ranks", ("--steps", "30"), HEAD_SIZES, estimate=(20, 17)),
    "18": Spec("ranks", ("--steps", "30"), HEAD_SIZES, estimate=(20, 17)),
    "19": Spec("mesh", ("--steps", "30"), PART2_SIZES, estimate=(20, 17)),
    "20": Spec("ranks", ("--epochs", "1"), RECIPE_SIZES, estimate=(18, 15)),
    # Part 3: each lesson's own one-process run is its baseline; the GPU run against the CPU
    "21": Spec("ranks", ("--steps", "30"), CP_SIZES, estimate=(15, 10)),
    "22": Spec("ranks", ("--steps", "30"), EXPERT_SIZES, estimate=(18, 12)),
    "23": Spec("cpu", weights=False, estimate=(20, 0)),
    "24": Spec("ranks", ("--steps", "32"), PART2_SIZES, estimate=(18, 12)),  # a multiple of H = 8
    # lesson 25: no training; final.pt is every DTensor result, whole and each rank's piece, on the
    # device (Step 6's LocalTensorMode rerun is on the CPU either way). On NCCL its S(0) -> S(1)
    # runs as an all-to-all, where gloo all-gathers: compare the two runs' metrics.json too
    "25": Spec("ranks", (), (1, 2, 4, 8), estimate=(20, 15)),
    # Part 4: lesson 26's default layout is ddp (its sizes are Part 2's); its final.pt is the
    # layout's float32 weights, trained beside float64 twins (about 3x a Part 2 lesson's work)
    "26": Spec("ranks", ("--steps", "30"), PART2_SIZES, estimate=(25, 20)),
    # lesson 27: one bug of the zoo (DDP, the quickest); final.pt is the bug's run. It needs 2
    # ranks at least (HSDP's 2 replicas, a 2-stage pipeline): with 1 GPU it runs on the CPU
    "27": Spec("ranks", ("--bug", "late-sync-flag", "--steps", "30"), (2, 4), estimate=(20, 15)),
    # lesson 28 plants its hangs in gloo on purpose (NCCL's differ, its doc says how): the
    # healthy run on 3 CPU ranks, as lesson 12's
    "28": Spec("cpu", estimate=(25, 0)),
    # lesson 29: DDP with each block compiled (inductor: Triton kernels on the GPU, built and
    # autotuned at the first step, so the GPU run's compile is the longer one); final.pt is the
    # compiled model's weights. Its Steps 4, 6 and 7 compile on the rank's device too
    "29": Spec("ranks", ("--steps", "30"), PART2_SIZES, estimate=(90, 50)),
}
CORE_FLAGS = {"--device", "--out", "--world-size", "--steps", "--epochs"}  # every lesson keeps these


@dataclass
class Run:
    """One command: the lesson on the device under test ("gpu") or its CPU reference ("cpu")."""
    role: str
    argv: list[str]
    out: Path
    log: Path
    rc: int | None = None
    seconds: float | None = None
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)

    def shown(self) -> str:
        return shlex.join(shown_path(a) for a in self.argv)


@dataclass
class Check:
    """One row of the table: a lesson, how it runs here, and what happened."""
    lesson: str
    title: str
    device: str                  # what the GPU run asks for (cuda, auto, cpu), then what it used
    backend: str
    world: str
    runs: list[Run]
    tolerance: float | None      # None: nothing to compare (no final.pt, or one run only)
    estimate: float
    note: str = ""
    result: str = "not run"
    diff: float | None = None
    numbers: str = ""


def shown_path(arg: str) -> str:
    """An argument as a reader at the repository root would type it."""
    try:
        return str(Path(arg).relative_to(ROOT)) if Path(arg).is_absolute() else arg
    except ValueError:
        return arg


def lesson_file(num: str) -> Path:
    found = sorted((ROOT / "lessons").glob(f"{num}_*.py"))
    if not found:
        raise SystemExit(f"error: no lessons/{num}_*.py")
    return found[0]


def lesson_title(path: Path) -> str:
    first = path.read_text(errors="replace").split('"""')[1].strip().splitlines()[0]
    return first.split(":", 1)[1].strip().rstrip(".") if ":" in first else first


def has_flag(path: Path, flag: str) -> bool:
    """Does the lesson (its file or its folder) still define `flag`? Lessons change; a renamed
    flag should cost this check one flag, not one lesson's whole run."""
    texts = [path.read_text(errors="replace")]
    folder = path.with_suffix("")
    if folder.is_dir():
        texts += [p.read_text(errors="replace") for p in folder.glob("*.py")]
    return any(f'"{flag}"' in t for t in texts)


def largest(sizes, most: int) -> int | None:
    fits = [n for n in sizes if n <= most]
    return max(fits) if fits else None


def lesson_numbers() -> list[str]:
    return sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def guessed_spec(path: Path, py: str) -> Spec:
    """A lesson newer than SPECS: planned from the flags its --help lists (world size 1, or 2
    on 2+ GPUs; 30 steps or 1 epoch), and the table's note says so."""
    try:
        text = subprocess.run([py, str(path), "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL).stdout
    except subprocess.TimeoutExpired:
        text = ""
    flags = set(text.split())
    short = ("--steps", "30") if "--steps" in flags else ("--epochs", "1") if "--epochs" in flags else ()
    if "--world-size" in flags:
        return Spec("ranks", short, (1, 2), estimate=(20, 17))
    return Spec("one", short, estimate=(15, 12))


def short_flags(num: str, path: Path, out: Path, notes: list[str], spec: Spec) -> list[str]:
    flags = []
    items = list(spec.short)
    while items:
        flag = items.pop(0)
        value = items.pop(0) if items and not items[0].startswith("--") else None
        if flag not in CORE_FLAGS and not has_flag(path, flag):
            notes.append(f"{flag} is gone from the lesson: left out")
            continue
        flags += [flag] + ([value.format(out=out)] if value is not None else [])
    return flags


def plan_lesson(num: str, gpus: int, dut: str, runs_dir: Path, py: str) -> Check:
    """The commands for one lesson on a machine with `gpus` GPUs. dut: the device under test,
    "cuda" (or "cpu" for the self-test, which runs the whole pipeline without a GPU)."""
    path = lesson_file(num)
    script = str(path)
    notes: list[str] = []
    spec = SPECS.get(num)
    if spec is None:
        spec = guessed_spec(path, py)
        notes.append("no entry in tools/gpu_check.py SPECS yet: planned from its --help")
    part = 1 if int(num) <= 12 else 2
    tol = TOLERANCE[part] if spec.weights and spec.kind != "cpu" else None
    gpu_device, world, backend, launcher, sized = dut, 1, "-", [], []

    if spec.kind == "one":
        if num == "04":
            notes.append("stages on cuda:0 and cuda:1" if gpus >= 2 else
                         "needs 2 GPUs for two devices: with 1, both stages on cuda:0")
    elif spec.kind == "devices":  # lesson 03: nn.DataParallel
        if gpus >= 2:
            n = min(gpus, 8)
            sized = ["--devices", str(n)]  # one process (world size 1), n devices
            notes.append(f"nn.DataParallel on {n} GPUs")
        else:
            gpu_device = "auto" if dut == "cuda" else dut
            notes.append("needs 2 GPUs for nn.DataParallel: with 1 the lesson simulates 2 devices "
                         "on the CPU (--device auto), and this row checks that")
    elif spec.kind == "cpu":
        gpu_device, world, backend = "auto", 2, "gloo"
        if num == "23":  # rank 0 of a fake 1,024-rank job: one process, no collective really runs
            world, backend = 1, "fake"
        notes.append("CPU by design (refuses --device cuda): one run with --device auto, "
                     "passes on exit 0")
    elif spec.kind == "mesh":
        tp = 2 if gpus >= 2 else 1
        dp = largest([d for d in spec.sizes if d * tp <= 8], gpus // tp) or 1
        world, sized = dp * tp, ["--dp", str(dp), "--tp", str(tp)]
    else:
        world = largest(spec.sizes, gpus) or 1
        if spec.kind == "nodes":
            nnodes = 2 if gpus >= 2 else 1
            per_node = largest([n // 2 for n in spec.sizes if n % 2 == 0], gpus // 2) if nnodes == 2 else 1
            world = nnodes * per_node
            launcher = [str(ROOT / "tools" / "nodes.py"), "--nnodes", str(nnodes),
                        "--nproc-per-node", str(per_node), "--"]
            notes.append(f"tools/nodes.py: {nnodes} node(s) x {per_node} rank(s)")
        elif spec.kind == "elastic":
            launcher = [str(ROOT / "tools" / "nodes.py"), "--elastic", "--nnodes", "1",
                        "--nproc-per-node", str(world), "--max-restarts", "3", "--"]
            notes.append("a worker dies once and torchrun restarts it (the lesson's default)")
        else:
            sized = ["--world-size", str(world)]
    if spec.kind in ("ranks", "nodes", "elastic", "mesh"):
        backend = "nccl" if dut == "cuda" else "gloo"
    if spec.kind == "ranks" and largest(spec.sizes, gpus) is None:  # lesson 27: 2 ranks at least
        world, gpu_device, backend, tol = min(spec.sizes), "cpu", "gloo", None
        sized = ["--world-size", str(world)]
        notes.append(f"needs {world} GPUs (one per rank): with {gpus} it runs its {world} ranks "
                     "on the CPU (gloo), passes on exit 0")

    def command(role: str, device: str) -> Run:
        out = runs_dir / f"{num}-{role}"
        argv = [py, *launcher, script, "--device", device, "--out", str(out), *sized,
                *short_flags(num, path, out, notes if role == "gpu" else [], spec)]
        return Run(role, argv, out, runs_dir / f"{num}-{role}.log")

    runs = [command("gpu", gpu_device)]
    if tol is not None:
        runs.append(command("cpu", "cpu"))
    estimate = max(spec.estimate) if len(runs) > 1 else spec.estimate[0]
    if world > 1 and spec.kind not in ("cpu", "devices"):
        estimate += 3 * (world - 1)  # more processes to start, a wider NCCL ring
    return Check(num, lesson_title(path), gpu_device, backend, str(world), runs, tol, estimate,
                 note="; ".join(notes))


def build_plan(gpus: int, dut: str, runs_dir: Path, only: list[str] | None = None,
               py: str = sys.executable) -> list[Check]:
    nums = only or lesson_numbers()
    return [plan_lesson(n, gpus, dut, runs_dir, py) for n in nums]


def plan_seconds(plan: list[Check], serial: bool = False) -> float:
    if serial:  # both runs, one after the other: about twice the longer of the two
        return sum(c.estimate * len(c.runs) for c in plan)
    return sum(c.estimate for c in plan)


# --- comparing --------------------------------------------------------------------------

def max_abs_diff(a: dict, b: dict) -> float:
    """max |w - w_cpu| over every tensor of two state dicts with the same keys and shapes."""
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"{k}: shape {tuple(a[k].shape)} against {tuple(b[k].shape)}")
        if a[k].numel():
            d = (a[k].double() - b[k].double()).abs().max().item()
            if d != d:
                return d  # nan: Python's max() would drop it
            worst = max(worst, d)
    return worst


def compare(gpu_out: Path, cpu_out: Path, tolerance: float) -> tuple[bool, float | None, str]:
    """(passed, max |w - w_cpu|, why not) for two runs' final.pt files."""
    import hashlib

    import torch

    for out in (gpu_out, cpu_out):  # metrics.json names the sha256 of its run's final.pt
        try:
            named = json.loads((out / "metrics.json").read_text()).get("final_pt_sha256")
        except (OSError, ValueError):
            continue  # no metrics.json: nothing to pair
        if named and named != hashlib.sha256((out / "final.pt").read_bytes()).hexdigest():
            return False, None, (f"{shown_path(str(out))}: final.pt is not the one its metrics.json "
                                 f"names (files of two runs?); run again")
    try:
        a = torch.load(gpu_out / "final.pt", map_location="cpu", weights_only=True)
        b = torch.load(cpu_out / "final.pt", map_location="cpu", weights_only=True)
        diff = max_abs_diff(a, b)
    except (OSError, ValueError, RuntimeError) as exc:
        return False, None, f"cannot compare final.pt: {exc}"
    if diff != diff or diff > tolerance:  # nan fails too
        return False, diff, f"weights differ by more than {tolerance:g}"
    return True, diff, ""


def read_json(folder: Path) -> dict:
    for name in ("metrics.json", "trace.json"):
        try:
            return json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
    return {}


def own_numbers(gpu: dict, cpu: dict) -> str:
    """The lesson's own numbers from its metrics.json: accuracy and last loss of the GPU run
    (the CPU run's in brackets where they differ), and its own comparison with its
    single-device reference, where it makes one."""
    def one(m: dict) -> str:
        parts = []
        if isinstance(m.get("final_accuracy"), (int, float)):
            parts.append(f"acc {m['final_accuracy']:.1%}")
        losses = m.get("losses")
        if isinstance(losses, list) and losses and isinstance(losses[-1], (int, float)):
            parts.append(f"loss {losses[-1]:.4f}")
        return " ".join(parts)

    text = one(gpu)
    if cpu and one(cpu) != text:
        text += f" (cpu: {one(cpu)})"
    own = gpu.get("max_abs_diff_vs_single_device")
    if isinstance(own, (int, float)):
        text += f"; its own max diff to 1 device {own:.1e}"
    return text.strip("; ")


# --- running ----------------------------------------------------------------------------

def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the run's whole process group (launchers stop their ranks), SIGKILL after
    `grace` seconds if anything is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def run_together(runs: list[Run], timeout: float, serial: bool = False) -> None:
    """Start the runs (all at once, or one after the other), each in its own process group;
    record exit code and seconds; kill a run's whole group at `timeout` seconds."""
    if serial and len(runs) > 1:
        for r in runs:
            run_together([r], timeout)
        return
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    live = []
    try:
        for r in runs:
            shutil.rmtree(r.out, ignore_errors=True)  # an old final.pt must never be compared
            r.log.parent.mkdir(parents=True, exist_ok=True)
            with open(r.log, "wb") as log:
                proc = subprocess.Popen(r.argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
            live.append((r, proc, time.monotonic()))
        while any(r.rc is None for r, _, _ in live):
            for r, proc, start in live:
                if r.rc is not None:
                    continue
                elapsed = time.monotonic() - start
                if proc.poll() is not None:
                    r.rc, r.seconds = proc.returncode, elapsed
                elif elapsed > timeout:
                    stop_group(proc)
                    r.rc, r.seconds, r.timed_out = proc.returncode, elapsed, True
            time.sleep(0.05)
    finally:
        for r, proc, _ in live:
            if proc.poll() is None:  # Ctrl-C, or an error here: leave nothing running
                stop_group(proc, grace=2.0)
            r.tail = tail(r.log)


def judge(check: Check) -> None:
    """Fill in result, device, backend, diff and the lesson's numbers from what the runs left."""
    gpu = check.runs[0]
    m = read_json(gpu.out)
    check.device = str(m.get("device", check.device))
    check.backend = str(m.get("backend", check.backend)) if m.get("backend") else check.backend
    if m.get("world_size"):
        check.world = str(m["world_size"])
    check.numbers = own_numbers(m, read_json(check.runs[1].out) if len(check.runs) > 1 else {})
    for r in check.runs:
        if r.timed_out:
            check.result = f"FAIL: {r.role} run timed out after {r.seconds:.0f} s"
            return
        if r.rc != 0:
            last = next((line for line in reversed(r.tail) if line.strip()), "")
            check.result = f"FAIL: {r.role} run exit {r.rc}" + (f" ({last.strip()[:120]})" if last else "")
            return
    wanted = gpu.argv[gpu.argv.index("--device") + 1] if "--device" in gpu.argv else None
    if wanted in ("cuda", "cpu") and m and not check.device.startswith(wanted):
        check.result = f"FAIL: asked for {wanted}, the lesson ran on {check.device}"
        return
    if check.tolerance is None:
        check.result = "pass"
        return
    ok, check.diff, why = compare(gpu.out, check.runs[1].out, check.tolerance)
    check.result = "pass" if ok else f"FAIL: {why}"


# --- reporting --------------------------------------------------------------------------

def machine(gpus: int, dut: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "gpus": gpus, "device_under_test": dut, "gpu_names": []}
    if dut == "cuda" and torch.cuda.is_available():
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(min(gpus, torch.cuda.device_count()))]
    return info


def fmt_diff(d: float | None) -> str:
    return "-" if d is None else ("0" if d == 0 else f"{d:.1e}")


def table(plan: list[Check], info: dict, started: str, seconds: float) -> str:
    names = ", ".join(sorted(set(info["gpu_names"]))) or "no GPU"
    what = (f"{info['gpus']} x {names}" if info["device_under_test"] == "cuda"
            else f"self-test: the device under test is the CPU (planned as for {info['gpus']} GPU(s))")
    lines = [
        f"gpu-check, {started}: {what}; torch {info['torch']} (CUDA {info['cuda']}), "
        f"Python {info['python']}; {seconds / 60:.1f} minutes",
        "",
        f"Each lesson ran twice with the same short flags, on the GPU and on the CPU; pass: "
        f"max \\|w - w_cpu\\| of final.pt <= {TOLERANCE[1]:g} for Part 1 (01-12: the MLP, SGD, "
        f"1 epoch) and <= {TOLERANCE[2]:g} from lesson 13 on (the transformer, AdamW, 30 steps). "
        f"A lesson without final.pt, or with one run, passes on exit 0 on the device named. "
        f"seconds: the GPU run's wall time" + ("." if info.get("serial") else " (the CPU run ran beside it)."),
        "",
        "| lesson | device | backend | world size | seconds | max \\|w - w_cpu\\| | result | the lesson's own numbers | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in plan:
        secs = c.runs[0].seconds
        cells = [f"{c.lesson} {c.title}", c.device, c.backend, c.world,
                 "-" if secs is None else f"{secs:.1f}", fmt_diff(c.diff), c.result, c.numbers or "-",
                 c.note or "-"]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, plan: list[Check], info: dict, started: str, seconds: float) -> str:
    text = table(plan, info, started, seconds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    record = {"started": started, "seconds": round(seconds, 1), "machine": info,
              "tolerance": {"part1": TOLERANCE[1], "part2": TOLERANCE[2]},
              "lessons": [{**{k: v for k, v in asdict(c).items() if k != "runs"},
                           "runs": [{"role": r.role, "command": r.shown(), "rc": r.rc,
                                     "seconds": None if r.seconds is None else round(r.seconds, 2),
                                     "timed_out": r.timed_out, "log_tail": r.tail} for r in c.runs]}
                          for c in plan]}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    return text


# --- the command line -------------------------------------------------------------------

def lesson_list(text: str) -> list[str]:
    nums = []
    for part in text.split(","):
        part = part.strip()
        known = lesson_numbers()
        if not part.isdigit() or f"{int(part):02d}" not in known:
            raise argparse.ArgumentTypeError(f"{part!r} is not a lesson; the lessons are {known[0]} to {known[-1]}")
        nums.append(f"{int(part):02d}")
    return sorted(set(nums))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog=".venv/bin/python tools/gpu_check.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and every command, run nothing")
    p.add_argument("--gpus", type=int, default=None,
                   help="plan for this many GPUs (default: torch.cuda.device_count(); with "
                        "--dry-run any number, to see another machine's plan)")
    p.add_argument("--only", type=lesson_list, default=None,
                   help="these lessons only, comma-separated, e.g. 05,15")
    p.add_argument("--timeout", type=float, default=90.0,
                   help="seconds one lesson may run before its process group is killed")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds for the whole check: no lesson starts after it is spent "
                        "(each is then marked 'not run')")
    p.add_argument("--serial", action="store_true",
                   help="run a lesson's GPU and CPU runs one after the other, not side by side")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check",
                   help="folder for table.md and results.json")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="folder for each run's --out and log (default: OUT/runs)")
    # The self-test: the "GPU" runs use this device. --device-under-test cpu runs the whole
    # pipeline (plan, runs, comparison, table) on a machine without a GPU; tests use it.
    p.add_argument("--device-under-test", choices=["cuda", "cpu"], default="cuda",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        p.error("--gpus must be 1 or more")
    if args.timeout <= 0 or args.budget <= 0:
        p.error("--timeout and --budget must be above 0")
    args.out = args.out.resolve()
    args.runs_dir = (args.runs_dir or args.out / "runs").resolve()
    return args


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    has_cuda = torch.cuda.is_available()
    visible = torch.cuda.device_count() if has_cuda else 0
    dut = args.device_under_test
    if dut == "cuda" and not has_cuda and not args.dry_run:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    gpus = args.gpus or visible or 1
    if dut == "cuda" and not args.dry_run and gpus > visible:
        print(f"error: --gpus {gpus}, but {visible} GPU(s) are visible here; use --dry-run to "
              f"see another machine's plan", file=sys.stderr)
        return 2
    if dut == "cuda" and not args.dry_run and gpus < visible:  # --gpus 1 on a bigger machine
        shown = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(visible)))
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(shown.split(",")[:gpus])  # the lessons see only these
    plan = build_plan(gpus, dut, args.runs_dir, args.only)
    minutes = max(1, round(plan_seconds(plan, args.serial) / 60))
    runs = sum(len(c.runs) for c in plan)
    where = f"{gpus} GPU{'s' if gpus > 1 else ''}" + ("" if visible or dut != "cuda" else
                                                     " (none here: the plan only, --gpus N for another count)")
    print(f"gpu-check: {where}, {len(plan)} lesson{'s' if len(plan) != 1 else ''}, {runs} runs, about {minutes} minute"
          f"{'s' if minutes > 1 else ''} (each lesson stopped at {args.timeout:g} s; no lesson "
          f"starts after {args.budget / 60:g} min)")
    if gpus == 1:
        print("  (no lesson puts several ranks on one GPU: NCCL refuses it, and plan_device stops "
              "such a job; the distributed lessons run at world size 1)")
    for c in plan:
        print(f"  {c.lesson} {c.title[:44]:<44} {c.device:<5} {c.backend:<5} world {c.world}  ~{c.estimate:.0f} s"
              + (f"  ({c.note})" if c.note else ""))
        if args.dry_run:
            for r in c.runs:
                print(f"      {r.shown()}")
    if args.dry_run:
        return 0

    # SIGTERM or SIGHUP (a session's time limit) end the check as Ctrl-C does: every run's
    # process group is stopped (each started a session of its own, which nothing else would
    # stop), and the table keeps the lessons done so far.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    info = {**machine(gpus, dut), "serial": args.serial}
    return execute(plan, args.out, info, args.timeout, args.budget, args.serial)


def execute(plan: list[Check], out: Path, info: dict, timeout: float, budget: float,
            serial: bool = False) -> int:
    """Run the plan's lessons in order, each stopped at `timeout` seconds; none starts after
    `budget` seconds. table.md and results.json are rewritten after every lesson, so that a
    machine taken back half-way still leaves the lessons done so far."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    try:
        for c in plan:
            left = budget - (time.monotonic() - t0)
            if left <= 0:
                c.result = "not run: --budget spent"
                continue
            print(f"[{c.lesson}] {c.title} ...", flush=True)
            run_together(c.runs, min(timeout, left), serial)
            judge(c)
            print(f"[{c.lesson}] {c.result}  {c.device} {c.backend} world {c.world}  "
                  f"{c.runs[0].seconds or 0:.1f} s  max |w - w_cpu| {fmt_diff(c.diff)}", flush=True)
            write_results(out, plan, info, started, time.monotonic() - t0)
    except KeyboardInterrupt:
        write_results(out, plan, info, started, time.monotonic() - t0)
        print(f"\ninterrupted: every run was stopped; the lessons so far are in {shown_path(str(out))}/table.md",
              file=sys.stderr)
        return 130
    text = write_results(out, plan, info, started, time.monotonic() - t0)
    print()
    print(text)
    print(f"wrote {shown_path(str(out / 'table.md'))} and results.json")
    return 0 if all(c.result == "pass" for c in plan) else 1

if __name__ == "__main__":
    sys.exit(main())
