"""Draw docs/26's pictures from lesson 26's own runs: every entry of step 1 against its floor,
in the order it happened, with and without a bug; and how the difference from lesson 13 grows
over 120 steps, beside the layout's distance from its own float64 twin.

It runs the lesson five times (2 ranks, CPU): without a bug and with --bug grad-sum for the
default 120 steps, and --bug data-shift, --layout tp --bug tp-bias and --layout tp --bug sp-norm
for one step, into runs/lesson-26-pictures-<name>/, and reads what each run wrote in
metrics.json: entries (step, pass, entry, |A - B|, floor, ratio, in order) and weights_gap and
weights_gap_to_float64_twin (Step 5's columns).

    .venv/bin/python lessons/26_parity_oracle/parity_pictures.py
        # writes docs/img/26_first_step.png and docs/img/26_growth.png
    .venv/bin/python lessons/26_parity_oracle/parity_pictures.py --reuse   # the runs already there
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "26_parity_oracle.py"
RUNS = {  # name: (flags, label)
    "clean": ([], "ddp, no bug"),
    "grad-sum": (["--bug", "grad-sum"], "ddp, --bug grad-sum"),
    "data-shift": (["--bug", "data-shift", "--steps", "1", "--record-steps", "1"], "ddp, --bug data-shift"),
    "tp-bias": (["--layout", "tp", "--bug", "tp-bias", "--steps", "1", "--record-steps", "1"], "tp, --bug tp-bias"),
    "sp-norm": (["--layout", "tp", "--bug", "sp-norm", "--steps", "1", "--record-steps", "1"], "tp, --bug sp-norm"),
}
ZERO = 1e-3  # where a ratio of 0 (bit for bit) is drawn on the log scale


def draw_first_step(metrics: dict, to: Path) -> str:
    """One row per run: step 1's entries in order, their ratio to the floor (log), the line at 1."""
    fig, axes = plt.subplots(len(metrics), 1, figsize=(11, 1.6 * len(metrics) + 0.6), sharex=True)
    for ax, (name, m) in zip(axes, metrics.items()):
        rows = [e for e in m["entries"] if e[0] == 1]
        ratios = [ZERO if r == 0 else (1e9 if r is None else r) for *_, r in rows]
        forward = sum(e[1] == "forward" for e in rows)
        first = next((i for i, r in enumerate(ratios) if r > 1), None)
        ax.scatter(range(len(ratios)), ratios, s=10, c=["#d62728" if r > 1 else "#1f77b4" for r in ratios])
        ax.axhline(1, color="black", lw=0.8)
        ax.axvline(forward - 0.5, color="#999999", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(ZERO / 2, 1e8)
        ax.set_ylabel("ratio", fontsize=8)
        ax.set_title(RUNS[name][1] + (f": first divergence {rows[first][1]}, {rows[first][2]}" if first is not None
                                      else ": within rounding everywhere"), fontsize=9, loc="left")
        if first is not None:
            ax.annotate(rows[first][2], (first, ratios[first]), textcoords="offset points", xytext=(6, -4), fontsize=8)
    axes[-1].set_xlabel(f"step 1's entries in the order they happened: {forward} forward outputs, then "
                        f"{len(ratios) - forward} gradients (a ratio of 0, bit for bit, is drawn at {ZERO:g})")
    fig.suptitle("max |A - B| / floor, entry by entry (lesson 26, 2 ranks): above the line is not rounding", fontsize=10)
    return save_figure(fig, to)


def draw_growth(metrics: dict, to: Path) -> str:
    """The layout's weights against lesson 13's, and against their own float64 twin, step by step."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, color in (("clean", "#1f77b4"), ("grad-sum", "#d62728")):
        gaps, twin = metrics[name]["weights_gap"], metrics[name]["weights_gap_to_float64_twin"]
        steps = sorted(map(int, gaps))
        ax.plot(steps, [gaps[str(s)] for s in steps], "o-", color=color, label=f"{RUNS[name][1]}: vs one process")
        ax.plot(steps, [twin[str(s)] for s in steps], "s--", color=color, alpha=0.6,
                label=f"{RUNS[name][1]}: vs its own float64 twin")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("max |w - w'| over every weight")
    ax.set_title("Rounding grows over the steps; a bug starts big (lesson 26, 2 ranks)", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="read the runs already in runs/lesson-26-pictures-*")
    parser.add_argument("--to", type=Path, default=ROOT / "docs" / "img", help="folder for the PNG files")
    args = parser.parse_args()
    metrics = {}
    for name, (flags, _) in RUNS.items():
        run = ROOT / "runs" / f"lesson-26-pictures-{name}"
        if not (args.reuse and (run / "metrics.json").exists()):
            subprocess.run([sys.executable, str(LESSON), "--device", "cpu", *flags, "--out", str(run)],
                           check=True, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=1800)
        metrics[name] = json.loads((run / "metrics.json").read_text())
    print(draw_first_step(metrics, args.to / "26_first_step.png"))
    print(draw_growth(metrics, args.to / "26_growth.png"))


if __name__ == "__main__":
    main()
