"""What lesson 24 measures and prints: the plan, the comparison with torch's DDP and LocalSGD
(Step 6), the bytes beside the formula and the H sweep with its plot (Step 7), and what a
replica's drop-out cost (Step 8). The mechanism itself is in the lesson file and diloco.py."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import diloco
from apparatus.comm import CommLog
from apparatus.results import plain_state_dict, shown
from common import transformer as T

N_PARAMS = sum(p.numel() for p in T.make_model().parameters())
BYTES = 4 * N_PARAMS  # one float32 copy of the weights: what one all-reduce carries


def describe(plan: diloco.Plan, ui) -> None:
    inner = f"AdamW lr={T.LR} eps={T.EPS}" if plan.inner == "adamw" else f"SGD lr={diloco.SGD_LR}"
    outer = ", ".join(f"{k}={v}" for k, v in diloco.OUTER[plan.outer].items())
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


def against_torch(short: diloco.Plan, rank: int, device, run_ours, ui) -> dict:
    """H = 1 with SGD inside against torch DDP with SGD; the same with AdamW; LocalSGD with
    H = 4 against torch's PostLocalSGDOptimizer + PeriodicModelAverager. Fresh models."""
    out, rows = {}, []
    for inner in ("sgd", "adamw"):
        p, log = dataclasses.replace(short, inner=inner), CommLog()
        ours = plain_state_dict(run_ours(p, log=log)[0])
        ddp_log = CommLog()
        ddp = diloco.torch_run("ddp", p, rank, device, ddp_log)
        diff = _max_diff(ours, ddp["state"])
        out[f"max_abs_diff_vs_ddp{'' if inner == 'sgd' else '_adamw'}"] = diff
        samples = p.steps * T.GLOBAL_BATCH
        out[f"ddp_{inner}_bytes_sent_per_sample"] = _total(ddp["sent"]) / samples
        out[f"h1_{inner}_bytes_sent_per_sample"] = _total(sum(c.sent_bytes for c in log.calls)) / samples
        rows.append([f"H = 1, inner {inner}, outer SGD lr 1", f"torch DDP + {inner}", f"{diff:.1e}"])
    p = dataclasses.replace(short, H=4 if short.steps % 4 == 0 else 1)
    ours = plain_state_dict(run_ours(p)[0])
    theirs = diloco.torch_run("periodic", p, rank, device)["state"]
    out["max_abs_diff_vs_torch_periodic_averager"] = diff = _max_diff(ours, theirs)
    rows.append([f"H = {p.H}, inner {p.inner}, outer SGD lr 1", "PostLocalSGDOptimizer", f"{diff:.1e}"])
    ui.table(f"{short.steps} steps from the same weights: ours against torch's (max |w - w_torch|)",
             ["ours", "torch's", "max abs diff"], rows)
    ui.print("SGD inside: the average of the replicas' steps -lr*g_r is the step of the average gradient, "
             "DDP's; AdamW inside: the average of N AdamW steps, each on its own gradient, is not one "
             "AdamW step on the average gradient (Adam divides by sqrt(v): not linear)")
    return out


def bytes_per_sample(log: CommLog, plan: diloco.Plan, ui, proofs: dict) -> dict:
    """This run's bytes, every rank's, per sample trained: measured by CommLog, and the formula."""
    total = _total(sum(c.sent_bytes for c in log.calls))
    N, rounds = plan.world, plan.steps // plan.H
    formula = rounds * 2 * (N - 1) * BYTES  # per outer step: N ranks x 2(N-1)/N x S
    if plan.drop_rank is not None:  # that round: N-1 ranks all-reduce, then a peer sends the state
        state = BYTES * (2 if plan.outer == "nesterov" else 1)
        formula += 2 * (N - 2) * BYTES - 2 * (N - 1) * BYTES + state
    samples = plan.samples()
    ui.print(f"this run: {rounds} outer steps, {total:,.0f} bytes sent by all {N} replicas for {samples:,} "
             f"samples: [bold]{total / samples:,.1f}[/bold] bytes per sample (formula "
             f"2(N-1) x {BYTES:,} x {rounds} / {samples:,} = {formula / samples:,.1f})")
    ddp = proofs["ddp_adamw_bytes_sent_per_sample"]
    ui.print(f"DDP (Step 6, measured): {ddp:,.1f} bytes per sample, every step; H = 1: "
             f"{proofs['h1_adamw_bytes_sent_per_sample']:,.1f}; this run sends {total / samples / ddp:.3f} of DDP's")
    return {"bytes_sent_per_sample": total / samples, "bytes_sent_per_sample_formula": formula / samples,
            "bytes_sent": total}


def no_sweep(ui) -> None:
    ui.print(f"H = {', '.join(map(str, diloco.SWEEP))} side by side: add --sweep (Run in the doc)")


def sweep(plan: diloco.Plan, rank: int, device, run_ours, folder, ui) -> dict:
    """The same run for each H of diloco.SWEEP, no drop-out: bytes per sample and the loss reached."""
    rows, curves, out = [], {}, {}
    for H in diloco.SWEEP:
        p, log = dataclasses.replace(plan, H=H, drop_rank=None, drop_at=None), CommLog()
        model, losses, _ = run_ours(p, log=log)
        dist.all_reduce(losses)
        curve = (losses / p.world).tolist()
        held_out, _ = T.evaluate(model, p.steps, p.seed, device)
        sent = _total(sum(c.sent_bytes for c in log.calls)) / p.samples()
        formula = 2 * (p.world - 1) * BYTES * (p.steps // H) / p.samples()
        out[str(H)] = {"bytes_sent_per_sample": sent, "bytes_sent_per_sample_formula": formula,
                       "held_out_loss": held_out, "losses": [round(v, 6) for v in curve]}
        curves[H] = curve
        rows.append([H, p.steps // H, f"{sent:,.1f}", f"{formula:,.1f}", f"{held_out:.4f}",
                     f"{held_out - T.loss_floor():+.4f}"])
    ui.table(f"H sweep, {plan.steps} inner steps each ({plan.steps * T.GLOBAL_BATCH:,} samples), "
             f"inner {plan.inner}, outer {plan.outer}",
             ["H", "outer steps", "bytes/sample", "formula", "held-out loss", "from the floor"], rows)
    if rank == 0:
        ui.print(save_plot(out, curves, plan, folder / "sweep.png"))
    return out


def save_plot(out: dict, curves: dict, plan: diloco.Plan, path) -> str:
    try:
        from apparatus.pictures import plt, save_figure  # matplotlib, only when a sweep draws
    except ImportError:
        return "matplotlib is not installed, so no PNG (make venv installs it: requirements.txt)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for H, curve in curves.items():
        left.plot([(s + 1) * T.GLOBAL_BATCH for s in range(len(curve))], curve, label=f"H = {H}")
    left.axhline(T.loss_floor(), color="grey", linestyle=":", label="floor")
    left.set_xlabel("samples")
    left.set_ylabel("training loss (mean over replicas)")
    left.legend()
    xs = [v["bytes_sent_per_sample"] for v in out.values()]
    ys = [v["held_out_loss"] for v in out.values()]
    right.plot(xs, ys, "o-")
    for H, x, y in zip(out, xs, ys):
        right.annotate(f"H = {H}", (x, y), textcoords="offset points", xytext=(5, 5))
    right.set_xscale("log")
    right.set_xlabel("bytes sent per sample (all replicas, measured)")
    right.set_ylabel(f"held-out loss after {plan.steps * T.GLOBAL_BATCH:,} samples")
    fig.suptitle(f"Lesson 24: {plan.world} replicas, inner {plan.inner}, outer {plan.outer}")
    return save_figure(fig, path)


def dropout_cost(plan: diloco.Plan, held_out: float, log: CommLog, rank: int, device, run_ours, ui,
                 sweep: dict | None = None) -> dict | None:
    """The run again without the drop-out (or the sweep's run with the same H): the held-out
    loss both ways, the samples lost, and the bytes that brought the replica back."""
    if plan.drop_rank is None:
        ui.print("no replica dropped out in this run: try --drop-rank 1 --drop-at 2")
        return None
    if sweep and str(plan.H) in sweep:  # the same run, without the drop-out: Step 7 trained it
        without = sweep[str(plan.H)]["held_out_loss"]
    else:
        without, _ = T.evaluate(run_ours(dataclasses.replace(plan, drop_rank=None, drop_at=None))[0],
                                plan.steps, plan.seed, device)
    back = _total(sum(c.sent_bytes for c in log.calls if c.kind == "send"))
    lost = plan.steps * T.GLOBAL_BATCH - plan.samples()
    ui.print(f"replica {plan.drop_rank} missed outer step {plan.drop_at}: its {plan.H} inner steps "
             f"({lost:,} samples) never happened; that outer step averaged the {plan.world - 1} replica(s) present")
    ui.print(f"it came back with the outer weights{' and momentum' if plan.outer == 'nesterov' else ''} "
             f"from a peer: {back:,.0f} bytes in one send")
    ui.print(f"held-out loss: {held_out:.4f} with the drop-out, {without:.4f} without: the cost is "
             f"[bold]{held_out - without:+.4f}[/bold] nats/token")
    return {"rank": plan.drop_rank, "at": plan.drop_at, "held_out_loss": held_out,
            "held_out_loss_without": without, "cost": held_out - without, "samples_lost": lost,
            "bytes_to_come_back": back}
