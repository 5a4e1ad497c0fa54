"""Lesson 08's instrument: one gradient-accumulation run, counted, with one thing changed.

Lesson 08 (lessons/08_no_sync_accumulation.py) trains with no_sync() in its Step 5 and keeps
that loop in the lesson. The runs its Step 6 compares it with (the naive loop, the three places
to put no_sync(), two classic mistakes) are the same loop with one thing changed, so they
live here, in one function, `measure()`, and `compare()` prints them side by side:

    no_sync_around="none"      no no_sync at all: every backward all-reduces
    no_sync_around="forward"   only the forward inside no_sync(), backward outside
    no_sync_around="backward"  forward outside, only the backward inside
    no_sync_around="both"      forward and backward inside: the right way
    divide_loss=False          each micro-batch's loss not divided by --accum-steps
    step_every_micro_batch     optimizer.step() after every micro-batch, synced or not

DDP's all-reduces are counted by apparatus/comm.py (counted_ddp + CommLog, the one counter of
the package): CommLog watches the dispatcher, so it sees DDP's buckets, and counted_ddp's
allreduce_hook gives each one a Python frame. Only backward() is recorded, so the lesson's own collectives (the
loss for the log, the all_gather that compares ranks) are never counted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apparatus.comm import CommLog, counted_ddp
from common import recipe
from common.cli import fail
from apparatus.results import max_abs_diff


def check_accum_steps(accum: int, world_size: int) -> None:
    """--accum-steps must cut each rank's share of the global batch into equal micro-batches."""
    per_rank = recipe.GLOBAL_BATCH // world_size
    if per_rank % accum:
        ok = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        fail(f"--accum-steps {accum} does not cut each rank's {per_rank} samples (global batch "
             f"{recipe.GLOBAL_BATCH} / {world_size} ranks) into equal micro-batches; use one of "
             f"{', '.join(map(str, ok))}")


def bucket_kwargs(args) -> dict:
    """--bucket-cap-mb as DDP's keyword (absent: DDP's own default)."""
    return {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def rank_spread(model) -> float:
    """Largest |w_rank - w_rank0| over every weight and every rank (0.0: all ranks agree)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)  # not recorded: not one of DDP's all-reduces
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def syncs(log: CommLog) -> list[list[int]]:
    """Per backward that all-reduced anything: the gradients in each call (its buckets)."""
    per = [[c.data_bytes // 4 for c in log.calls if start <= c.start < end]  # float32: 4 bytes
           for start, _, end in log.windows]
    return [sizes for sizes in per if sizes]


def result(log: CommLog, model, steps: int, reference, data, device) -> dict:
    """What one run's counter and weights say (every rank calls it: rank_spread gathers)."""
    found = {"allreduce_calls": len(log.calls),
             "allreduce_bytes": sum(c.data_bytes for c in log.calls),
             "calls_per_global_batch": len(log.calls) / steps,
             "bucket_sizes": (syncs(log) or [[]])[-1],  # the last sync's buckets
             "rank_disagreement": rank_spread(model),
             "final_accuracy": recipe.accuracy(model, data.test, device)}
    if reference is not None:  # rank 0
        found["max_abs_diff_vs_single_device"] = max_abs_diff(weights(model), reference)
    return found


def measure(args, data, device, loader, sampler, reference, *, no_sync_around="both",
            divide_loss=True, step_every_micro_batch=False) -> tuple[dict, dict, CommLog]:
    """Lesson 08's Step 5 loop on a fresh model with one thing changed: (result, weights, log)."""
    accum = args.accum_steps
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = counted_ddp(model, **bucket_kwargs(args))
    optimizer = recipe.make_optimizer(ddp_model)
    log = CommLog()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last = (i + 1) % accum == 0
            scale = accum if divide_loss else 1
            if last or no_sync_around == "none":
                out = ddp_model(x)                        # forward arms the reducer
                with log.recording(), log.backward():
                    (F.cross_entropy(out, y) / scale).backward()
            elif no_sync_around == "forward":
                with ddp_model.no_sync():
                    out = ddp_model(x)                    # forward inside ...
                with log.recording(), log.backward():
                    (F.cross_entropy(out, y) / scale).backward()  # ... backward outside
            elif no_sync_around == "backward":
                out = ddp_model(x)                        # forward outside ...
                with ddp_model.no_sync(), log.recording(), log.backward():
                    (F.cross_entropy(out, y) / scale).backward()  # ... backward inside
            else:                                         # "both": the right way
                with ddp_model.no_sync():
                    out = ddp_model(x)
                    with log.recording(), log.backward():
                        (F.cross_entropy(out, y) / scale).backward()
            if last or step_every_micro_batch:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    steps = args.epochs * (len(loader) // accum)
    found = result(log, model, steps, reference, data, device)
    w = weights(model)
    del ddp_model, optimizer  # a DDP reducer holds the process group
    return found, w, log


COLUMNS = ["run", "calls", "per batch", "MB sent", "max|w-w01|", "rank spread", "accuracy"]


def row(label: str, v: dict, rank: int) -> list:
    """One run under COLUMNS (max|w-w01| only on rank 0, which trained the reference)."""
    diff = f"{v['max_abs_diff_vs_single_device']:.1e}" if rank == 0 else ""
    return [label, v["allreduce_calls"], f"{v['calls_per_global_batch']:g}",
            f"{v['allreduce_bytes'] / 1e6:.2f}", diff,
            f"{v['rank_disagreement']:.1e}" if v["rank_disagreement"] else "0",
            f"{v['final_accuracy']:.1%}"]


PLACES = {"no_sync_forward_only": ("forward", "forward only"),
          "no_sync_backward_only": ("backward", "backward only"),
          "no_sync_forward_and_backward": ("both", "both")}


def compare(ui, args, data, device, loader, sampler, reference, no_sync: dict,
            no_sync_model) -> tuple[dict, dict]:
    """Lesson 08's Step 6: the naive loop, the three places for no_sync, the two mistakes,
    each on a fresh model; prints the tables and returns (naive, variants) for metrics.json."""
    rank = dist.get_rank()
    naive, w_naive, log = measure(args, data, device, loader, sampler, reference,
                                  no_sync_around="none")
    naive["max_abs_diff_vs_no_sync"] = max_abs_diff(w_naive, weights(no_sync_model))
    first, later = syncs(log)[0], syncs(log)[-1]
    ui.print(f"buckets: the first sync: {len(first)} all-reduce call(s) of {first} gradients; "
             f"every later one: {len(later)} call(s) of {later}")
    ui.table("All-reduces in the whole run (rank 0's count; every rank sends the same)", COLUMNS,
             [row("naive", naive, rank), row("no_sync", no_sync, rank)])
    calls, sent = naive["allreduce_calls"], naive["allreduce_bytes"]
    ui.print(f"calls: naive / no_sync = {calls} / {no_sync['allreduce_calls']} = "
             f"[bold]{calls / no_sync['allreduce_calls']:g}[/bold] (accum-steps is "
             f"{args.accum_steps}); bytes: {sent / no_sync['allreduce_bytes']:g}x; "
             f"max |w_naive - w_no_sync| = {naive['max_abs_diff_vs_no_sync']:.1e}")
    variants = {name: measure(args, data, device, loader, sampler, reference,
                              no_sync_around=around)[0] for name, (around, _) in PLACES.items()}
    ui.table("no_sync() around ... of every micro-batch but the last", COLUMNS,
             [row(label, variants[name], rank) for name, (_, label) in PLACES.items()])
    variants["loss_not_divided"] = measure(args, data, device, loader, sampler, reference,
                                           divide_loss=False)[0]
    variants["step_inside_loop"] = measure(args, data, device, loader, sampler, reference,
                                           step_every_micro_batch=True)[0]
    ui.table("Two mistakes, measured with the same counter", COLUMNS,
             [row("no / accum", variants["loss_not_divided"], rank),
              row("step each micro", variants["step_inside_loop"], rank)])
    ui.print("rank spread: largest |w_rank - w_rank0| over all weights and ranks (0: ranks agree); "
             "per batch: calls per global batch of 96")
    return naive, variants
