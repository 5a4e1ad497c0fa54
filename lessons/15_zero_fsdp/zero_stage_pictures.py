"""Draw docs/15's pictures from lesson 15's own runs: who holds what under each ZeRO stage,
the peak of one step, and FSDP2's all-gather / compute / reduce-scatter per group.

It runs the lesson on 2 ranks for 6 steps with --strategy ddp, zero1 and fsdp, into
runs/lesson-15-pictures-<strategy>/, and reads what each run measured and saved in
metrics.json: per_rank_bytes_all (what every rank holds at rest), peak_memory_bytes_all and
peak_memory_breakdown (torch's MemTracker over the last step), fsdp_timeline (each group's
forward and backward, from its pre_ hook to its post_ hook, and each collective, in
milliseconds from the step's first hook: FSDPStory in sharded.py):

    .venv/bin/python lessons/15_zero_fsdp/zero_stage_pictures.py
        # writes docs/img/15_zero_stages.png and docs/img/15_fsdp_timeline.png

Or from runs you made yourself (any flags; the three strategies, in the order ddp, zero1, fsdp):
    --from runs/a runs/b runs/c --to /tmp/mine
ZeRO-2 is not a strategy of the lesson (exercise 15 builds it): its bar is zero1's
measured bytes with the gradients divided by N, the ZeRO paper's formula, and says so.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "15_zero_fsdp.py"
HELD = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer_state": "#2ca02c"}
MADE = "#9e9e9e"  # what the step itself makes: activations, temporaries, gathered weights
KINDS = {"all_gather": "#1f77b4", "reduce_scatter": "#2ca02c", "forward": "#c7c7c7", "backward": "#8c8c8c"}


def _mib(n: float) -> float:
    return n / 2 ** 20


def draw_stages(metrics: dict, to: Path) -> Path:
    """Left: what rank 0 holds at rest, by ZeRO stage; right: each strategy's peak in one step."""
    world = metrics["fsdp"]["world_size"]
    held = {name: metrics[name]["per_rank_bytes_all"][0]["measured"] for name in metrics}
    stages = [("DDP (nothing sharded)", held["ddp"], ""),
              ("ZeRO-1: optimizer state", held["zero1"], ""),
              ("ZeRO-2: + gradients", {**held["zero1"], "gradients": held["zero1"]["gradients"] / world},
               " (formula)"),
              ("ZeRO-3 / FSDP2: + weights", held["fsdp"], "")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1.15]})
    for y, (label, parts, note) in enumerate(reversed(stages)):
        x = 0.0
        for key, color in HELD.items():
            left.barh(y, _mib(parts[key]), left=x, color=color, height=0.6,
                      label=key.replace("_", " ") if y == 0 else None)
            x += _mib(parts[key])
        left.text(x + 0.02, y, f"{x:.2f} MiB{note}", va="center", fontsize=8)
    left.set_yticks(range(len(stages)), [s[0] for s in reversed(stages)], fontsize=8)
    left.set_xlabel(f"MiB rank 0 holds at rest, {world} ranks (measured from its tensors)")
    left.set_xlim(0, _mib(16 * metrics["ddp"]["per_rank_bytes_all"][0]["measured"]["parameters"] / 4) * 1.35)
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    names = [("ddp", "DDP"), ("zero1", "ZeRO-1"), ("fsdp", "FSDP2")]
    for y, (name, label) in enumerate(reversed(names)):
        rest = sum(held[name].values())
        peak = metrics[name]["peak_memory_bytes"]
        right.barh(y, _mib(rest), color="#444444", height=0.6, label="held at rest" if y == 0 else None)
        right.barh(y, _mib(peak - rest), left=_mib(rest), color=MADE, height=0.6,
                   label="made by the step (activations, temporaries, gathered weights)" if y == 0 else None)
        right.text(_mib(peak) + 0.1, y, f"{_mib(peak):.2f} MiB", va="center", fontsize=8)
    right.set_yticks(range(len(names)), [label for _, label in reversed(names)], fontsize=8)
    right.set_xlabel(f"MiB at the peak of one training step, rank 0 (torch's MemTracker)")
    right.set_xlim(0, _mib(max(m["peak_memory_bytes"] for m in metrics.values())) * 1.2)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    fig.suptitle(f"Lesson 15 on {world} ranks: each ZeRO stage shards one more row of lesson 13's "
                 f"table; the peak of a step also holds what the batch makes, which sharding leaves as it is",
                 fontsize=9)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    return save_figure(fig, to)


def draw_timeline(metrics: dict, to: Path) -> Path:
    """FSDP2's groups, one row each: forward and backward spans, the collectives it issued."""
    events = metrics["fsdp_timeline"]
    groups = sorted({g for *_, g in events}, key=lambda g: (g != "root", g), reverse=True)
    fig, ax = plt.subplots(figsize=(12, 0.8 * len(groups) + 1.4))
    seen, shortest = set(), max(end for _, end, *_ in events) / 200  # drawn at least this wide
    for start, end, what, group in events:
        y = groups.index(group)
        compute = what in ("forward", "backward")
        ax.barh(y + (0.0 if compute else 0.22), max(end - start, shortest), left=start,
                height=0.5 if compute else 0.3, color=KINDS.get(what, "black"),
                label=None if what in seen else what.replace("_", "-"), zorder=1 if compute else 2)
        seen.add(what)
    ax.set_yticks(range(len(groups)), groups)
    ax.set_xlabel("ms from the step's first hook, rank 0. CPU and gloo: the order is the lesson's, the "
                  "durations this machine's; a collective's bar includes waiting for the other rank", fontsize=8)
    world = metrics["world_size"]
    ax.set_title(f"FSDP2 on {world} ranks, one training step: each block all-gathered before its forward "
                 f"and again (prefetched) before its backward, reduce-scattered after it; the root "
                 f"gathered once", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    return save_figure(fig, to)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="runs", type=Path, nargs=3, help="ddp, zero1 and fsdp run folders "
                        "(default: run the lesson)")
    parser.add_argument("--to", type=Path, help="the folder for the PNGs (with --from)")
    args = parser.parse_args()
    runs = args.runs or []
    if not runs:
        for name in ("ddp", "zero1", "fsdp"):
            run = ROOT / "runs" / f"lesson-15-pictures-{name}"
            subprocess.run([sys.executable, str(LESSON), "--world-size", "2", "--steps", "6", "--device", "cpu",
                            "--strategy", name, "--out", str(run)], check=True, stdout=subprocess.DEVNULL,
                           timeout=600)
            runs.append(run)
    metrics = {name: json.loads((run / "metrics.json").read_text())
               for name, run in zip(("ddp", "zero1", "fsdp"), runs)}
    folder = args.to or (ROOT / "docs" / "img" if not args.runs else args.runs[0])
    print(draw_stages(metrics, folder / "15_zero_stages.png"))
    print(draw_timeline(metrics["fsdp"], folder / "15_fsdp_timeline.png"))


if __name__ == "__main__":
    main()
