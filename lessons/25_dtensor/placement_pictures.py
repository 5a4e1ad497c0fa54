"""Draw docs/25's picture from a run of lesson 25: which rank holds which cells of X, per layout.

It reads metrics.json's "layouts": for each placement, each rank's piece as the slice of X it
equals ("X[2:4]", "X[:, 0:2]", "X / 4"), which the lesson worked out from the pieces themselves
(X holds 0, 1, ..., 63: each value names its cell). Each panel is X's 8 x 8 cells, coloured by
the ranks that hold them.

    .venv/bin/python lessons/25_dtensor.py                           # writes runs/lesson-25/
    .venv/bin/python lessons/25_dtensor/placement_pictures.py        # writes docs/img/25_placements.png

Or from another run:  --from runs/mine --to /tmp/placements.png
"""
import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: apparatus
from apparatus.pictures import plt, save_figure  # noqa: E402  (matplotlib without a window)

ROOT = Path(__file__).resolve().parents[2]
SLICE = re.compile(r"^X(?:\[(?P<rows>\d+:\d+|:)?(?:, (?P<cols>\d+:\d+))?\])?(?: / (?P<parts>\d+))?$")


def cells(said: str, size: int = 8) -> tuple[range, range, int]:
    """"X[0:4, 4:8] / 2" -> (rows 0..3, cols 4..7, 2 parts)."""
    m = SLICE.match(said)
    if m is None:
        raise ValueError(f"not a slice of X: {said!r}")
    span = lambda text: range(*map(int, text.split(":"))) if text and text != ":" else range(size)  # noqa: E731
    return span(m["rows"]), span(m["cols"]), int(m["parts"] or 1)


def draw(folder: Path, to: Path) -> str:
    metrics = json.loads((Path(folder) / "metrics.json").read_text())
    layouts, world = metrics["layouts"], metrics["world_size"]
    colors, shared = plt.get_cmap("tab10"), plt.get_cmap("Pastel2")
    fig, axes = plt.subplots(2, 4, figsize=(11, 6.4))
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, pieces) in zip([*axes[0], *axes[1]], layouts.items()):
        holders: dict[tuple[int, int], list[int]] = {}
        parts = 1
        for rank, said in enumerate(pieces):
            rows, cols, parts = cells(said)
            for r in rows:
                for c in cols:
                    holders.setdefault((r, c), []).append(rank)
        groups = _labels(holders)
        for (r, c), ranks in holders.items():  # one colour per rank; cells several ranks hold: pale
            color = colors(ranks[0] % 10) if len(ranks) == 1 else shared(list(groups).index(_label(ranks)) % 8)
            ax.add_patch(plt.Rectangle((c, 7 - r), 1, 1, facecolor=color, edgecolor="white", linewidth=0.6,
                                       hatch="//" if parts > 1 else None))
        for label, spots in groups.items():
            rr, cc = zip(*spots)
            ax.text(sum(cc) / len(cc) + 0.5, 7.5 - sum(rr) / len(rr), label, ha="center", va="center", fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})
        ax.set_xlim(0, 8)
        ax.set_ylim(0, 8)
        ax.set_aspect("equal")
        share = f", each X / {parts}" if parts > 1 else ""
        ax.set_title(f"{name}{share}", fontsize=9)
    axes[1][3].text(0.0, 0.5, f"X: 8 x 8, {world} ranks\n1-D mesh: {list(range(world))}\n"
                    + (f"2-D mesh: 2 x {world // 2}\n" if world >= 4 else "")
                    + "strong colour: one rank holds the cell\npale: several ranks hold a copy\nhatched: each holds a share of\n  a pending sum (Partial)\nnumbers: which ranks",
                    fontsize=9, va="center")
    fig.suptitle("What each rank holds (to_local) of the same X, by placement: measured by lesson 25", fontsize=11)
    return save_figure(fig, Path(to), dpi=100)


def _label(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"all {len(ranks)}"


def _labels(holders: dict) -> dict[str, list[tuple[int, int]]]:
    """Cells grouped by who holds them: the group's label is its ranks, e.g. "0" or "0,2"."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for spot, ranks in holders.items():
        groups.setdefault(_label(ranks), []).append(spot)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="folder", type=Path, default=ROOT / "runs" / "lesson-25",
                        help="a lesson 25 run's folder (its metrics.json)")
    parser.add_argument("--to", type=Path, default=ROOT / "docs" / "img" / "25_placements.png")
    args = parser.parse_args()
    if not (args.folder / "metrics.json").is_file():
        raise SystemExit(f"error: no {args.folder / 'metrics.json'}: run .venv/bin/python lessons/25_dtensor.py first")
    print(draw(args.folder, args.to))


if __name__ == "__main__":
    main()
