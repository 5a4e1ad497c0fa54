"""Draw docs/17's picture from lesson 17's own runs: the collectives of one block, tensor
parallel against tensor + sequence parallel.

It runs the lesson by hand on 2 ranks for a few steps, without and with --sequence-parallel,
into runs/lesson-17-pictures-tp/ and -sp/, and reads what the lesson measured and saved in
metrics.json: collectives.block_sequence, the last block's collectives of one training step in
the order CommLog recorded them (phase, kind, the module running, bytes this rank sent). Each
becomes a box as wide as the bytes it sent, placed after the ones before it:

    .venv/bin/python lessons/17_tensor_parallel/block_collective_pictures.py    # writes docs/img/17_block_collectives.png

Or from runs you made yourself (any flags, e.g. --impl dtensor --world-size 4):
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
LESSON = ROOT / "lessons" / "17_tensor_parallel.py"
COLORS = {"all_reduce": "#d62728", "all_gather": "#1f77b4", "reduce_scatter": "#2ca02c"}
NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
# Where each kind sits, by the lesson's pairs (f: a sublayer's input, g: its output):
# tensor parallel's g all-reduces in forward, f in backward; sequence parallel's f_sp
# all-gathers in forward and reduce-scatters in backward, g_sp the other way round.
SIDE = {("forward", "all_reduce"): "output", ("backward", "all_reduce"): "input",
        ("forward", "all_gather"): "input", ("backward", "reduce_scatter"): "input",
        ("forward", "reduce_scatter"): "output", ("backward", "all_gather"): "output"}


def rows(metrics: dict) -> list[tuple[str, list]]:
    """(label, [(kind, where it sits, bytes sent), ...]) for forward and backward of one run."""
    name = ("DTensor" if metrics["impl"] == "dtensor" else "by hand") + (
        ", sequence parallel" if metrics["sequence_parallel"] else ", tensor parallel")
    calls = metrics["collectives"]["block_sequence"]
    out = []
    for phase in ("forward", "backward"):
        mine = [(k, m, b) for p, k, m, b in calls if p == phase]
        order = ["attn", "mlp"] if phase == "forward" else ["mlp", "attn"]  # backward: from the end
        out.append((f"{name}\n{phase}", [  # each sublayer makes half of them (f and g)
            (k, f"at {order[i * 2 // len(mine)]}'s {SIDE.get((phase, k), '?')}", b) for i, (k, m, b) in enumerate(mine)]))
    return out


def draw(runs: list[Path], to: Path) -> str:
    """One PNG: for each run, a row per direction, its block's collectives as boxes."""
    metrics = [json.loads((run / "metrics.json").read_text()) for run in runs]
    lines = [row for m in metrics for row in rows(m)]
    fig, ax = plt.subplots(figsize=(11, 0.9 * len(lines) + 1.3))
    for y, (label, calls) in enumerate(reversed(lines)):
        x = 0.0
        for kind, where, sent in calls:
            width = sent / 1024  # KiB
            ax.barh(y, width, left=x, height=0.6, color=COLORS.get(kind, "grey"), edgecolor="white")
            ax.text(x + width / 2, y, f"{NAMES.get(kind, kind)}\n{where}", ha="center", va="center",
                    fontsize=7, color="white")
            x += width
        ax.text(x + 8, y, f"{x:,.0f} KiB", va="center", fontsize=8)
    ax.set_yticks(range(len(lines)), [label for label, _ in reversed(lines)], fontsize=8)
    ax.set_xlabel("KiB this rank sends in one block, in the order the collectives ran "
                  "(backward runs the block from its end)")
    world = metrics[0]["world_size"]
    ax.set_title(f"Lesson 17: one block's collectives on {world} ranks, measured (CommLog). Tensor parallel: "
                 f"an all-reduce where a sublayer's output leaves (g); sequence parallel: a reduce-scatter "
                 f"there and an all-gather where the next sublayer's input enters (f)", fontsize=9, wrap=True)
    ax.spines[["top", "right"]].set_visible(False)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="runs", type=Path, nargs="+", help="lesson 17 run folders (default: run the lesson)")
    parser.add_argument("--to", type=Path, help="the PNG to write (with --from)")
    args = parser.parse_args()
    if args.runs:
        print(draw(args.runs, args.to or args.runs[0] / "block_collectives.png"))
        return
    runs = []
    for name, flags in (("tp", []), ("sp", ["--sequence-parallel"])):
        run = ROOT / "runs" / f"lesson-17-pictures-{name}"
        subprocess.run([sys.executable, str(LESSON), "--world-size", "2", "--steps", "2", "--device", "cpu",
                        "--out", str(run), *flags], check=True, stdout=subprocess.DEVNULL, timeout=600)
        runs.append(run)
    print(draw(runs, ROOT / "docs" / "img" / "17_block_collectives.png"))


if __name__ == "__main__":
    main()
