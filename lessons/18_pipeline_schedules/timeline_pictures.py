"""Draw docs/18's pictures from lesson 18's own runs: every schedule's timeline, one above the other.

For each world size (2 and 4 ranks, M=4 micro-batches) it runs the lesson for one training
step into runs/lesson-18-pictures-p<P>/, reads the timelines the lesson measured and saved in
metrics.json (the actions every rank ran, placed in time by pipeline.timeline), and draws
them with pipeline.plot, the same drawing as the lesson's own timeline-<schedule>.png files,
but on one time axis for all four: the lesson's unit is one stage's forward, and interleaved's
stages are half a rank's share of the model, so here its times are halved (in general: times
x P / the stages that hold a piece; pass-through stages hold none).

    .venv/bin/python lessons/18_pipeline_schedules/timeline_pictures.py    # writes docs/img/18_timelines_p2.png, _p4.png

Or from a run you made yourself (any flags): --from runs/lesson-18 --to /tmp/mine.png
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

from pipeline import plot  # noqa: E402  (this folder: the lesson's own drawing)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "18_pipeline_schedules.py"


def draw(run: Path, to: Path) -> str:
    """One PNG with every schedule of the run in `run`'s metrics.json, on one time axis."""
    metrics = json.loads((run / "metrics.json").read_text())
    schedules = metrics["schedules"]
    ranks = metrics["world_size"]
    fig, axes = plt.subplots(len(schedules), 1, sharex=True,
                             figsize=(11, len(schedules) * (0.45 * ranks + 0.8) + 0.4))
    for ax, (name, s) in zip(axes, schedules.items()):
        acts = [(r, start, end, re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()) for r, start, end, a in s["timeline"]]
        stages = 1 + max(int(stage) for *_, (stage, _, _) in acts)
        scale = ranks / (stages - len(s["pass_through_stages"]))  # a stage's share of a rank's work
        tl = [(r, start * scale, end * scale, (int(st), k, int(m))) for r, start, end, (st, k, m) in acts]
        formula = "" if s["bubble_formula"] is None else f", formula {s['bubble_formula']:.1%}"
        empty = f"; stages {', '.join(map(str, s['pass_through_stages']))} pass through" if s["pass_through_stages"] else ""
        plot(ax, tl, f"{name}: idle {s['bubble_fraction']:.1%}{formula}{empty}")
    for ax in axes[:-1]:
        ax.set_xlabel("")
    axes[-1].set_xlabel("time (1 unit = a forward of one rank's share of the model)")
    fig.suptitle(f"Lesson 18: P={ranks} ranks, M={metrics['microbatches']} micro-batches "
                 f"(F = forward, B = backward, I/W = its input and weight halves)", fontsize=10)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="run", type=Path, help="a lesson 18 run folder (default: run the lesson)")
    parser.add_argument("--to", type=Path, help="the PNG to write (with --from)")
    args = parser.parse_args()
    if args.run:
        print(draw(args.run, args.to or args.run / "timelines.png"))
        return
    for world in (2, 4):
        run = ROOT / "runs" / f"lesson-18-pictures-p{world}"
        subprocess.run([sys.executable, str(LESSON), "--world-size", str(world), "--steps", "1",
                        "--device", "cpu", "--out", str(run)], check=True, stdout=subprocess.DEVNULL, timeout=600)
        print(draw(run, ROOT / "docs" / "img" / f"18_timelines_p{world}.png"))


if __name__ == "__main__":
    main()
