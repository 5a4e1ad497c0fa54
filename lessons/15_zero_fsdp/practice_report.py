"""Lesson 15 in practice, what each step prints: its tables beside the formulas, and the
numbers it keeps for metrics.json. in_practice.py runs the steps; practice_tools.py builds,
trains and records."""
import torch

from apparatus.results import max_abs_diff
from common import transformer as T
from practice_tools import compare, gathered_formula, group_elements, reduced_formula, story_rows


def report_prefetch(ui, base, pre, pre_state: dict, baseline_state: dict, rank: int) -> dict:
    """Step 5's tables: what FSDP2 did in the last step, in its default order and with explicit
    prefetch, and (rank 0) the weights against Step 2's."""
    before, after = story_rows(base), story_rows(pre)
    for title, story in (("FSDP2's default order", before), ("explicit prefetch", after)):
        ui.table(f"What FSDP2 did in the last step, rank 0: {title}", ["#", "hook", "module", "issued"],
                 [[i + 1, *row] for i, row in enumerate(story)])
    pre_ag, ag = pre.bytes_of("all_gather")[1], base.bytes_of("all_gather")[1]
    out = {"default": before, "explicit": after, "peak_bytes": pre.peak(), "all_gather_bytes": pre_ag}
    if rank == 0:
        diff = max_abs_diff(pre_state, baseline_state)
        ui.print(f"same weights as Step 2? max |w - w_step2| = [bold]{diff:.1e}[/bold]; bytes gathered "
                 f"{pre_ag:,} (Step 2: {ag:,}); peak {pre.peak():,} (Step 2: {base.peak():,})")
        out["max_abs_diff_vs_baseline"] = diff
    return out


def report_scheduler(ui, args, warmup, used: dict, finals: dict, rank: int) -> dict:
    """Step 9's table of the lr the inner AdamW used, and (rank 0) both runs against one process
    with the same warm-up, which is what both should end with."""
    ui.table("lr the inner AdamW used at each step",
             ["scheduler on", *[f"step {s + 1}" for s in range(args.steps)]],
             [["(the schedule)", *[f"{T.LR * warmup(s):.5f}" for s in range(args.steps)]],
              ["the ZeRO wrapper", *[f"{lr:.5f}" for lr in used["wrapper"]]],
              ["zero.optim (wrong)", *[f"{lr:.5f}" for lr in used["inner"]]]])
    out = {"schedule": [T.LR * warmup(s) for s in range(args.steps)], "used": used}
    if rank == 0:
        one = T.make_model(args.seed)
        opt = T.make_optimizer(one)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            opt.zero_grad(set_to_none=True)
            T.loss_fn(one(x), y).backward()
            opt.step()
            sched.step()
        out["max_abs_diff_vs_one_process"] = {
            attach: compare(ui, f"scheduler on {name} vs one process with the same warm-up", finals[attach],
                            one.state_dict(), 1e-3 if attach == "wrapper" else None, "w_one")
            for attach, name in (("wrapper", "the wrapper"), ("inner", "zero.optim"))}
    return out


def report_clip(ui, args, max_norm: float, norms: list, by_hand, log) -> dict:
    """Step 8's table: every rank's DTensor norm and local-shard norm beside one process's."""
    one = T.make_model(args.seed)  # one process, the whole first batch
    T.loss_fn(one(T.batch(0, args.seed)[0]), T.batch(0, args.seed)[1]).backward()
    one_norm = torch.nn.utils.clip_grad_norm_(one.parameters(), max_norm).item()
    ui.table(f"Gradient norm of the first batch (max_norm {max_norm:g})",
             ["rank", "clip_grad_norm_ (DTensor)", "norm of .to_local()", "clip factor: right",
              "clip factor: wrong"],
             [[r, f"{g:.6f}", f"{n:.6f}", f"{min(1, max_norm / g):.4f}", f"{min(1, max_norm / n):.4f}"]
              for r, (g, n) in enumerate(norms)])
    issued = ", ".join(f"{c.kind} of {c.data_bytes} bytes" for c in log.calls) or "none"
    ui.print(f"one process (lesson 13's model, the whole batch): {one_norm:.6f}; by hand, "
             f"sqrt(all_reduce(local^2)): {by_hand.sqrt().item():.6f}; clip_grad_norm_ issued: {issued}")
    return {"max_norm": max_norm, "global_norm_per_rank": [g for g, _ in norms],
            "local_norm_per_rank": [n for _, n in norms], "one_process_norm": one_norm,
            "by_hand_norm": by_hand.sqrt().item(), "collectives": [c.kind for c in log.calls]}


def report_offload(ui, model, optimizer, policy, tried: str, device, off, base) -> dict:
    """Step 7: where the shards, gradients and AdamW's state live, pinned or not, and the peaks."""
    p = next(model.parameters())
    state = next(iter(optimizer.state.values()))["exp_avg"]
    where = {"compute": str(device), "sharded parameters": str(p.to_local().device),
             "gradients": str(p.grad.to_local().device), "optimizer state": str(state.to_local().device)}
    ui.print(f"with {policy}: {', '.join(f'{k} on {v}' for k, v in where.items())}; "
             f"shards pinned: {p.to_local().is_pinned()}")
    show = lambda peaks: ", ".join(f"{d} {n:,} bytes" for d, n in peaks.items())  # noqa: E731
    ui.print(f"peak of one step: {show(off.peaks())} (Step 2: {show(base.peaks())})")
    if device.type == "cpu":
        ui.print("on a CPU device the policy moves nothing: the shards were in CPU memory already")
    return {"tried": tried, "policy": str(policy), "where": where,
            "pinned": p.to_local().is_pinned(), "peak_bytes": off.peaks()}


def report_dims(ui, hsdp, mesh2, shard: int) -> dict:
    """Step 6's table: HSDP's collectives per mesh dimension beside their formulas."""
    names = {dim: mesh2.get_group(dim).group_name for dim in ("shard", "replicate")}
    expected = {("shard", "all_gather"): gathered_formula(shard, 4),
                ("shard", "reduce_scatter"): reduced_formula(shard),
                ("replicate", "all_reduce"): reduced_formula(shard) // shard}  # my reduced shard
    per_dim, table = {}, []
    for (dim, what), formula in expected.items():
        calls, data, sent = hsdp.bytes_of(what, names[dim])
        per_dim[f"{dim}:{what}"] = {"calls": calls, "bytes": data, "formula": formula, "sent": sent}
        table.append([f"{dim} ({mesh2[dim].size()} ranks)", what.replace("_", "-"), calls, f"{data:,}",
                      f"{formula:,}", f"{sent:,.0f}"])
    ui.table("Per step on rank 0, by mesh dimension", ["dimension", "collective", "calls", "bytes (S)",
                                                        "formula", "bytes sent"], table)
    return per_dim


def report_accumulation(ui, k: int, world: int, counted: dict, gathers: int) -> dict:
    """Step 4's table: syncing every micro-batch against syncing the last, beside the formula."""
    groups = len(group_elements(world))
    (naive_rs, naive_ag, naive_peak), (acc_rs, acc_ag, acc_peak) = counted[True], counted[False]
    ui.table(f"One step of {k} micro-batches, rank 0", ["", "reduce-scatters", "bytes reduce-scattered",
                                                         "all-gathers", "peak"],
             [["sync every one", naive_rs[0], f"{naive_rs[1]:,}", naive_ag[0], f"{naive_peak:,}"],
              ["sync the last", acc_rs[0], f"{acc_rs[1]:,}", acc_ag[0], f"{acc_peak:,}"],
              ["formula (last)", f"{groups} (1 per group)", f"{reduced_formula(world):,}", f"{k} x {gathers}",
               ""]])
    ui.print("all-gathers stay k x: each micro-batch's forward and backward gather the weights again "
             "(set_reshard_after_backward(False) keeps them, at the price of memory)")
    return {"k": k, "groups": groups, "reduce_scatter_calls": acc_rs[0],
            "reduce_scatter_calls_naive": naive_rs[0], "all_gather_calls": acc_ag[0],
            "peak_bytes": acc_peak, "peak_bytes_naive": naive_peak}


def report_precision(ui, base, mp) -> None:
    """Step 3's table: what fp32 (Step 2) and the bf16 policy gathered, reduced and peaked at."""
    ag, rs = base.bytes_of("all_gather"), base.bytes_of("reduce_scatter")
    mp_ag, mp_rs = mp.bytes_of("all_gather"), mp.bytes_of("reduce_scatter")
    ui.table("Per step on rank 0, fp32 (Step 2) and bf16 compute", ["", "fp32", "bf16 policy", "ratio",
                                                                     "expected"],
             [["bytes all-gathered", f"{ag[1]:,}", f"{mp_ag[1]:,}", f"{mp_ag[1] / ag[1]:.2f}",
               "0.50 (2 of 4 bytes)"],
              ["bytes reduce-scattered", f"{rs[1]:,}", f"{mp_rs[1]:,}", f"{mp_rs[1] / rs[1]:.2f}",
               "1.00 (reduce_dtype fp32)"],
              ["peak of one step", f"{base.peak():,}", f"{mp.peak():,}", f"{mp.peak() / base.peak():.2f}",
               "below 1"]])
