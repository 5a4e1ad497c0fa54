"""Step 6 of lesson 12: a parameter without a gradient, and DDP's error at the next forward.

Run it on its own (2 ranks, this step only), fixed, then broken:
    .venv/bin/python lessons/12_pitfalls/unused_params.py
    .venv/bin/python lessons/12_pitfalls/unused_params.py --break unused-params
or as part of the whole lesson: make lesson-12 ARGS="--break unused-params".
Lesson 12 (lessons/12_pitfalls.py) starts the ranks, joins them and calls run() below;
the doc is docs/12_pitfalls.md, Step 6.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks (Steps 1, 2, 10) and this step only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

import re
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel as DDP

from common import recipe
from kit import leave

STEP = 6
NAMES = ['unused-params']  # its --break modes


class AuxNet(nn.Module):
    """A body, a main head, and an auxiliary head that only some steps use."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(recipe.FEATURES, recipe.HIDDEN)
        self.head = nn.Linear(recipe.HIDDEN, recipe.CLASSES)
        self.aux = nn.Linear(recipe.HIDDEN, recipe.CLASSES)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = F.relu(self.body(x))
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def run(ui, rank, world_size, args, data, store, evidence) -> None:
    # DDP all-reduces gradients bucket by bucket, as autograd hooks report them ready. A
    # parameter that got no gradient never reports, so its bucket never finishes, and DDP
    # notices at the *next* forward. find_unused_parameters=True makes DDP walk the graph
    # after every forward to find such parameters: correct, and slower (measured below).
    broken = args.brk == "unused-params"
    order = recipe.epoch_order(len(data.train), args.seed, 0)
    per_rank = recipe.GLOBAL_BATCH // world_size
    torch.manual_seed(args.seed)
    model = DDP(AuxNet(), find_unused_parameters=not broken)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.LR)
    ui.print(f"{'broken: DDP(model)' if broken else 'fixed: DDP(model, find_unused_parameters=True)'}"
             f"; the aux head is used on odd steps only")
    for step in range(4):
        batch = order[step * recipe.GLOBAL_BATCH:(step + 1) * recipe.GLOBAL_BATCH][rank::world_size]
        x, y = data.train[batch]
        try:
            loss = F.cross_entropy(model(x, use_aux=step % 2 == 1), y)
        except RuntimeError as exc:  # DDP's check at the start of the forward after a bad step
            message = str(exc)
            names = [n for n, _ in model.module.named_parameters()]
            found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
            which = [names[int(i)] for i in found.group(1).split()] if found else []
            sentences = ". ".join(message.split(". ")[:2])  # the first two of many sentences
            ui.say_all(f"step {step}: DDP raised RuntimeError: {escape(sentences)} ...")
            ui.say_all(f"  ... and, further down: {escape(found.group(0) if found else '?')} "
                       f"(index -> name: {', '.join(which)})")
            leave(1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        got = model.module.aux.weight.grad is not None
        ui.print(f"  step {step}: aux head used: {'yes' if step % 2 else 'no '}; loss {loss.item():.4f}; "
                 f"aux.weight.grad is {'set' if got else 'None (DDP left it alone)'}")
    del model, optimizer

    # The cost: the same model, every parameter used, with and without the flag. The two
    # take turns step by step, so that whatever else the machine does slows both alike.
    # (With the flag on and nothing unused, torch itself warns about this cost on stderr.)
    x, y = data.train[order[:recipe.GLOBAL_BATCH][rank::world_size]]
    models = {}
    for find in (False, True):
        torch.manual_seed(args.seed)
        models[find] = DDP(AuxNet(), find_unused_parameters=find)
    times: dict = {False: [], True: []}
    for i in range(60):
        for find, timed in models.items():
            t0 = time.perf_counter()
            timed.zero_grad(set_to_none=True)
            F.cross_entropy(timed(x, use_aux=True), y).backward()
            times[find].append(time.perf_counter() - t0)
    ms = {find: 1000 * sorted(t[10:])[len(t[10:]) // 2] for find, t in times.items()}  # medians
    del models, timed
    ui.print(f"cost of the flag (every parameter used; forward + backward, median of 50 on "
             f"rank 0): {ms[False]:.2f} ms without, {ms[True]:.2f} ms with "
             f"({100 * (ms[True] / ms[False] - 1):+.0f}%)")
    evidence["unused_params"] = {"ms_per_step_without": ms[False], "ms_per_step_with": ms[True],
                                 "per_rank_batch": per_rank}


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "unused-params": (
        "Symptom: RuntimeError 'Expected to have finished reduction in the prior iteration "
        "before starting a new one', at the forward *after* the step that skipped a "
        "parameter. Cause: DDP waits for a gradient from every parameter; one that took no "
        "part in the loss never reports, so its bucket's all-reduce never runs. Fix: if a "
        "parameter is never used, delete it or set requires_grad=False; if it is used only "
        "sometimes, pass find_unused_parameters=True, which costs a graph walk every forward "
        "(measured in the default run)."),
}
