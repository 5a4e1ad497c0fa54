"""Watching a pipeline schedule: the instruments behind lesson 18's timelines.

* Recorder(stages): while a schedule runs, logs every compute action each PipelineStage of
  this rank performs, in the order it ran (stage, "F"/"B"/"I"/"W", micro-batch), and the
  number of micro-batches whose activations the stage holds (torch's own bookkeeping:
  `stage.fwd_cache`, filled by a forward and emptied by the backward; for a zero-bubble
  schedule also `stage.backward_state`, kept from the input-gradient step "I" until the
  weight-gradient step "W"), and which of them hold no piece of the model (`rec.empty`).
* timeline(actions, empty): when each action would run if every forward took 1 unit of time,
  a full backward 2, and its two halves I and W 1 each, except on a stage that holds nothing
  and only passes its input on: its actions take no time. Each rank runs its own list in
  order and waits for the stage before it (forward) or after it (backward). Communication
  is free.
* idle_fraction, bubble_formula: the share of rank-time spent waiting, and (p-1)/(v·m+p-1)
  (v stages per rank: 1 for GPipe and 1F1B, 2 for interleaved 1F1B).
* draw(timeline) for the terminal; save_png(timeline, path) when matplotlib is installed (plot
  draws one timeline on matplotlib axes: timeline_pictures.py draws the docs' figure with it).
* show_schedule, summary_table, metrics_of, describe: what lesson 18 prints and saves.
* check_flags / flag_error: the rule lesson 18's flags must follow (one clear line if not).
"""
from __future__ import annotations

from pathlib import Path

COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # units of time; a backward does about twice a forward's work


class Recorder:
    """with Recorder(stages) as rec: schedule.step(...)  ->  rec.actions, rec.peak_inflight"""

    def __init__(self, stages):
        self.stages = list(stages)
        self.actions: list[tuple[int, str, int]] = []  # (stage, kind, micro-batch), in order
        self.peak_inflight = {s.stage_index: 0 for s in self.stages}
        # a stage without parameters holds no piece of the model: it passes its input on
        self.empty = {s.stage_index for s in self.stages if not any(True for _ in s.submod.parameters())}

    def _held(self, stage) -> int:
        return len(set(stage.fwd_cache) | set(stage.backward_state))

    def _wrap(self, stage, name):
        original = getattr(stage, name)

        def wrapped(chunk, *args, **kwargs):
            out = original(chunk, *args, **kwargs)
            if name == "forward_one_chunk":
                kind = "F"
                self.peak_inflight[stage.stage_index] = max(self.peak_inflight[stage.stage_index],
                                                            self._held(stage))
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:  # full_backward=False: only the input gradient now, the weights' later (W)
                kind = "B" if kwargs.get("full_backward", args[1] if len(args) > 1 else True) else "I"
            self.actions.append((stage.stage_index, kind, chunk))
            return out
        setattr(stage, name, wrapped)

    def __enter__(self):
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self._wrap(stage, name)
        return self

    def __exit__(self, *exc):
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                del stage.__dict__[name]  # back to the class's method
        return False


def timeline(actions: dict[int, list[tuple[int, str, int]]], empty=frozenset()) -> list[tuple[int, int, int, tuple]]:
    """[(rank, start, end, (stage, kind, micro-batch))] for each rank's actions, in unit times.
    The actions of the stages in `empty` (they pass their input on) take no time."""
    last_stage = max(s for acts in actions.values() for s, _, _ in acts)
    done: dict[tuple, int] = {}  # (stage, kind, mb) -> end time
    free = {rank: 0 for rank in actions}
    todo = {rank: list(acts) for rank, acts in actions.items()}
    out = []
    while any(todo.values()):
        progressed = False
        for rank in sorted(todo):
            while todo[rank]:
                stage, kind, mb = todo[rank][0]
                if kind == "F":
                    needs = [(stage - 1, "F", mb)] if stage > 0 else []
                elif kind in "BI":  # the gradient from the stage after, or our own loss
                    needs = ([(stage + 1, "B", mb), (stage + 1, "I", mb)] if stage < last_stage
                             else [(stage, "F", mb)])
                else:  # W: after this stage's own I
                    needs = [(stage, "I", mb)]
                ready = [done[n] for n in needs if n in done]
                if needs and not ready:
                    break  # waits for another rank: try the others first
                start = max([free[rank], *ready])
                end = start + (0 if stage in empty else COST[kind])
                done[(stage, kind, mb)] = free[rank] = end
                out.append((rank, start, end, (stage, kind, mb)))
                todo[rank].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the actions wait on each other forever: not a valid schedule")
    return out


def idle_fraction(tl) -> float:
    """Share of (ranks x makespan) in which a rank computes nothing."""
    ranks = {r for r, *_ in tl}
    makespan = max(end for _, _, end, _ in tl)
    busy = sum(end - start for _, start, end, _ in tl)
    return 1 - busy / (len(ranks) * makespan)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The idle fraction of GPipe and 1F1B, (p-1)/(m+p-1) (p ranks, m micro-batches), and of
    interleaved 1F1B, (p-1)/(v·m+p-1) with v equal stages per rank: the Megatron-LM paper's
    (Narayanan et al., 2021, section 2.2.2) bubble of (1/v)·(p-1)/m of the ideal time, as a
    share of the whole, bubble / (ideal + bubble)."""
    return (p - 1) / (v * m + p - 1)


FORMULA_V = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # stages per rank; zero-bubble: no formula here


def draw(tl) -> list[str]:
    """One text line per rank; each unit of time is one cell: `2F0` = stage 2, forward,
    micro-batch 0; a backward fills two cells; `.` is idle."""
    makespan = max(end for _, _, end, _ in tl)
    width = max(len(f"{s}{k}{m}") for *_, (s, k, m) in tl)
    rows = {r: ["." * width] * makespan for r, *_ in tl}
    for rank, start, end, (s, k, m) in tl:
        for t in range(start, end):
            rows[rank][t] = f"{s}{k}{m}".ljust(width)
    return [f"rank {r} | " + " ".join(cells) for r, cells in sorted(rows.items())]


def plot(ax, tl, title: str) -> None:
    """One timeline on matplotlib axes: a bar per action, one row per rank (as draw() does)."""
    colours = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
    ranks = sorted({r for r, *_ in tl})
    for rank, start, end, (s, k, m) in tl:
        if end > start:  # a pass-through stage's actions take no time: nothing to draw
            ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=colours[k], edgecolor="white")
            ax.text((start + end) / 2, rank, f"{s}{k}{m}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.5, min(ranks) - 0.5)  # rank 0 on top
    ax.set_xlabel("time (a forward = 1 unit)")
    ax.set_title(title, loc="left", fontsize=10)


def save_png(tl, path: Path, title: str) -> str:
    """Draw the timeline into a PNG; returns what happened, for the lesson to print."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no window: files only
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no PNG (make venv installs it: requirements.txt)"
    ranks = {r for r, *_ in tl}
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * max(e for _, _, e, _ in tl)), 0.6 * len(ranks) + 1))
    plot(ax, tl, title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


def describe(stages, parts) -> str:
    """'stage 0: pos_emb, tok_emb, blocks.0 (33,280 parameters)': what this rank holds."""
    held = []
    for stage, part in zip(stages, parts):
        names = dict.fromkeys(".".join(k.split(".")[:2] if k.startswith("blocks") else k.split(".")[:1])
                              for k in part.state_dict())  # in the model's order, each once
        held.append(f"stage {stage.stage_index}: {', '.join(names) or 'nothing (passes its input on)'}")
    n = sum(p.numel() for part in parts for p in part.parameters())
    return "; ".join(held) + f" ({n:,} parameters)"


def show_schedule(ui, name: str, rec: Recorder, world: int, microbatches: int, folder: Path):
    """Gather every rank's recorded actions, draw the timeline (terminal, and a PNG on rank 0),
    return (idle fraction, [peak micro-batches held by each stage], [stages that hold nothing],
    the timeline)."""
    import torch.distributed as dist

    every: list = [None] * world
    dist.all_gather_object(every, (rec.actions, rec.peak_inflight, rec.empty))
    empty = sorted(set().union(*(e for *_, e in every)))
    tl = timeline({rank: actions for rank, (actions, *_) in enumerate(every)}, empty)
    peak = {stage: n for _, held, _ in every for stage, n in held.items()}
    n, s = len(peak), lambda k, end="s": end if k > 1 else ""  # 1 stage, 2 stages
    ui.print(f"\n[bold]{name}[/bold]: {n} stage{s(n)} on {world} rank{s(world)}, "
             f"{microbatches} micro-batch{s(microbatches, 'es')}")
    for line in draw(tl):
        ui.print(line, markup=False)
    if ui.is_main:
        ui.print(save_png(tl, Path(folder) / f"timeline-{name}.png", f"{name}: P={world}, M={microbatches}"),
                 markup=False)
    return idle_fraction(tl), [peak[s] for s in sorted(peak)], empty, tl


def formula_of(name: str, world: int, microbatches: int) -> float | None:
    """The schedule's idle fraction by formula, None for zero-bubble (no closed form here)."""
    v = FORMULA_V.get(name)
    return bubble_formula(world, microbatches, v) if v else None


def show_summary(ui, runs: dict, world: int, microbatches: int) -> None:
    """Every schedule's idle time beside its formula, and its peaks; then the stages that hold
    nothing, if any (4 ranks: 8 stages for the model's 4 pieces)."""
    title, columns, rows, note = summary_table(runs, world, microbatches)
    ui.table(title, columns, rows)
    if note:
        ui.print(note)


def summary_table(runs: dict, world: int, microbatches: int):
    """(title, columns, rows, note): the table show_summary prints, and the line under it."""
    rows, empty = [], set()
    for name, (idle, peaks, none_held, _) in runs.items():
        v, f = FORMULA_V.get(name), formula_of(name, world, microbatches)
        formula = f"{f:.1%} = (p-1)/({'' if v == 1 else v}m+p-1)" if f is not None else "-"
        rows.append([name, f"{idle:.1%}", formula, " ".join(map(str, peaks))])
        empty |= set(none_held)
    note = (f"stages {', '.join(map(str, sorted(empty)))} hold nothing (they pass their input on, in no "
            f"time): a rank has not the v = 2 equal stages interleaved's formula assumes" if empty else "")
    return (f"Idle time and micro-batches held at once, P={world} ranks, M={microbatches}",
            ["schedule", "idle (timeline)", "by formula", "peak held per stage"], rows, note)


def metrics_of(runs: dict, schedule: str, world: int, microbatches: int) -> dict:
    """The keys lesson 18 adds to metrics.json."""
    idle, peaks, *_ = runs[schedule]
    return {"schedule": schedule, "microbatches": microbatches, "bubble_fraction": idle,
            "bubble_formula": formula_of(schedule, world, microbatches), "peak_inflight_microbatches": peaks,
            "schedules": {n: {"bubble_fraction": b, "bubble_formula": formula_of(n, world, microbatches),
                              "peak_inflight_microbatches": p, "pass_through_stages": e,
                              "timeline": [[r, start, end, f"{s}{k}{i}"] for r, start, end, (s, k, i) in tl]}
                          for n, (b, p, e, tl) in runs.items()}}


def check_flags(world: int, microbatches: int, global_batch: int) -> None:
    """common.cli.fail with one line when the flags do not fit. The world size follows Part 2's
    one rule (common/transformer.py), where it is the pipeline's own: it must split the
    model's pieces, so that every rank gets at least one. Then flag_error."""
    from common import transformer as T
    from common.cli import fail

    pieces = T.N_BLOCKS + 2  # embeddings, the blocks, final norm + head
    T.check_world_size(world, f"--world-size {world}",
                       divides={f"{pieces} pieces of the model (embeddings, {T.N_BLOCKS} blocks, head)": pieces},
                       splits_batch=False)  # every stage sees every row, one micro-batch at a time
    if problem := flag_error(world, microbatches, global_batch):
        fail(problem)


def flag_error(world: int, microbatches: int, global_batch: int) -> str | None:
    """The rule for lesson 18's --microbatches on `world` ranks, or None when it is fine."""
    if global_batch % microbatches:
        return f"--microbatches must divide the {global_batch} rows of a batch: use 2, 3, 4, 6, 8, 12, ..."
    if microbatches < world:
        return (f"--microbatches {microbatches} is fewer than the {world} stages: 1F1B needs at least "
                f"one micro-batch per stage (use --microbatches {world} or more)")
    rounds = max(1, microbatches // world)
    if microbatches % rounds:
        return (f"--microbatches {microbatches}: the interleaved schedules need a multiple of "
                f"{rounds} (they run in rounds of {world}); try {rounds * (microbatches // rounds)}")
    return None
