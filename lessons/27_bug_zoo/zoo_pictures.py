"""Draw docs/27's picture from lesson 27's own run: for every bug of the zoo, how far the loss of
its run and of its fixed run are from the baseline's, step by step.

It runs the lesson once (the whole zoo, 2 ranks, CPU, the default 30 steps) into
runs/lesson-27-pictures/ and reads what it wrote in metrics.json: each row of `bugs` keeps the
three runs' losses (baseline, bug, fixed).

    .venv/bin/python lessons/27_bug_zoo/zoo_pictures.py            # writes docs/img/27_zoo.png
    .venv/bin/python lessons/27_bug_zoo/zoo_pictures.py --reuse    # the run already there
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "27_bug_zoo.py"
ZERO = 1e-9  # where a difference of 0 (bit for bit) is drawn on the log scale


def draw_zoo(metrics: dict, to: Path) -> str:
    """One panel per bug: |loss - loss_baseline| of the bug's run and of the fixed run, per step."""
    rows = metrics["bugs"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.4), sharex=True, sharey=True)
    for ax, row in zip(axes.flat, rows):
        base = row["losses"]["baseline"]
        steps = range(1, len(base) + 1)
        for key, color, label in (("bug", "#d62728", "the bug"), ("fixed", "#1f77b4", "fixed")):
            gaps = [max(ZERO, abs(a - b)) for a, b in zip(row["losses"][key], base)]
            ax.plot(steps, gaps, "o-", ms=2.5, lw=1, color=color, label=label)
        ax.axhline(1e-3, color="black", lw=0.7, ls="--")
        if row["name"] == "dcp-initial-lr":  # where it saved and resumed
            ax.axvline(len(base) // 2 + 0.5, color="#999999", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_ylim(ZERO / 2, 1)
        ax.set_title(f"{row['name']}\n{row['upstream'].split(' (')[0]}", fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("|loss - loss_baseline|")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle("Every bug's loss against the baseline, and the fixed run's (lesson 27, 2 ranks; dashed: 1e-3)",
                 fontsize=10)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="read the run already in runs/lesson-27-pictures")
    parser.add_argument("--to", type=Path, default=ROOT / "docs" / "img", help="folder for the PNG file")
    args = parser.parse_args()
    run = ROOT / "runs" / "lesson-27-pictures"
    if not (args.reuse and (run / "metrics.json").exists()):
        subprocess.run([sys.executable, str(LESSON), "--device", "cpu", "--out", str(run)],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=1800)
    print(draw_zoo(json.loads((run / "metrics.json").read_text()), args.to / "27_zoo.png"))


if __name__ == "__main__":
    main()
