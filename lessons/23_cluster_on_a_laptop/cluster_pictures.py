"""Draw docs/23's picture from lesson 23's own runs: what rank 0 holds and sends per step, as
the job grows from 8 to 1,024 ranks, measured under the fake process group beside lesson 19's
planner.

It runs the lesson for the 1b model, tensor parallel across 8 ranks and FSDP2 across the rest
(dp = 1, 8, 64, 128: 8 to 1,024 ranks), into runs/lesson-23-pictures/W/, and reads what each
run saved in metrics.json: per_rank (measured) and planner (lesson 19's formulas).

    .venv/bin/python lessons/23_cluster_on_a_laptop/cluster_pictures.py   # writes docs/img/23_bytes_per_rank.png

Or from runs you made yourself (any flags):  --from runs/a runs/b --to /tmp/mine.png
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "23_cluster_on_a_laptop.py"
WORLDS = (8, 64, 512, 1024)  # tp 8 x dp 1, 8, 64, 128
SERIES = [("held_bytes", "parameters", "parameters held", "#1f77b4"),
          ("held_bytes", "optimizer_state", "AdamW state held", "#2ca02c"),
          ("sent_bytes", "dp", "sent across dp (FSDP2)", "#d62728"),
          ("sent_bytes", "tp", "sent across tp", "#9467bd")]


def run_lesson(world: int) -> Path:
    out = ROOT / "runs" / "lesson-23-pictures" / str(world)
    subprocess.run([sys.executable, str(LESSON), "--model", "1b", "--world-size", str(world), "--tp", "8",
                    "--out", str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def draw(folders: list[Path], to: Path) -> str:
    runs = sorted((json.loads((Path(f) / "metrics.json").read_text()) for f in folders), key=lambda m: m["world_size"])
    worlds = [m["world_size"] for m in runs]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    mib = lambda b: b / 2**20 if b else float("nan")  # dp 1 sends nothing: no point on a log scale
    for group, key, label, color in SERIES:
        ax.plot(worlds, [mib(m["per_rank"][group][key]) for m in runs], "o", color=color, label=f"{label}: measured")
        ax.plot(worlds, [mib(m["planner"][group][key]) for m in runs], "-", color=color, alpha=0.5,
                label="lesson 19's planner" if key == "parameters" else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(worlds, [f"{w:,}" for w in worlds])
    ax.set_xlabel("ranks in the job (tensor parallel 8 x FSDP2 across the rest)")
    ax.set_ylabel("MiB on rank 0, one step (fp32)")
    ax.set_title(f"Rank 0 of a {runs[0]['parameters'] / 1e9:.2f}B-parameter job, one process, fake ranks")
    ax.legend(fontsize=8, loc="center left")
    ax.grid(True, which="major", alpha=0.3)
    return save_figure(fig, Path(to), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="folders", nargs="+", type=Path, help="lesson 23 runs to draw")
    parser.add_argument("--to", type=Path, default=ROOT / "docs" / "img" / "23_bytes_per_rank.png")
    args = parser.parse_args()
    print(draw(args.folders or [run_lesson(w) for w in WORLDS], args.to))


if __name__ == "__main__":
    main()
