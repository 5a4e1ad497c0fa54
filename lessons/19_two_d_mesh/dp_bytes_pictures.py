"""Draw docs/19's picture from lesson 19's own planner runs: what data parallel costs per step
as micro-batches grow the batch, for DDP and ZeRO-1/2/3.

It runs the lesson's planner (`--plan 7e9 --gpus 64`, no processes) for 1, 2, 4, 8 and 16
micro-batches per step, into runs/lesson-19-pictures-m<M>/, and reads each run's plan.json:
every layout's bytes sent per GPU per step, by dimension, and its step time and MFU. Left: the
GB each GPU sends across dp per step, on a linear axis (DDP and ZeRO-1 accumulate the
micro-batches' gradients locally and send once; ZeRO-2 reduce-scatters every micro-batch's,
ZeRO-3 also gathers the weights twice in each). Right: the MFU with perfect overlap, from the
same rows.

    .venv/bin/python lessons/19_two_d_mesh/dp_bytes_pictures.py    # writes docs/img/19_dp_bytes.png

Or from planner runs you made yourself (any flags; one --microbatches each):
    --from runs/a runs/b --to /tmp/mine.png
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "19_two_d_mesh.py"
STAGES = {0: ("DDP", "#7f7f7f"), 1: ("ZeRO-1", "#1f77b4"), 2: ("ZeRO-2", "#2ca02c"), 3: ("ZeRO-3", "#d62728")}
MICROBATCHES = (1, 2, 4, 8, 16)


def draw(runs: list[Path], to: Path) -> str:
    """One PNG: per data-parallel layout (tp = pp = 1), dp GB sent and MFU against micro-batches."""
    plans = sorted((json.loads((run / "plan.json").read_text()) for run in runs),
                   key=lambda p: p["model"]["microbatches"])
    fig, (sent, mfu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for zero, (name, color) in STAGES.items():
        points = [(row["micro_batches"], row) for plan in plans for row in plan["rows"]
                  if row["zero"] == zero and row["tp"] == row["pp"] == 1]
        if not points:
            continue
        m = [x for x, _ in points]
        label = points[0][1]["layout"]
        sent.plot(m, [r["bytes_sent"]["dp"] / 1e9 for _, r in points], "o-", color=color, label=label)
        mfu.plot(m, [100 * r["mfu_overlap"] for _, r in points], "o-", color=color, label=label)
    first = plans[0]
    sent.set_ylabel("GB each GPU sends across dp per step")
    mfu.set_ylabel("MFU with perfect overlap, %")
    for ax in (sent, mfu):
        ax.set_xticks([p["model"]["microbatches"] for p in plans], [str(p["model"]["microbatches"]) for p in plans])
        ax.set_xlabel("micro-batches per optimizer step (each dp rank)")
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=8, frameon=False, loc="upper left" if ax is sent else "center right")
    mfu.set_ylim(0, 100)
    mfu.axhline(75, color="black", lw=0.8, ls=":")  # 6 / 8: recompute's FLOPs are not the model's
    mfu.text(plans[0]["model"]["microbatches"], 77, "75% = 6/8: the recomputed forward", fontsize=8)
    a = first["assumed"]
    fig.suptitle(f"Lesson 19's planner: a {first['model']['params'] / 1e9:g}B model on {first['gpus']} GPUs "
                 f"({first['gpus_per_node']} per node), mixed precision. ASSUMED: "
                 f"{a['infiniband_bytes_per_s'] / 1e9:g} GB/s between nodes, "
                 f"{a['peak_flops_per_s'] / 1e12:g} TFLOP/s reached", fontsize=9)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="runs", type=Path, nargs="+", help="lesson 19 --plan run folders (default: run the planner)")
    parser.add_argument("--to", type=Path, help="the PNG to write (with --from)")
    args = parser.parse_args()
    if args.runs:
        print(draw(args.runs, args.to or args.runs[0] / "dp_bytes.png"))
        return
    runs = []
    for m in MICROBATCHES:
        run = ROOT / "runs" / f"lesson-19-pictures-m{m}"
        subprocess.run([sys.executable, str(LESSON), "--plan", "7e9", "--gpus", "64", "--microbatches", str(m),
                        "--out", str(run)], check=True, stdout=subprocess.DEVNULL, timeout=600)
        runs.append(run)
    print(draw(runs, ROOT / "docs" / "img" / "19_dp_bytes.png"))


if __name__ == "__main__":
    main()
