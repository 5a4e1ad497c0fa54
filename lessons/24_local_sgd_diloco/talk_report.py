"""What lesson 24 measures and prints: the plan; this run beside DDP, LocalSGD and DiLoCo on
the same batches (Step 5); the comparison with torch's DDP and LocalSGD (Step 6); the bytes
beside the formula, and --sweep's table and plot (DDP, LocalSGD and DiLoCo at each H, and the
outer step's lr and momentum: Step 7); what a replica's drop-out cost (Step 8). The mechanism
itself is in the lesson file and diloco.py.

`done` keeps the runs a process has made (one dict per process, keyed by what was run): every
rank makes the same runs in the same order, so no run is made twice and the collectives match."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import diloco
from apparatus.comm import CommLog
from apparatus.results import plain_state_dict
from common import transformer as T

N_PARAMS = sum(p.numel() for p in T.make_model().parameters())
BYTES = 4 * N_PARAMS  # one float32 copy of the weights: what one all-reduce carries


def describe(plan: diloco.Plan, ui) -> None:
    inner = f"AdamW lr={T.LR} eps={T.EPS}" if plan.inner == "adamw" else f"SGD lr={diloco.SGD_LR}"
    outer = ", ".join(f"{k}={v}" for k, v in plan.outer_settings().items())
    ui.print(f"Transformer: {N_PARAMS:,} parameters; inner: {inner} (one per replica, never averaged); "
             f"outer: SGD {outer} ({'DiLoCo' if plan.outer == 'nesterov' else 'LocalSGD'})")
    ui.print(f"H = {plan.H}: {plan.steps} inner steps are {plan.steps // plan.H} outer steps; each outer step "
             f"all-reduces one pseudo-gradient of {BYTES:,} bytes")
    if plan.drop_rank is not None:
        ui.print(f"replica {plan.drop_rank} leaves after outer step {plan.drop_at - 1}, misses outer step "
                 f"{plan.drop_at} and comes back after it")


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _total(sent: float) -> float:
    """Bytes every rank sent, summed over the ranks."""
    t = torch.tensor([float(sent)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _label(method: str) -> str:
    return {"ddp": "DDP", "localsgd": "LocalSGD", "diloco": "DiLoCo"}[method]


def _key(p: diloco.Plan) -> diloco.Plan:
    """The plan as a key for `done`: the same outer step, however it was named."""
    settings = p.outer_settings()
    return dataclasses.replace(p, outer="nesterov", outer_lr=settings["lr"],
                               outer_momentum=settings.get("momentum", 0.0))


def _ours(p: diloco.Plan, run_ours, device, done: dict) -> dict:
    """Plan p trained fresh from the same weights (or taken from `done`): its held-out loss,
    bytes sent per sample (all replicas, CommLog) and loss curve (mean over the replicas present)."""
    if _key(p) not in done:
        log = CommLog()
        model, losses, here = run_ours(p, log=log)
        dist.all_reduce(losses)
        dist.all_reduce(here)
        held_out, _ = T.evaluate(model, p.steps, p.seed, device)
        done[_key(p)] = {"held_out_loss": held_out, "losses": (losses / here).tolist(),
                         "bytes_sent_per_sample": _total(sum(c.sent_bytes for c in log.calls)) / p.samples()}
    return done[_key(p)]


def _ddp(plan: diloco.Plan, rank: int, device, done: dict) -> dict:
    """torch's DistributedDataParallel with the same inner optimizer on the same batches: the
    baseline that all-reduces the gradients at every step (or taken from `done`)."""
    key = ("ddp", plan.world, plan.steps, plan.inner, plan.seed)
    if key not in done:
        p, log = dataclasses.replace(plan, H=1, drop_rank=None, drop_at=None), CommLog()
        run = diloco.torch_run("ddp", p, rank, device, log)
        held_out, _ = T.evaluate(run["model"], p.steps, p.seed, device)
        dist.all_reduce(run["losses"])
        done[key] = {"held_out_loss": held_out, "losses": (run["losses"] / p.world).tolist(),
                     "bytes_sent_per_sample": _total(run["sent"]) / p.samples()}
    return done[key]


def _row(method: str, p: diloco.Plan, result: dict) -> dict:
    """One row of metrics.json's `same_batches` and `sweep`."""
    settings = {} if method == "ddp" else p.outer_settings()
    return {"method": method, "sync_every": p.H, "outer_lr": settings.get("lr"),
            "outer_momentum": None if method == "ddp" else settings.get("momentum", 0.0),
            "held_out_loss": result["held_out_loss"], "bytes_sent_per_sample": result["bytes_sent_per_sample"],
            "bytes_sent_per_sample_formula": 2 * (p.world - 1) * BYTES * (p.steps // p.H) / p.samples(),
            "losses": [round(v, 6) for v in result["losses"]]}


def same_batches(plan: diloco.Plan, held_out: float, losses: list, log: CommLog, rank: int, device, run_ours,
                 done: dict, ui) -> list:
    """Step 5: DDP, LocalSGD and DiLoCo at this run's H, on the same batches from the same
    weights, no drop-out (this run is one of them when nobody dropped out: kept, not retrained)."""
    if plan.drop_rank is None:
        done[_key(plan)] = {"held_out_loss": held_out, "losses": losses,
                            "bytes_sent_per_sample": _total(sum(c.sent_bytes for c in log.calls)) / plan.samples()}
    base = dataclasses.replace(plan, drop_rank=None, drop_at=None)
    rows = [_row("ddp", dataclasses.replace(base, H=1), _ddp(plan, rank, device, done))]
    for outer in ("sgd", "nesterov"):
        p = dataclasses.replace(base, outer=outer)
        rows.append(_row(diloco.METHOD[outer], p, _ours(p, run_ours, device, done)))
    ddp = rows[0]["held_out_loss"]
    this = "" if plan.drop_rank is None else " without the drop-out"
    ui.table(f"the same {plan.steps} batches, from the same weights{', no drop-out' if this else ''} "
             f"(LocalSGD: outer SGD lr 1; DiLoCo: outer Nesterov lr 0.7, momentum 0.9)",
             ["method", "H", "held-out loss", "vs DDP", ""],
             [[_label(r["method"]), r["sync_every"], f"{r['held_out_loss']:.4f}", f"{r['held_out_loss'] - ddp:+.4f}",
               "this run" + this if r["method"] == diloco.METHOD[plan.outer] else ""] for r in rows])
    best = min(rows, key=lambda r: r["held_out_loss"])
    ui.print(f"lowest held-out loss on these batches: [bold]{_label(best['method'])}[/bold] "
             f"({best['held_out_loss']:.4f}); the whole H sweep: --sweep (Step 7)")
    return rows


def against_torch(short: diloco.Plan, rank: int, device, run_ours, ui) -> dict:
    """H = 1 with SGD inside against torch DDP with SGD; the same with AdamW; LocalSGD with
    H = 4 against torch's PostLocalSGDOptimizer + PeriodicModelAverager. Fresh models."""
    out, rows = {}, []
    for inner in ("sgd", "adamw"):
        p, log = dataclasses.replace(short, inner=inner), CommLog()
        ours = plain_state_dict(run_ours(p, log=log)[0])
        ddp_log = CommLog()
        ddp = diloco.torch_run("ddp", p, rank, device, ddp_log)
        diff = _max_diff(ours, plain_state_dict(ddp["model"]))
        out[f"max_abs_diff_vs_ddp{'' if inner == 'sgd' else '_adamw'}"] = diff
        samples = p.steps * T.GLOBAL_BATCH
        out[f"ddp_{inner}_bytes_sent_per_sample"] = _total(ddp["sent"]) / samples
        out[f"h1_{inner}_bytes_sent_per_sample"] = _total(sum(c.sent_bytes for c in log.calls)) / samples
        rows.append([f"H = 1, inner {inner}, outer SGD lr 1", f"torch DDP + {inner}", f"{diff:.1e}"])
    p = dataclasses.replace(short, H=4 if short.steps % 4 == 0 else 1)
    ours = plain_state_dict(run_ours(p)[0])
    theirs = plain_state_dict(diloco.torch_run("periodic", p, rank, device)["model"])
    out["max_abs_diff_vs_torch_periodic_averager"] = diff = _max_diff(ours, theirs)
    rows.append([f"H = {p.H}, inner {p.inner}, outer SGD lr 1", "PostLocalSGDOptimizer", f"{diff:.1e}"])
    ui.table(f"{short.steps} steps from the same weights: ours against torch's (max |w - w_torch|)",
             ["ours", "torch's", "max abs diff"], rows)
    ui.print("SGD inside: the average of the replicas' steps -lr*g_r is the step of the average gradient, "
             "DDP's; AdamW inside: the average of N AdamW steps, each on its own gradient, is not one "
             "AdamW step on the average gradient (Adam divides by sqrt(v): not linear)")
    return out


def bytes_formula(plan: diloco.Plan) -> tuple[str, float]:
    """The bytes every rank sends, summed over the ranks, per sample trained: (the expression
    as printed, its value). Per outer step N ranks each send 2(N-1)/N of S bytes: 2(N-1) x S in
    all. A round with a replica away: N-1 ranks all-reduce (2(N-2) x S), then a peer sends the
    outer weights back, and the momentum when the outer step has one."""
    N, rounds, samples = plan.world, plan.steps // plan.H, plan.samples()
    if plan.drop_rank is None:
        return f"2(N-1) x {BYTES:,} x {rounds} / {samples:,}", 2 * (N - 1) * BYTES * rounds / samples
    copies = 2 if plan.outer_settings().get("momentum") else 1  # the weights (and the momentum)
    total = 2 * (N - 1) * BYTES * (rounds - 1) + 2 * (N - 2) * BYTES + copies * BYTES
    return (f"(2(N-1) x {BYTES:,} x {rounds - 1} + 2(N-2) x {BYTES:,} + {copies} x {BYTES:,}) / {samples:,}",
            total / samples)


def bytes_per_sample(log: CommLog, plan: diloco.Plan, ui, proofs: dict) -> dict:
    """This run's bytes, every rank's, per sample trained: measured by CommLog, and the formula."""
    total = _total(sum(c.sent_bytes for c in log.calls))
    samples, (expression, formula) = plan.samples(), bytes_formula(plan)
    ui.print(f"this run: {plan.steps // plan.H} outer steps, {total:,.0f} bytes sent by all {plan.world} replicas "
             f"for {samples:,} samples: [bold]{total / samples:,.1f}[/bold] bytes per sample (formula, "
             f"N = {plan.world}: {expression} = {formula:,.1f})")
    ddp = proofs["ddp_adamw_bytes_sent_per_sample"]
    share = f"this run sends {total / samples / ddp:.3f} of DDP's" if ddp else "one replica talks to nobody"
    ui.print(f"DDP (Step 6, measured): {ddp:,.1f} bytes per sample, every step; H = 1: "
             f"{proofs['h1_adamw_bytes_sent_per_sample']:,.1f}; {share}")
    return {"bytes_sent_per_sample": total / samples, "bytes_sent_per_sample_formula": formula,
            "bytes_sent": total}


def no_sweep(ui) -> tuple[None, None]:
    ui.print(f"DDP, LocalSGD and DiLoCo at H = {', '.join(map(str, diloco.SWEEP))}, and "
             f"{len(diloco.SETTINGS)} outer settings, side by side: add --sweep (Run in the doc)")
    return None, None


def sweep(plan: diloco.Plan, rank: int, device, run_ours, done: dict, folder, ui) -> tuple[list, list]:
    """DDP, then LocalSGD and DiLoCo at each H of diloco.SWEEP, all on the same batches from the
    same weights (no drop-out): bytes per sample and the held-out loss. Then the outer step's
    lr and momentum, diloco.SETTINGS, at H = diloco.SETTINGS_H. Returns (rows, settings)."""
    base = dataclasses.replace(plan, drop_rank=None, drop_at=None)
    rows = [_row("ddp", dataclasses.replace(base, H=1), _ddp(plan, rank, device, done))]
    for outer in ("sgd", "nesterov"):
        for H in diloco.SWEEP:
            p = dataclasses.replace(base, H=H, outer=outer)
            rows.append(_row(diloco.METHOD[outer], p, _ours(p, run_ours, device, done)))
    settings = []
    for lr, momentum in diloco.SETTINGS:
        p = dataclasses.replace(base, H=diloco.SETTINGS_H, outer="nesterov", outer_lr=lr, outer_momentum=momentum)
        settings.append({"sync_every": p.H, "outer_lr": lr, "outer_momentum": momentum,
                         "held_out_loss": _ours(p, run_ours, device, done)["held_out_loss"]})
    ddp = rows[0]["held_out_loss"]
    ui.table(f"the same {plan.steps} batches ({plan.steps * T.GLOBAL_BATCH:,} samples) for each, from the same "
             f"weights; inner {plan.inner}; LocalSGD: outer SGD lr 1; DiLoCo: outer Nesterov lr 0.7, momentum 0.9",
             ["method", "H", "outer steps", "bytes/sample", "formula", "held-out", "vs DDP"],
             [[_label(r["method"]), r["sync_every"], "-" if r["method"] == "ddp" else plan.steps // r["sync_every"],
               f"{r['bytes_sent_per_sample']:,.1f}", f"{r['bytes_sent_per_sample_formula']:,.1f}",
               f"{r['held_out_loss']:.4f}", f"{r['held_out_loss'] - ddp:+.4f}"] for r in rows])
    best = min(rows, key=lambda r: r["held_out_loss"])
    local = {r["sync_every"]: r["held_out_loss"] for r in rows if r["method"] == "localsgd"}
    nesterov = {r["sync_every"]: r["held_out_loss"] for r in rows if r["method"] == "diloco"}
    ui.print(f"lowest held-out loss: [bold]{_label(best['method'])}"
             f"{'' if best['method'] == 'ddp' else ' H = ' + str(best['sync_every'])}[/bold] "
             f"({best['held_out_loss']:.4f}); {sum(r['held_out_loss'] > ddp for r in rows[1:])} of {len(rows) - 1} "
             f"runs that talk less end above DDP; LocalSGD ends below DiLoCo at "
             f"{sum(local[H] < nesterov[H] for H in local)} of {len(local)} H values")
    plain = next(s["held_out_loss"] for s in settings if (s["outer_lr"], s["outer_momentum"]) == (1.0, 0.0))
    ui.table(f"the outer step's lr and momentum at H = {diloco.SETTINGS_H} ({plan.steps // diloco.SETTINGS_H} "
             f"outer steps), the same batches (momentum: Nesterov's; 0: plain SGD)",
             ["outer lr", "momentum", "held-out", "vs plain average", ""],
             [[s["outer_lr"], s["outer_momentum"], f"{s['held_out_loss']:.4f}", f"{s['held_out_loss'] - plain:+.4f}",
               {(1.0, 0.0): "LocalSGD", (0.7, 0.9): "DiLoCo, paper's"}.get((s["outer_lr"], s["outer_momentum"]), "")]
              for s in settings])
    top = min(settings, key=lambda s: s["held_out_loss"])
    ui.print(f"best outer step here: lr {top['outer_lr']}, momentum {top['outer_momentum']} "
             f"({top['held_out_loss']:.4f}); DDP {ddp:.4f}")
    if rank == 0:
        ui.print(save_plot(rows, settings, plan, folder / "sweep.png"))
    return rows, settings


def save_plot(rows: list, settings: list, plan: diloco.Plan, path) -> str:
    try:
        from apparatus.pictures import plt, save_figure  # matplotlib, only when a sweep draws
    except ImportError:
        return "matplotlib is not installed, so no PNG (make venv installs it: requirements.txt)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ddp, floor = rows[0], T.loss_floor()
    # above the floor, on a log scale: DiLoCo at H = 1 is far above the rest, and the rest close
    left.plot([ddp["bytes_sent_per_sample"]], [ddp["held_out_loss"] - floor], "k*", markersize=14,
              label="DDP: gradients, every step")
    for method, style, below in (("localsgd", "o-", True), ("diloco", "s--", False)):
        mine = [r for r in rows if r["method"] == method]
        xs, ys = [r["bytes_sent_per_sample"] for r in mine], [r["held_out_loss"] - floor for r in mine]
        left.plot(xs, ys, style, label=f"{_label(method)}: weights every H steps")
        for r, x, y in zip(mine, xs, ys):
            left.annotate(f"H = {r['sync_every']}", (x, y), textcoords="offset points",
                          xytext=(5, -12 if below else 5))
    left.set_xscale("log")
    left.set_yscale("log")
    left.margins(x=0.12)
    left.set_xlabel("bytes sent per sample (all replicas, measured)")
    left.set_ylabel(f"held-out loss - floor, after {plan.steps * T.GLOBAL_BATCH:,} samples")
    left.set_title("talking less, at the same samples")
    left.legend()
    for lr in sorted({s["outer_lr"] for s in settings}):
        mine = [s for s in settings if s["outer_lr"] == lr]
        right.plot([s["outer_momentum"] for s in mine], [s["held_out_loss"] for s in mine], "o-",
                   label=f"outer lr {lr}")
    right.axhline(ddp["held_out_loss"], color="black", linestyle="-.", label="DDP")
    right.axhline(T.loss_floor(), color="grey", linestyle=":", label="floor")
    right.set_xlabel("outer Nesterov momentum (0: plain SGD)")
    right.set_ylabel("held-out loss")
    right.set_title(f"the outer step at H = {diloco.SETTINGS_H} ({plan.steps // diloco.SETTINGS_H} outer steps)")
    right.legend()
    fig.suptitle(f"Lesson 24: {plan.world} replicas, inner {plan.inner}, {plan.steps} steps each")
    return save_figure(fig, path)


def dropout_cost(plan: diloco.Plan, held_out: float, log: CommLog, rank: int, device, run_ours, done: dict,
                 ui) -> dict | None:
    """The same run without the drop-out (Step 5 trained it): the held-out loss both ways, the
    samples lost, and the bytes that brought the replica back."""
    if plan.drop_rank is None:
        ui.print("no replica dropped out in this run: try --drop-rank 1 --drop-at 2")
        return None
    without = _ours(dataclasses.replace(plan, drop_rank=None, drop_at=None), run_ours, device, done)["held_out_loss"]
    back = _total(sum(c.sent_bytes for c in log.calls if c.kind == "send"))
    lost = plan.steps * T.GLOBAL_BATCH - plan.samples()
    ui.print(f"replica {plan.drop_rank} missed outer step {plan.drop_at}: its {plan.H} inner steps "
             f"({lost:,} samples) never happened; that outer step averaged the {plan.world - 1} replica(s) present")
    ui.print(f"it came back with the outer weights{' and momentum' if plan.outer_settings().get('momentum') else ''} "
             f"from a peer: {back:,.0f} bytes in one send")
    ui.print(f"held-out loss: {held_out:.4f} with the drop-out, {without:.4f} without: the cost is "
             f"[bold]{held_out - without:+.4f}[/bold] nats/token")
    return {"rank": plan.drop_rank, "at": plan.drop_at, "held_out_loss": held_out,
            "held_out_loss_without": without, "cost": held_out - without, "samples_lost": lost,
            "bytes_to_come_back": back}
