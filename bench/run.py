"""The benchmark suite: measured speedups and costs, not claims.

Run:
    make bench                               # the full suite, a few minutes on 2 cores
    make bench ARGS="--quick"                # a fast smoke run (what the tests use)
    .venv/bin/python -m bench.run --only scaling --reps 7
    .venv/bin/python -m bench.run --write-doc   # the pages again from runs/bench/results.json
    make bench-docs                          # maintainers: measure, then rewrite the committed
                                             # docs/PERFORMANCE.md, docs/zh/ and docs/img/bench/

Writes runs/bench/results.json (machine, every benchmark's settings, every repetition, the
median, min and max), prints the tables, draws PNG plots when matplotlib is installed
(`.venv/bin/pip install -r requirements-bench.txt`), and after a full run writes the report
for this machine, runs/bench/PERFORMANCE.md and runs/bench/zh/PERFORMANCE.md. A learner's
run writes under runs/ only; only --publish (make bench-docs) touches docs/, and it
refuses to start without matplotlib rather than leave the committed plots out of step.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `import common` from anywhere

import torch

from common.cli import ROOT, LessonParser, fail, positive_float, positive_int, run
from common.processes import supervise
from common.distributed import RankFailed, run_ranks
from apparatus.results import atomic_write, shown
from apparatus.ui import UI

BENCHMARKS = ["scaling", "bucketing", "allreduce", "no_sync", "gpu", "fsdp", "tp", "pipeline"]
REQUIRED_SPEEDUP_2 = 1.6  # issue 8: 2 ranks >= 1.6x one rank on the 2-core CPU machine
MAX_CPU_RANKS = 8


def make_plan(args) -> dict:
    """What to run, at which size. --quick shrinks everything but keeps every benchmark."""
    quick = args.quick
    plan = {
        "mode": "quick" if quick else "full",
        "reps": args.reps or (3 if quick else 5),
        "warmup": 1 if args.warmup is None else args.warmup,
        "threads_per_rank": args.threads,
        "timeout": args.timeout,
        # The recipe's MLP, wide enough that arithmetic, not communication, dominates a
        # step. Strong scaling: the global batch is the same for every world size.
        "scaling": {"hidden": 256 if quick else 1024, "global_batch": 256 if quick else 4096,
                    "steps": 2 if quick else 3},
        "bucketing": {"hidden": 128 if quick else 512, "layers": 4 if quick else 8,
                      "global_batch": 128 if quick else 512, "steps": 2 if quick else 6,
                      "caps": [0.001, None, 100.0] if quick else [0.001, 1.0, None, 100.0],
                      "deferred_caps": [None] if quick else [1.0, None]},
        "no_sync": {"accum": 4, "configs": [
            {"name": "compute-bound", "hidden": 256 if quick else 1024,
             "global_batch": 256 if quick else 2048, "steps": 2 if quick else 3},
            {"name": "communication-bound", "hidden": 64, "global_batch": 96,
             "steps": 4 if quick else 20},
        ]},
        "allreduce": {"worlds": [2, 3] if quick else [2, 3, 4],
                      "sizes": [1_000, 10_001] if quick else
                      [1_000, 10_000, 100_000, 1_000_000, 4_000_000],
                      "rep_seconds": 0.005 if quick else 0.03, "max_inner": 20 if quick else 200},
        "gpu": {"hidden": 512 if quick else 4096, "global_batch": 1024 if quick else 16384,
                "steps": 2 if quick else 10,
                "allreduce_sizes": [1_000_000] if quick else [1_000_000, 16_000_000, 64_000_000],
                "allreduce_inner": 2 if quick else 10},
    }
    # the same bucketing and no_sync comparisons on 2 GPUs, with sizes that keep a GPU busy
    plan["gpu"]["bucketing"] = {**plan["bucketing"], "hidden": 256 if quick else 2048,
                                "global_batch": 256 if quick else 8192,
                                "steps": 2 if quick else 10}
    plan["gpu"]["no_sync"] = {"accum": 4, "configs": [
        {"name": "compute-bound", "hidden": plan["gpu"]["hidden"],
         "global_batch": plan["gpu"]["global_batch"], "steps": 2 if quick else 5},
        plan["no_sync"]["configs"][1],
    ]}
    cpus = os.cpu_count() or 1
    # 1 and 2 ranks always (the comparison the suite is about); more while cores allow
    top = min(cpus, args.max_ranks)
    worlds = [1, 2] + [n for n in (4, 8, 16) if n <= top]
    plan["scaling"]["worlds"] = [n for n in worlds if plan["scaling"]["global_batch"] % n == 0]
    wanted = set(args.only or BENCHMARKS)
    phases = []
    if "scaling" in wanted:
        phases += [("scaling", n) for n in plan["scaling"]["worlds"]]
    if "bucketing" in wanted:
        phases.append(("bucketing", 2))
    if "no_sync" in wanted:
        phases.append(("no_sync", 2))
    if "allreduce" in wanted:
        phases += [("allreduce", n) for n in plan["allreduce"]["worlds"]]
    plan["phases"] = phases
    from bench import sharded_transformer  # Part 2 (the transformer): FSDP2 vs DDP, tensor parallel, pipelines
    plan["part2"] = sharded_transformer.make_plan(quick)
    plan["benchmarks"] = sorted(wanted, key=BENCHMARKS.index)
    return plan


def machine_info() -> dict:
    """Where the numbers came from: they mean little without it."""
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpu_model = cpu_model or platform.processor() or platform.machine()
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    memory_gb = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory_gb = round(kb / 1024 / 1024, 1)
    except (OSError, IndexError, ValueError):
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": memory_gb,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "load_average_start": load_average(),
    }


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load: above the core count, other work shared our cores."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def spawn_ranks(worker, world: int, plan: dict, backend: str | None = "gloo") -> dict:
    """worker(rank, world, plan) on `world` new ranks in a `backend` group (None: the worker
    joins one itself) with common/distributed.py's run_ranks, the package's one way to start
    ranks: what rank 0 returned. A failing rank is one line."""
    try:
        with supervise():  # Ctrl-C, SIGTERM, SIGHUP: every rank stopped, then one line
            got = run_ranks(worker, world, (plan,), timeout_s=None, backend=backend,
                            group_timeout_s=plan["timeout"], threads=plan["threads_per_rank"])
    except RankFailed as failed:
        if failed.error == "SystemExit" and failed.code in (1, 2):
            # the rank already printed its own one-line error (common.cli.fail)
            fail(f"rank {failed.rank} exited with code {failed.code}; the other ranks were "
                 f"stopped", code=failed.code)
        fail(f"{failed}; the other ranks were stopped", code=1)
    if got[0] is None:
        fail("the benchmark ranks exited without writing their results", code=1)
    # through JSON, as results.json will hold them (tuples become lists, keys strings)
    return json.loads(json.dumps(got[0]))


def derive_scaling(rows: list[dict], cpus: int, threads: int) -> dict:
    """Speedup and efficiency against one DDP rank: efficiency = X_N / (N * X_1)."""
    ddp = {r["world_size"]: r for r in rows if r["variant"] == "ddp"}
    base = ddp.get(1)
    # one process without DDP, by its thread count: `threads` (one rank's cores), and
    # N x threads (all the cores N ranks use)
    plain = {r["threads_per_rank"]: r for r in rows if r["variant"] == "no_ddp"}
    for r in rows:
        if base and r["variant"] == "ddp":
            r["speedup"] = round(r["samples_per_s"]["median"] / base["samples_per_s"]["median"], 3)
            r["efficiency"] = round(r["speedup"] / r["world_size"], 3)
            if threads in plain:  # against one process without DDP, on one rank's cores
                r["speedup_vs_no_ddp"] = round(
                    r["samples_per_s"]["median"] / plain[threads]["samples_per_s"]["median"], 3)
            same = plain.get(threads * r["world_size"])
            if r["world_size"] > 1 and same:  # against one process on the same cores
                r["speedup_vs_same_cores"] = round(
                    r["samples_per_s"]["median"] / same["samples_per_s"]["median"], 3)
    check = {"world_size": 2, "required_speedup": REQUIRED_SPEEDUP_2,
             "applies": cpus == 2 and threads == 1,
             "speedup": ddp[2].get("speedup") if 2 in ddp else None}
    check["met"] = check["speedup"] is not None and check["speedup"] >= REQUIRED_SPEEDUP_2
    return check


def bucketing_section(cfg: dict, rows: list[dict]) -> dict:
    """The bucketing results with what a reader needs to check the counts: every
    gradient's size and DDP's default limits."""
    from bench import measure

    probe = measure.deep_mlp(cfg["hidden"], cfg["layers"])
    return {"config": {**cfg, "param_bytes": measure.param_bytes(probe),
                       "default_bucket_cap_mb": measure.DEFAULT_BUCKET_CAP_MB,
                       "default_first_bucket_bytes": torch.distributed._DEFAULT_FIRST_BUCKET_BYTES},
            "model": "deep_mlp", "rows": rows}


def derive_no_sync(rows: list[dict]) -> None:
    by = {(r["config"], r["method"]): r for r in rows}
    for (config, method), r in by.items():
        naive = by.get((config, "naive"))
        if method == "no_sync" and naive:
            r["saved_fraction"] = round(1 - r["step_ms"]["median"] / naive["step_ms"]["median"], 3)


def parse_args():
    parser = LessonParser(prog=".venv/bin/python -m bench.run",
                          description="The benchmark suite: measured DDP speedups and costs")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repetitions: checks that the suite runs (the tests use it)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.json and the PNG plots (default: runs/bench, "
                             "or runs/bench-quick with --quick, so a smoke run never replaces "
                             "the real results)")
    parser.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                        default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help="timed repetitions per measurement (default 5, --quick 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed warm-up repetitions before them (default 1)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads per rank (default 1: ranks never compete for a core)")
    parser.add_argument("--max-ranks", type=positive_int, default=MAX_CPU_RANKS,
                        help="most CPU ranks for DDP scaling, also capped by the core count (default 8)")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds a collective may wait before the run fails (default 120)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="the English report a full run writes, the Chinese one going to "
                             "zh/ beside it (default: OUT/PERFORMANCE.md; with --publish "
                             "docs/PERFORMANCE.md)")
    parser.add_argument("--no-doc", action="store_true",
                        help="do not write the report after a full run")
    parser.add_argument("--write-doc", action="store_true",
                        help="measure nothing: write the report from --out/results.json")
    parser.add_argument("--publish", action="store_true",
                        help="rewrite the committed docs/PERFORMANCE.md, docs/zh/PERFORMANCE.md "
                             "and docs/img/bench/ (make bench-docs); needs matplotlib")
    parser.add_argument("--strict", action="store_true",
                        help=f"exit 1 when 2 ranks reach less than {REQUIRED_SPEEDUP_2}x one "
                             f"rank on a 2-core machine")
    args = parser.parse_args()
    if args.out is None:
        args.out = ROOT / "runs" / ("bench-quick" if args.quick else "bench")
    if args.doc is None:
        args.doc = ROOT / "docs" / "PERFORMANCE.md" if args.publish else args.out / "PERFORMANCE.md"
    # the plots beside the report: the committed ones under docs/img/bench, a learner's
    # in --out with results.json
    args.img = args.doc.parent / "img" / "bench" if args.publish else args.out
    if args.publish and (args.quick or args.only or args.no_doc):
        fail("--publish rewrites the committed page from a full run: drop --quick, --only "
             "and --no-doc (or add --write-doc to publish runs/bench/results.json)")
    if args.publish:
        from bench import doc
        if why := doc.matplotlib_missing():
            fail(f"--publish redraws every plot of the committed page, but {why} "
                 f"(nothing was measured or changed)")
    unknown = sorted(set(args.only or []) - set(BENCHMARKS))
    if unknown:
        fail(f"--only {','.join(unknown)}: no such benchmark; choose from {','.join(BENCHMARKS)}")
    if args.warmup is not None and args.warmup < 0:
        fail(f"--warmup {args.warmup}: expected 0 or more")
    return args


def main() -> None:
    args = parse_args()
    ui = UI()
    results_path = args.out / "results.json"
    if args.write_doc:
        from bench import doc
        if not results_path.exists():
            fail(f"{shown(results_path, markup=False)} does not exist; run `make bench` first")
        written = doc.write_doc(results_path, args.doc, args.img, publish=args.publish)
        ui.print(f"wrote {', '.join(shown(p) for p in written)} from {shown(results_path)}")
        return

    from bench import measure, report

    started = time.perf_counter()
    plan = make_plan(args)
    machine = machine_info()
    ui.title(f"Benchmarks ({plan['mode']}): {', '.join(plan['benchmarks'])}")
    ui.print(f"{machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']}, "
             f"GPUs: {', '.join(machine['gpus']) or 'none'}; load average "
             f"{machine['load_average_start']}")
    ui.print(f"{plan['threads_per_rank']} thread(s) per rank; each number is the median of "
             f"{plan['reps']} repetitions after {plan['warmup']} warm-up")
    cpus = machine["cpu_count"] or 1
    if machine["load_average_start"] and machine["load_average_start"][0] > 0.5 * cpus:
        ui.print(f"[yellow]note:[/yellow] the machine is busy (load {machine['load_average_start'][0]} "
                 f"on {cpus} cores): the timings will be disturbed")

    results: dict = {"schema": 1, "mode": plan["mode"], "machine": machine,
                     "settings": {k: plan[k] for k in ("reps", "warmup", "threads_per_rank",
                                                       "timeout")},
                     "command": ".venv/bin/python -m bench.run " + " ".join(sys.argv[1:]),
                     "benchmarks": {}}
    bench = results["benchmarks"]

    if plan["phases"]:
        world = max(n for _, n in plan["phases"])
        ui.print(f"starting {world} CPU ranks (gloo); every benchmark runs on the first n of them")
        got = spawn_ranks(measure.cpu_worker, world, plan)
        if "scaling" in plan["benchmarks"]:
            check = derive_scaling(got["scaling"], cpus, plan["threads_per_rank"])
            sizes = measure.param_bytes(measure.recipe_mlp(plan["scaling"]["hidden"]))
            bench["scaling"] = {"config": {**plan["scaling"], "grad_bytes": sum(sizes),
                                           "param_count": sum(sizes) // measure.FLOAT_BYTES},
                                "model": "recipe.MLP", "strong_scaling": True,
                                "rows": got["scaling"], "check": check}
        if "bucketing" in plan["benchmarks"]:
            bench["bucketing"] = bucketing_section(plan["bucketing"], got["bucketing"])
        if "no_sync" in plan["benchmarks"]:
            derive_no_sync(got["no_sync"])
            bench["no_sync"] = {"config": plan["no_sync"], "model": "recipe.MLP",
                                "rows": got["no_sync"]}
        if "allreduce" in plan["benchmarks"]:
            bench["allreduce"] = {"config": plan["allreduce"], "backend": "gloo",
                                  "source": "lessons/10_allreduce_algorithms.py",
                                  "rows": got["allreduce"]}

    if set(plan["benchmarks"]) & {"fsdp", "tp", "pipeline"}:
        from bench import sharded_transformer
        first = "1, then 2 CPU ranks" if "fsdp" in plan["benchmarks"] else "2 CPU ranks"
        ui.print(f"starting {first} (gloo) for Part 2's transformer")
        bench.update(sharded_transformer.run(plan, spawn_ranks, ui))

    if "gpu" in plan["benchmarks"]:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            bench["gpu"] = {"skipped": "no GPU on this machine"}
            ui.print("gpu: skipped: no GPU on this machine")
        else:
            cfg = dict(plan["gpu"])
            cfg["worlds"] = [n for n in (1, 2, 4, 8, 16) if n <= gpus and cfg["global_batch"] % n == 0]
            gpu_plan = {**plan, "gpu": cfg}
            ui.print(f"starting {gpus} GPU ranks (NCCL)")
            try:
                got = spawn_ranks(measure.gpu_worker, gpus, gpu_plan, backend=None)  # NCCL: its own
            except SystemExit as exc:  # keep the CPU results; the error line is printed above
                gpu_failed = f"the GPU ranks failed (exit code {exc.code}); see the error above"
                bench["gpu"] = {"failed": gpu_failed}
            else:
                derive_scaling(got["scaling"], cpus, plan["threads_per_rank"])
                derive_no_sync(got["no_sync"])
                bench["gpu"] = {"config": cfg, "backend": "nccl", "gpus": gpus, **got}
                if got["bucketing"]:
                    bench["gpu"]["bucketing"] = bucketing_section(cfg["bucketing"], got["bucketing"])
                    bench["gpu"]["no_sync"] = {"config": cfg["no_sync"], "model": "recipe.MLP",
                                               "rows": got["no_sync"]}
                if gpus < 2:
                    skipped = "needs 2 or more GPUs"
                    bench["gpu"]["dataparallel_skipped"] = f"DataParallel vs DDP {skipped}"
                    bench["gpu"]["bucketing_skipped"] = f"bucketing and no_sync on GPUs {skipped}"

    machine["load_average_end"] = load_average()
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1) + "\n"
    atomic_write(results_path, lambda f: f.write(text.encode()))

    report.print_tables(ui, results)
    plots, note = report.draw_plots(results, args.out)
    ui.print(f"\nwrote {shown(results_path)}" + (f" and {len(plots)} plots" if plots else ""))
    if note:
        ui.print(f"[yellow]plots:[/yellow] {note}")
    if plan["mode"] == "full" and not args.no_doc and not args.only:
        from bench import doc
        written = doc.write_doc(results_path, args.doc, args.img, publish=args.publish)
        ui.print(f"wrote {', '.join(shown(p) for p in written)}")
    ui.print(f"the suite took {results['wall_seconds']:.0f} s")
    if "failed" in bench.get("gpu", {}):
        fail(f"{bench['gpu']['failed']}; the CPU results were written", code=1)
    check = bench.get("scaling", {}).get("check")
    if args.strict and check and check["applies"] and not check["met"]:
        fail(f"2 ranks reached {check['speedup']}x one rank's throughput; "
             f"at least {REQUIRED_SPEEDUP_2}x is required on a 2-core machine", code=1)


if __name__ == "__main__":
    run(main)
