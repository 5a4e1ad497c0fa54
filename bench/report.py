"""Tables and plots from results.json. The same tables are printed (rich) and written into
docs/PERFORMANCE.md (Markdown), so the terminal and the doc never disagree."""
from __future__ import annotations

from pathlib import Path

from bench.words import num, spread  # noqa: F401 (bench.doc and tests use report.num)

INSTALL_HINT = ".venv/bin/pip install -r requirements-bench.txt"


# ---------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------

def cap_label(cap) -> str:
    return "25 (default)" if cap is None else f"{cap:g}"


def mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.3g}"


def calls(k: float) -> str:
    return f"{k:g} call" + ("" if k == 1 else "s")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


# ---------------------------------------------------------------------------------------
# Tables: (title, columns, rows) each, used by the terminal and by the doc
# ---------------------------------------------------------------------------------------

def scaling_label(r: dict) -> str:
    if r["variant"] == "no_ddp":
        t = r.get("threads_per_rank", 1)
        return f"1 process, no DDP, {t} thread" + ("s" if t != 1 else "")
    return f"DDP, {r['world_size']} rank" + ("s" if r["world_size"] > 1 else "")


def scaling_table(section: dict, device: str = "CPU, gloo") -> tuple[str, list[str], list[list]]:
    cfg = section["config"]
    rows = []
    for r in section["rows"]:
        rows.append([scaling_label(r), r.get("threads_per_rank", "-"), r["per_rank_batch"],
                     num(r["samples_per_s"]["median"]), spread(r["samples_per_s"]),
                     f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                     pct(r.get("efficiency")),
                     pct(r["cpu_busy"]["median"]) if "cpu_busy" in r else "-"])
    title = (f"DDP throughput ({device}): recipe MLP with hidden {cfg['hidden']}, global batch "
             f"{cfg['global_batch']} for every world size (strong scaling)")
    return title, ["run", "threads/rank", "batch/rank", "samples/s", "min - max", "speedup",
                   "efficiency", "CPU busy"], rows


def bucketing_table(section: dict) -> tuple[str, list[str], list[list]]:
    cfg = section["config"]
    rows = []
    for r in section["rows"]:
        rows.append([cap_label(r["bucket_cap_mb"]),
                     "yes" if r["overlap"] else "no (deferred)",
                     r["buckets_expected"], f"{r['calls_per_backward']:g}",
                     mb(r["bytes_per_backward"]),
                     num(r["samples_per_s"]["median"]), spread(r["samples_per_s"])])
    total = sum(cfg["param_bytes"])
    title = (f"DDP bucketing on {section['rows'][0]['world_size'] if section['rows'] else 2} ranks: "
             f"{cfg['layers'] + 2}-layer MLP, hidden {cfg['hidden']}, "
             f"{len(cfg['param_bytes'])} gradient tensors, {total / 1e6:.3g} MB, "
             f"global batch {cfg['global_batch']}")
    return title, ["bucket_cap_mb", "overlap", "buckets (DDP's rule)", "all-reduces/backward",
                   "MB/backward", "samples/s", "min - max"], rows


def allreduce_table(section: dict) -> tuple[str, list[str], list[list]]:
    rows = []
    for r in section["rows"]:
        sent = r.get("busiest_sent")
        match = r.get("matches_formula")
        rows.append([r["world_size"], f"{r['size']:,}", r["algorithm"],
                     num(r["time_ms"]["median"]), spread(r["time_ms"]),
                     num(r["algbw_GBps"]), num(r["busbw_GBps"]),
                     "not counted" if sent is None else mb(sent),
                     mb(r.get("formula_busiest_sent")),
                     "-" if match is None else ("yes" if match else "NO")])
    title = ("All-reduce of S float32 values on N ranks (gloo): lesson 10's parameter server "
             "and ring vs dist.all_reduce")
    return title, ["N", "S (floats)", "algorithm", "ms", "min - max", "algbw GB/s",
                   "busbw GB/s", "busiest rank sent MB", "formula MB", "bytes match"], rows


def no_sync_table(section: dict) -> tuple[str, list[str], list[list]]:
    rows = []
    for r in section["rows"]:
        rows.append([r["config"], f"hidden {r['hidden']}, {r['micro_batch']}/rank",
                     r["method"], num(r["step_ms"]["median"]), spread(r["step_ms"]),
                     f"{r['calls_per_step']:g}", mb(r["bytes_per_step"]),
                     time_change(r.get("saved_fraction")) if r["method"] == "no_sync" else ""])
    acc = section["config"]["accum"]
    return (f"Gradient accumulation over {acc} micro-batches on 2 ranks: time per optimizer step",
            ["config", "micro-batch", "method", "ms/step", "min - max", "all-reduces/step",
             "MB sent/step", "step time vs naive"], rows)


def time_change(saved: float | None) -> str:
    """A saving as the signed change of a step's time: 0.51 -> "-51%", -0.28 -> "+28%"."""
    return "-" if saved is None else f"{round(-saved * 100):+d}%"


def gpu_tables(section: dict) -> list[tuple[str, list[str], list[list]]]:
    if "skipped" in section or "failed" in section:
        return []
    tables = [scaling_table({"config": section["config"], "rows": section["scaling"]},
                            device="CUDA, NCCL")]
    for key, make in (("bucketing", bucketing_table), ("no_sync", no_sync_table)):
        if section.get(key, {}).get("rows"):
            title, columns, rows = make(section[key])
            tables.append((f"GPUs, NCCL: {title}", columns, rows))
    if section.get("dataparallel"):
        ddp = {r["world_size"]: r for r in section["scaling"] if r["variant"] == "ddp"}
        rows = []
        for dp in section["dataparallel"]:
            other = ddp.get(dp["world_size"])
            rows.append([f"DataParallel, 1 process, {dp['gpus']} GPUs",
                         num(dp["samples_per_s"]["median"]), spread(dp["samples_per_s"])])
            if other:
                rows.append([f"DDP, {dp['gpus']} processes, {dp['gpus']} GPUs",
                             num(other["samples_per_s"]["median"]), spread(other["samples_per_s"])])
        tables.append(("DataParallel vs DDP, same model and global batch",
                       ["run", "samples/s", "min - max"], rows))
    if section.get("allreduce"):
        rows = [[r["world_size"], f"{r['size']:,}", num(r["time_ms"]["median"]),
                 spread(r["time_ms"]), num(r["algbw_GBps"]), num(r["busbw_GBps"])]
                for r in section["allreduce"]]
        tables.append(("dist.all_reduce on NCCL", ["N", "S (floats)", "ms", "min - max",
                                                   "algbw GB/s", "busbw GB/s"], rows))
    return tables


def all_tables(results: dict) -> list[tuple[str, tuple]]:
    """(benchmark name, table) in the order of the report."""
    b = results["benchmarks"]
    out = []
    if "scaling" in b:
        out.append(("scaling", scaling_table(b["scaling"])))
    if "bucketing" in b:
        out.append(("bucketing", bucketing_table(b["bucketing"])))
    if "allreduce" in b:
        out.append(("allreduce", allreduce_table(b["allreduce"])))
    if "no_sync" in b:
        out.append(("no_sync", no_sync_table(b["no_sync"])))
    if "gpu" in b:
        out += [("gpu", t) for t in gpu_tables(b["gpu"])]
    from bench import sharded_transformer  # Part 2's transformer: FSDP2, tensor parallel, pipelines
    return out + sharded_transformer.all_tables(b)


def print_tables(ui, results: dict) -> None:
    for _, (title, columns, rows) in all_tables(results):
        ui.print()
        ui.table(title, columns, rows)
    b = results["benchmarks"]
    check = b.get("scaling", {}).get("check")
    if check and check["speedup"] is not None:
        verdict = "met" if check["met"] else "NOT met"
        where = "" if check["applies"] else " (the 1.6x target is for 2 cores, 1 thread per rank)"
        ui.print(f"\n2 ranks vs 1: [bold]{check['speedup']:.2f}x[/bold] "
                 f"(target {check['required_speedup']}x: {verdict}){where}")
        for r in b["scaling"]["rows"]:
            if "speedup_vs_same_cores" in r:  # the fair comparison: the same cores in all
                ui.print(f"{r['world_size']} ranks vs 1 process with as many threads: "
                         f"[bold]{r['speedup_vs_same_cores']:.2f}x[/bold]")
    if "gpu" in b and "skipped" in b["gpu"]:
        ui.print(f"\nGPU benchmarks: skipped: {b['gpu']['skipped']}")
    elif "gpu" in b and "failed" in b["gpu"]:
        ui.print(f"\nGPU benchmarks: FAILED: {b['gpu']['failed']}")
    elif "gpu" in b and b["gpu"].get("dataparallel_skipped"):
        ui.print(f"\nDataParallel vs DDP: skipped: {b['gpu']['dataparallel_skipped']}")


# ---------------------------------------------------------------------------------------
# Plots (matplotlib is optional: requirements-bench.txt)
# ---------------------------------------------------------------------------------------

def _err(stats: list[dict]):
    return [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]


def draw_plots(results: dict, folder: Path) -> tuple[list[Path], str | None]:
    """PNG files in `folder`; without matplotlib, no files and a note saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no window, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return [], f"matplotlib is not installed, so no plots were drawn; install it with " \
                   f"`{INSTALL_HINT}` and rerun"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    b = results["benchmarks"]
    paths = []

    def save(fig, name):
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    def scaling_plot(rows, name, what):
        ddp = [r for r in rows if r["variant"] == "ddp"]
        if not ddp:
            return
        n = [r["world_size"] for r in ddp]
        stats = [r["samples_per_s"] for r in ddp]
        fig, (a, e) = plt.subplots(1, 2, figsize=(9, 3.6))
        a.errorbar(n, [s["median"] for s in stats], yerr=_err(stats), marker="o", capsize=4,
                   label="measured (median, min-max)")
        a.plot(n, [stats[0]["median"] * k for k in n], "--", color="gray", label="ideal: N x one rank")
        a.set_xlabel("ranks")
        a.set_ylabel("samples/s")
        a.set_xticks(n)
        a.set_title(f"DDP throughput, {what}")
        a.legend(fontsize=8)
        e.bar([str(k) for k in n], [r.get("efficiency", 0) * 100 for r in ddp], color="tab:green")
        e.axhline(100, color="gray", linestyle="--")
        e.set_xlabel("ranks")
        e.set_ylabel("scaling efficiency %")
        e.set_title("efficiency = X_N / (N X_1)")
        save(fig, name)

    if "scaling" in b:
        scaling_plot(b["scaling"]["rows"], "scaling.png", "CPU / gloo")

    if "bucketing" in b:
        rows = b["bucketing"]["rows"]
        labels = [f"cap {cap_label(r['bucket_cap_mb'])} MiB, {calls(r['calls_per_backward'])}"
                  + ("" if r["overlap"] else ", deferred") for r in rows]
        stats = [r["samples_per_s"] for r in rows]
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
        colors = ["tab:blue" if r["overlap"] else "tab:orange" for r in rows]
        ax.barh(labels, [s["median"] for s in stats], xerr=_err(stats), color=colors, capsize=4)
        ax.invert_yaxis()
        ax.set_xlabel("samples/s (median, min-max)")
        ax.set_title("DDP bucket size and overlap")
        ax.set_ylabel("blue: overlapped; orange: after backward", fontsize=8)
        save(fig, "bucketing.png")

    if "allreduce" in b:
        rows = b["allreduce"]["rows"]
        worlds = sorted({r["world_size"] for r in rows})
        fig, axes = plt.subplots(1, len(worlds), figsize=(4 * len(worlds), 3.6), squeeze=False)
        for ax, n in zip(axes[0], worlds):
            for algo in ("server", "ring", "dist.all_reduce"):
                sel = [r for r in rows if r["world_size"] == n and r["algorithm"] == algo]
                stats = [r["time_ms"] for r in sel]
                ax.errorbar([r["size"] for r in sel], [s["median"] for s in stats],
                            yerr=_err(stats), marker="o", capsize=3, label=algo)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("S (float32 values)")
            ax.set_ylabel("ms per all-reduce")
            ax.set_title(f"N = {n} ranks")
            ax.legend(fontsize=8)
        save(fig, "allreduce_time.png")

        big = max(r["size"] for r in rows)
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for algo, color in (("server", "tab:red"), ("ring", "tab:blue")):
            sel = [r for r in rows if r["algorithm"] == algo and r["size"] == big]
            ax.plot([r["world_size"] for r in sel], [r["busiest_sent"] / r["bytes"] for r in sel],
                    "o", color=color, label=f"{algo}, measured")
            ax.plot([r["world_size"] for r in sel],
                    [r["formula_busiest_sent"] / r["bytes"] for r in sel], "--", color=color,
                    label=f"{algo}, formula")
        ax.set_xticks(worlds)
        ax.set_xlabel("N ranks")
        ax.set_ylabel("bytes sent by the busiest rank / S bytes")
        ax.set_title(f"Traffic of the busiest rank, S = {big:,} floats")
        ax.legend(fontsize=8)
        save(fig, "allreduce_bytes.png")

    if "no_sync" in b:
        rows = b["no_sync"]["rows"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3.4), squeeze=False)
        for ax, config in zip(axes[0], configs):
            sel = [r for r in rows if r["config"] == config]
            stats = [r["step_ms"] for r in sel]
            ax.bar([f"{r['method']}\n{r['calls_per_step']:g} all-reduces" for r in sel],
                   [s["median"] for s in stats], yerr=_err(stats), capsize=4,
                   color=["tab:orange", "tab:blue"][:len(sel)])
            ax.set_ylabel("ms per optimizer step")
            ax.set_title(config)
        save(fig, "no_sync.png")

    if "gpu" in b and "scaling" in b["gpu"]:
        scaling_plot(b["gpu"]["scaling"], "gpu_scaling.png", "CUDA / NCCL")
    return paths, None
