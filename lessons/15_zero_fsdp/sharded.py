"""Lesson 15's own helpers: ShardedOptimizer's flat rows and drop-in plumbing, what each rank
sent per step, and the peak of one step.

* flat_row, unflatten, pieces: copy parameters (or their gradients) into one flat row per
  rank and back, so that ShardedOptimizer (lessons/15_zero_fsdp.py) needs one reduce-scatter
  and one all-gather per step; they only move tensors, the idea is in the lesson file.
* DropIn: what makes ShardedOptimizer, which steps an inner optimizer over this rank's shard,
  usable where a torch optimizer is: an LR scheduler's lr reaches the inner optimizer,
  state_dict()/load_state_dict() hold every rank's state, step(closure) runs the closure.
* FSDPStory: records FSDP2's own debug markers (pre_forward, pre_backward, post_backward,
  per module) and its prefetches, so that each collective CommLog saw can be shown under
  the group it served.
* StepRecorder: the lesson's one recorder (in_practice.py's too): apparatus/comm.py's CommLog
  on the printed steps only, FSDPStory on every step, apparatus/memory.py's StepPeak (torch's
  MemTracker, FSDPMemTracker under FSDP2) on the last printed one, and that step's peak
  reported.
* report_comm: the bytes this rank sent per step (CommLog) beside the ring formula
  (apparatus/sharding.py's comm_formula) and beside DDP's, and for fsdp the story table.

What each rank *holds* is measured by apparatus/sharding.py (held_bytes, report_bytes),
which lessons 16 and 19 use too.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist

from apparatus.comm import CommLog
from apparatus.memory import StepPeak, report_peak
from apparatus.sharding import comm_formula, recipe_shapes


def flat_row(params, size: int, device, grad: bool = False) -> torch.Tensor:
    """The parameters (or, with grad=True, their gradients; zeros for a parameter without one)
    one after another in one flat row, zeros up to `size`: ShardedOptimizer's collectives."""
    tensors = [(torch.zeros_like(p) if p.grad is None else p.grad) if grad else p for p in params]
    n = sum(t.numel() for t in tensors)
    return torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(size - n, device=device)])


def unflatten(rows: torch.Tensor, shards) -> None:
    """Copy row r back into the parameters of shards[r], for every r."""
    for row, shard in zip(rows, shards):
        for p, new in zip(shard, pieces(row, shard)):
            p.copy_(new)


def pieces(row: torch.Tensor, shard) -> list[torch.Tensor]:
    """The views of a flat row that hold each tensor of `shard`, shaped like it."""
    sizes = [p.numel() for p in shard]
    return [v.view_as(p) for p, v in zip(shard, row[:sum(sizes)].split(sizes))]


class FSDPStory:
    """with FSDPStory() as story: ...  ->  story.rows(log.calls, step) after training.

    FSDP2 logs a debug line at each hook it runs ("FSDP::pre_forward (blocks.0)") on the
    logger torch.distributed.fsdp.fully_shard, before the hook issues its collectives. We
    note the time of each line; a collective CommLog saw belongs to the last line before it.
    A group's pre_backward also gathers the group that ran forward before it (torch 2.14.1,
    _fsdp_param_group.py: _backward_prefetch -> _prefetch_unshard), which logs nothing: we
    wrap FSDPParamGroup._prefetch_unshard while recording, so that gather gets its own line,
    under the group it is for.
    """

    LOGGER = "torch.distributed.fsdp.fully_shard"

    def __init__(self):
        self.marks: list[tuple[float, str]] = []
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = lambda record: self.marks.append((time.perf_counter(), record.getMessage()))

    def __enter__(self) -> "FSDPStory":
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self._prefetch = prefetch = FSDPParamGroup._prefetch_unshard  # a staticmethod

        def noted(target, pass_type):
            self.marks.append((time.perf_counter(), f"FSDP::{pass_type}_prefetch ({target._module_fqn})"))
            return prefetch(target, pass_type)
        FSDPParamGroup._prefetch_unshard = staticmethod(noted)
        logger = logging.getLogger(self.LOGGER)
        self._level, self._propagate = logger.level, logger.propagate
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # our handler only: nothing printed
        logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        FSDPParamGroup._prefetch_unshard = staticmethod(self._prefetch)
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self._handler)
        logger.setLevel(self._level)
        logger.propagate = self._propagate

    def rows(self, calls, step: int) -> list[list[str]]:
        """[hook, module, collectives it issued] for training step `step` (0-based)."""
        starts = [i for i, (_, text) in enumerate(self.marks) if text == "FSDP::root_pre_forward"]
        if step >= len(starts):
            return []
        end = starts[step + 1] if step + 1 < len(starts) else len(self.marks)
        marks = self.marks[starts[step]:end]
        stop = self.marks[end][0] if end < len(self.marks) else math.inf
        out = []
        for i, (t, text) in enumerate(marks):
            until = marks[i + 1][0] if i + 1 < len(marks) else stop
            issued = [c for c in calls if t <= c.start < until]
            hook, _, module = text.removeprefix("FSDP::").partition(" ")
            if hook.endswith("_prefetch"):  # issued inside the previous line's pre_ hook
                hook = f"  prefetch in {out[-1][1]}'s" if out else "prefetch"
            if not issued and hook not in ("pre_forward", "pre_backward", "post_backward"):
                continue
            what = ", ".join(f"{c.kind.replace('_single', '').replace('_', '-')} "
                             f"{c.data_bytes / 1024:,.1f} KiB" for c in issued) or "-"
            out.append([hook, module.strip("()") or "root", what])
        return out

    def timeline(self, calls, step: int) -> list[list]:
        """[start ms, end ms, what, group] in training step `step`, from its first hook: each
        group's forward and backward (its pre_ hook to its post_ hook) and each collective,
        under the group it served (a prefetch: its target). docs/img/15_fsdp_timeline.png."""
        starts = [i for i, (_, text) in enumerate(self.marks) if text == "FSDP::root_pre_forward"]
        if step >= len(starts):
            return []
        end = starts[step + 1] if step + 1 < len(starts) else len(self.marks)
        marks, t0 = self.marks[starts[step]:end], self.marks[starts[step]][0]
        stop = self.marks[end][0] if end < len(self.marks) else math.inf
        out, opened = [], {}
        for i, (t, text) in enumerate(marks):
            until = marks[i + 1][0] if i + 1 < len(marks) else stop
            hook, _, module = text.removeprefix("FSDP::").partition(" ")
            group = module.strip("()") or "root"
            phase = hook.split("_")[-1]  # forward, backward (pre_, post_, backward_prefetch)
            if hook.startswith("pre_"):
                opened[phase, group] = t
            elif hook.startswith("post_") and (phase, group) in opened:
                out.append([(opened.pop((phase, group)) - t0) * 1e3, (t - t0) * 1e3, phase, group])
            out += [[(c.start - t0) * 1e3, ((c.end or c.start) - t0) * 1e3, c.kind.replace("_single", ""),
                     group] for c in calls if t <= c.start < until]
        return out


class DropIn(torch.optim.Optimizer):
    """The plumbing of an optimizer that steps an inner one (self.optim: this rank's shard),
    as torch's ZeroRedundancyOptimizer does it (torch/distributed/optim/
    zero_redundancy_optimizer.py: _sync_param_groups around each inner step). One parameter
    group: the constructor's flat list."""

    def adopt(self, inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """self.optim = inner, sharing its state; the outer group (what a scheduler and the
        user read and set) takes inner's hyperparameters, and gives them back before each
        inner step: a scheduler's new lr reaches the optimizer that uses it."""
        self.optim, self.state = inner, inner.state
        self.param_groups[0].update(_hyper(inner.param_groups[0]))
        inner.register_step_pre_hook(lambda *_: inner.param_groups[0].update(_hyper(self.param_groups[0])))
        return inner

    @staticmethod
    def run(closure):
        """step(closure): as torch's optimizers, the closure runs with gradients on."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def state_dict(self) -> dict:
        """Every rank's state, keyed as one process's optimizer keys it (a plain AdamW loads
        it). A collective: every rank calls it. The state goes through the CPU."""
        mine = super().state_dict()  # this rank's entries, under the indices of all parameters
        cpu = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in mine["state"].items()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, cpu)
        return {"state": dict(sorted(kv for part in everyone for kv in part.items())),
                "param_groups": mine["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep this rank's part of a full state dict (state_dict()'s, or one process's)."""
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        mine = [index[id(p)] for p in self.optim.param_groups[0]["params"]]
        group = {**state_dict["param_groups"][0], "params": list(range(len(mine)))}
        state = state_dict["state"]
        self.optim.load_state_dict({"state": {j: state[i] for j, i in enumerate(mine) if i in state},
                                    "param_groups": [group]})
        self.param_groups[0].update(_hyper(group))
        self.state = self.optim.state  # load_state_dict gave the inner optimizer a new dict


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def fsdp_comm_formula(shapes: dict, world: int, reshard: bool) -> float:
    """comm_formula for lesson 15's fsdp: the blocks reshard after forward as --reshard says,
    the root at FSDP2's default for it (reshard_after_forward=None: not resharded, gathered once)."""
    blocks = {k: v for k, v in shapes.items() if k.startswith("blocks.")}
    root = {k: v for k, v in shapes.items() if not k.startswith("blocks.")}
    return comm_formula("fsdp", blocks, world, 0, reshard) + comm_formula("fsdp", root, world, 0, False)


def report_comm(ui, record, args, optimizer) -> dict:
    """Bytes this rank sent per step (the recorder's CommLog, over the steps it recorded)
    beside the formula and DDP's; for fsdp, what FSDP2 did around each module in the second
    recorded step."""
    world, strategy = dist.get_world_size(), args.strategy
    reshard, shapes = args.reshard_after_forward, recipe_shapes()
    log, recorded, story = record.log, record.logged, record.story
    comm = log.summary(len(recorded))
    sent = comm["sent_bytes_per_step"]
    expected = (fsdp_comm_formula(shapes, world, reshard) if strategy == "fsdp" else
                comm_formula(strategy, shapes, world, getattr(optimizer, "size", 0), reshard))
    ddp = comm_formula("ddp", shapes, world, 0, True)
    ui.print(f"{comm['calls_per_step']:.0f} collectives per step; rank 0 sent {kib(sent)} per "
             f"step (formula {kib(expected)}); DDP's all-reduce sends {kib(ddp)}: "
             f"{sent / ddp if ddp else 0:.2f}x")
    if strategy == "fsdp":
        step = recorded[min(1, len(recorded) - 1)]
        ui.table(f"What FSDP2 did around each module in step {step + 1} (rank 0)",
                 ["hook", "module", "collectives it issued"], story.rows(log.calls, step))
    timeline = story.timeline(log.calls, step) if strategy == "fsdp" else []
    return {"comm_bytes_per_step": sent, "comm_formula_bytes": expected, "ddp_comm_bytes": ddp,
            "fsdp_timeline": timeline,
            "comm_calls_per_step": comm["calls_per_step"], "strategy": strategy,
            "reshard_after_forward": reshard}


class StepRecorder:
    """with StepRecorder(model, optimizer, steps, every) as record: ... record.at(step) ...
    ->  record.log (CommLog), record.logged (the steps it recorded), record.story (FSDPStory),
        record.peak (StepPeak)

    A TorchDispatchMode sees every op, so it slows every step it watches: CommLog records
    the printed steps only, every `every`-th (each step of a strategy sends the same, but for
    torch's DDP's first two: one bucket, then two small broadcasts), and apparatus/memory.py's
    StepPeak (torch's MemTracker; FSDPMemTracker for FSDP2, which also sees its all-gather and
    reduce-scatter buffers) follows the last of them, from its forward to the end of its
    optimizer step: `record.peak`, the peak of one training step, activations included, on top
    of what the rank holds at rest (the model, its gradients, the optimizer state). FSDPStory
    notes FSDP2's hooks in every step (a log line each: cheap), to place each collective
    under the group it served. every=steps: the last step only (in_practice.py)."""

    def __init__(self, model, optimizer, steps: int, every: int):
        self.log, self.logged = CommLog(), [s for s in range(steps) if (s + 1) % every == 0]
        self.stack, self.peak = contextlib.ExitStack(), StepPeak(model, optimizer, self.logged[-1])
        self.story = FSDPStory()

    def at(self, step: int) -> None:
        """Stop recording the previous step; record this one if it is logged (the tracker
        inside CommLog's recording, as it is entered last)."""
        self.peak.stop()
        self.stack.close()
        if step in self.logged:
            self.stack.enter_context(self.log.recording())
        self.peak.at(step)

    def __enter__(self) -> "StepRecorder":
        self.story.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.peak.stop()
        self.stack.close()
        self.story.__exit__(*exc)

    def report_peak(self, ui, at_rest: int) -> dict:
        """The peak of the followed step beside `at_rest`, every rank's (apparatus/memory.py's
        report_peak, as lessons 13, 14 and 16 print it): its metrics.json keys."""
        return report_peak(ui, self.peak, at_rest)
