"""What lesson 22 measures and prints: who holds which expert, the split sizes of one batch,
the gradients before and after their sync against one process's, tokens per expert and drops
beside the one-process run's, the all-to-all bytes beside the formula, and the capacity
factors compared. The mixture of experts itself is in moe.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from apparatus.results import shown
from common import transformer as T
from moe import AUX_COEF, Setup, aux_loss, moe_model, reference_path


def show_baselines(refs: dict, trained: list, steps: int, ui) -> None:
    """Step 1's runs, each saying whether it was trained now or read from the cache."""
    folder = shown(reference_path(next(iter(refs)), steps).parent, markup=False)
    ui.print(f"one process each, every expert local; the cache: {folder}/", markup=False)  # a path is text
    for setup, ref in refs.items():
        c = ref["counts"]
        where = ("trained now, cached for the next run" if setup in trained
                 else "read from the cache, trained by an earlier run")
        ui.print(f"capacity factor {setup.factor}: loss {ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f}, "
                 f"{c[:, :, 1].sum():,} of {c.sum():,} assignments dropped ({where})")


def describe(model, rank: int, world: int, ui) -> None:
    """Who holds which expert, what this rank holds, and the capacity."""
    layer = model.blocks[0].mlp
    held = sum(p.numel() for p in model.parameters())
    owners = ", ".join(f"rank {r}: {r * layer.local}-{(r + 1) * layer.local - 1}" if layer.local > 1
                       else f"rank {r}: {r}" for r in range(world))
    ui.print(f"each block: {layer.E} experts shaped like lesson 13's MLP, router Linear({T.DIM}, {layer.E}), "
             f"top-{layer.k}; experts by rank: {owners}")
    ui.print(f"rank {rank} holds {held:,} parameters: the shared ones and {layer.local} experts per block")
    ui.print(f"each rank routes its own {T.GLOBAL_BATCH // world} rows ({T.GLOBAL_BATCH // world * T.SEQ} tokens)")
    ui.print(f"capacity: {layer.cap} slots per expert and row (capacity factor x {layer.k} x {T.SEQ} "
             f"tokens / {layer.E} experts, rounded up); an assignment past them is dropped")


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.new_empty(world * t.numel())
    dist.all_gather_single(out, t.flatten())
    return out.view(world, *t.shape).cpu()


def show_routing(model, x: torch.Tensor, rank: int, world: int, ui) -> None:
    """Route this rank's rows x (one forward, no gradient); print what every rank sent to each
    expert of block 0: the split sizes of its all-to-all."""
    with torch.no_grad():
        model(x)
    layer = model.blocks[0].mlp
    every = _gather(layer.counts, world)  # (world, 2, E): kept, dropped
    by_rank = lambda t: " | ".join(" ".join(map(str, part.tolist())) for part in t.view(world, -1))  # noqa: E731
    rows = [[f"rank {s}", by_rank(every[s, 0]), every[s, 1].sum().item(),
             " ".join(map(str, every[s, 0].view(world, -1).sum(1).tolist()))] for s in range(world)]
    ui.table(f"Block 0, batch 0: rows each rank sends to experts 0-{layer.E - 1} ({layer.local} per rank)",
             ["from", "to each expert (| between ranks)", "dropped", "split sizes: to each rank"], rows)
    ui.print(f"rank 0 receives {every[:, 0, :layer.local].sum(0).tolist()} rows for its experts "
             f"{list(range(layer.local))}: its column of split sizes, which the first all-to-all told it")


def check_gradients(model, sync, setup: Setup, rank, world, device, ui) -> dict:
    """Batch 0's gradient on this rank before and after sync(model), against one process's."""
    one = moe_model(setup)  # every expert, the whole batch
    x, y = T.batch(0, setup.seed)
    (T.loss_fn(one(x), y) + AUX_COEF * aux_loss(one)).backward()
    truth = {name: p.grad for name, p in one.named_parameters()}
    xs, ys = (T.shard(t, rank, world).to(device) for t in (x, y))
    (T.loss_fn(model(xs), ys) + AUX_COEF * aux_loss(model)).backward()
    mine = {name: p for name, p in model.named_parameters()}
    expert = [n for n in mine if ".experts." in n]
    ratio = [mine[n].grad.norm().item() / truth[n].norm().item() for n in expert]
    shared = max((mine[n].grad.cpu() - truth[n]).abs().max().item() for n in mine if n not in expert)
    sync(model, world)
    after = max((p.grad.cpu() - truth[n]).abs().max().item() for n, p in mine.items())
    model.zero_grad(set_to_none=True)
    got = _gather(torch.tensor([min(ratio), max(ratio), shared, after], device=device), world)
    result = {"expert_grad_ratio_before": [got[:, 0].min().item(), got[:, 1].max().item()],
              "shared_max_abs_diff_before": got[:, 2].max().item(),
              "max_abs_diff_after": got[:, 3].max().item()}
    lo, hi = result["expert_grad_ratio_before"]
    ui.print(f"before: an expert's gradient is {lo:.4f}x to {hi:.4f}x one process's (N = {world}: every "
             f"rank's mean loss, summed); a shared one is this rank's part (max |g - g_1| = "
             f"{result['shared_max_abs_diff_before']:.1e})")
    ui.print(f"after sync_gradients: max |g - g_1| = [bold]{result['max_abs_diff_after']:.1e}[/bold], "
             f"every parameter on every rank")
    return result


def show_counts(seen: torch.Tensor, ref: torch.Tensor, steps: list[int], ui) -> bool:
    """Tokens per expert (kept) and dropped, at `steps`, beside the one-process run's; True if
    they are equal at every step."""
    same = [torch.equal(seen[s], ref[s]) for s in range(len(seen))]
    rows = [[s + 1, *[" ".join(map(str, seen[s, b, 0].tolist())) for b in range(seen.shape[1])],
             " ".join(map(str, seen[s, :, 1].sum(-1).tolist())), same[s]] for s in steps]
    ui.table("Tokens per expert in each block, dropped assignments (all ranks); same: as one process",
             ["step", *[f"block {b}" for b in range(seen.shape[1])], "dropped", "same"], rows)
    ui.print(f"all {len(seen)} steps, every block and expert, the same as one process: [bold]{all(same)}[/bold]")
    return all(same)


def show_bytes(measured: dict, formula: list[int], log, ui) -> None:
    """The all-to-all bytes CommLog recorded (all ranks) beside the formula, per recorded step."""
    calls = [c for c in log.calls if c.kind == "all_to_all"]
    if not calls:
        ui.print("one rank holds every expert: no all-to-all, nothing sent")
        return
    by_phase = log.tally(lambda c: c.phase, len(measured), calls)
    ui.print("rank 0's all-to-alls per step: " + "; ".join(
        f"{d['calls']:g} in {phase} ({d['data_bytes']:,.0f} bytes)" for phase, d in by_phase.items()))
    ui.table("All-to-all bytes per step, all ranks: measured (CommLog) and the formula",
             ["step", "measured", "formula", "equal"],
             [[s, f"{b:,}", f"{formula[s - 1]:,}", b == formula[s - 1]] for s, b in measured.items()])


def compare_capacities(refs: dict, setup: Setup, world: int, ui) -> dict:
    """{factor: drops and losses} of the one-process runs `refs` ({Setup: train_single's answer}),
    each beside what a perfectly uniform router would drop (Setup.uniform_drop)."""
    out = {}
    for s, ref in refs.items():
        c = ref["counts"]
        out[str(s.factor)] = {"capacity": s.capacity, "dropped": int(c[:, :, 1].sum()),
                              "assignments": int(c.sum()), "dropped_last_step": int(c[-1, :, 1].sum()),
                              "uniform_router_drop_fraction": s.uniform_drop(),
                              "last_loss": ref["losses"][-1].item(), "held_out_loss": ref["held_out"][0].item()}
    total = next(iter(out.values()))["assignments"]
    ui.table(f"Drops (of {total:,} assignments) and loss, one process each; this run's factor: {setup.factor}",
             ["factor", "slots", "dropped", "uniform router", "dropped, last step", "last loss", "held-out loss"],
             [[f, d["capacity"], f"{d['dropped']:,} ({d['dropped'] / d['assignments']:.1%})",
               f"{d['uniform_router_drop_fraction']:.1%}", f"{d['dropped_last_step']:,}",
               f"{d['last_loss']:.4f}", f"{d['held_out_loss']:.4f}"] for f, d in out.items()])
    rank_tokens = T.GLOBAL_BATCH // world * T.SEQ
    rank_capacity = setup.capacity_of(rank_tokens)
    # markup=False: the formula's brackets are text, not rich's markup
    ui.print(f"a uniform router (each token's k experts drawn at random) drops {setup.uniform_drop():.1%} at "
             f"factor {setup.factor} by chance alone: an expert's assignments in a row are X ~ Binomial("
             f"{T.SEQ}, k/E = {setup.top_k}/{setup.experts}), past its C = {setup.capacity} slots it drops "
             f"max(0, X - C), so E x E[max(0, X - C)] / (k x {T.SEQ}) of the assignments", markup=False)
    ui.print(f"the drops measured above that are the router's imbalance; counted over a rank's {rank_tokens} "
             f"tokens (C = {rank_capacity}) instead of a row's {T.SEQ}, the same uniform router would drop "
             f"{setup.uniform_drop(rank_tokens):.1%}: small groups drop by chance", markup=False)
    return out


def metrics(setup: Setup, seen: torch.Tensor, ref: dict, measured: dict, formula: list, grads: dict,
            capacities: dict) -> dict:
    """What metrics.json adds to lesson 13's keys."""
    return {"experts": setup.experts, "top_k": setup.top_k, "capacity_factor": setup.factor,
            "capacity": setup.capacity, "dtype": setup.dtype,
            "tokens_per_expert": seen[:, :, 0].tolist(),  # (steps, blocks, E): tokens kept, all ranks
            "dropped_tokens": seen[:, :, 1].sum(-1).tolist(),  # (steps, blocks)
            "dropped_fraction": (seen[:, :, 1].sum() / seen.sum()).item(),  # of every assignment, all steps
            "uniform_router_drop_fraction": setup.uniform_drop(),  # what chance alone drops, per row
            "tokens_per_expert_single_device": ref["counts"][:, :, 0].tolist(),
            "dropped_tokens_single_device": ref["counts"][:, :, 1].sum(-1).tolist(),
            "all_to_all_bytes_per_step": measured, "all_to_all_bytes_formula": formula,
            "gradient_check": grads, "capacity_factors": capacities}
