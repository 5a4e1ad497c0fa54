"""Lesson 19's instruments: what its job measures, beside the planner's formulas (planner.py).

Inside lesson 19's job, on every rank:

    show_mesh(ui, mesh)              the mesh, and each rank's dp and tp groups
    report_dims(ui, log, mesh, ...)  the collectives apparatus/comm.py's CommLog recorded, sorted
                                     by the mesh dimension whose process group carried each one:
                                     bytes per step per dimension beside the planner, and what
                                     they would cost at assumed bandwidths
    check_memory(ui, held, ...)      bytes this rank holds beside the planner

check_flags and device_note: its flags, and what it says when it runs without GPUs.
"""
from __future__ import annotations

import logging

import torch

from planner import FP32, INFINIBAND, NVLINK, Layout, Model, comm, memory


def groups_of(mesh) -> dict[str, list[int]]:
    """{"dp": the global ranks of my dp group, "tp": of my tp group}."""
    import torch.distributed as dist
    return {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in ("dp", "tp")}


def show_mesh(ui, mesh) -> None:
    """The mesh (rows: dp coordinate, columns: tp), and every rank's two groups.
    Also quiets DTensor's warning that gathering a 2-D weight for the full state dict at the
    end takes two all-gathers: true, harmless here (once, at the end)."""
    import torch.distributed as dist
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mesh.get_coordinate(), groups_of(mesh)))
    ui.print(f"mesh {tuple(mesh.shape)} ('dp', 'tp'): {mesh.mesh.tolist()}  (row = one tp group, "
             f"column = one dp group)")
    ui.table("Who talks to whom", ["rank", "(dp, tp) coordinate", "dp group: FSDP2, same weight shard",
                                   "tp group: activations, same batch rows"],
             [[r, tuple(c), g["dp"], g["tp"]] for r, (c, g) in enumerate(everyone)])


def recipe_model(dp: int) -> Model:
    """The Part 2 recipe as the planner sees it: each dp rank's rows are one micro-batch, and
    no block is checkpointed (4 tp all-reduces per block, not 6)."""
    from common import transformer as T
    split = ("attn.q", "attn.k", "attn.v", "mlp.fc", "attn.proj.weight", "mlp.proj.weight")
    params = replicated = 0
    for name, p in T.make_model().named_parameters():
        params += p.numel()
        replicated += 0 if any(s in name for s in split) else p.numel()
    return Model(params, T.N_BLOCKS, T.DIM, T.SEQ, T.GLOBAL_BATCH // dp, 1, replicated, checkpoint=False)


def recipe_groups(tp: int) -> list[float]:
    """Elements of each FSDP group (the blocks, then the root) on a rank after TP's split."""
    from common import transformer as T
    split = ("attn.q", "attn.k", "attn.v", "mlp.fc", "attn.proj.weight", "mlp.proj.weight")
    groups = [0.0] * (T.N_BLOCKS + 1)
    for name, p in T.make_model().named_parameters():
        i = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        groups[i] += p.numel() / (tp if any(s in name for s in split) else 1)
    return groups


def report_dims(ui, log, mesh, steps: int) -> dict:
    """Bytes this rank sent per step in each dimension (the CommLog recorded `steps` steps; a
    call's process group names its dimension), beside the planner's formula, and what that
    would take on each kind of link (assumed bandwidths, not measured)."""
    from apparatus.comm import SHARE

    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    dims = {mesh[d].get_group().group_name: d for d in ("dp", "tp")}
    measured = log.tally(lambda c: dims.get(c.group, "other"), steps)
    model = recipe_model(dp)
    formula = comm(model, Layout(dp=dp, tp=tp, zero=3), element=4, group_elements=recipe_groups(tp))
    rows = []
    for dim in ("dp", "tp"):
        m = measured.get(dim, {"calls": 0, "sent_bytes": 0.0})
        kinds = ", ".join(f"{m[k]:g} {k}" for k in SHARE if m.get(k))  # apparatus/comm.py's kinds
        rows.append([dim, kinds or "none", f"{m['sent_bytes']:,.0f}", f"{formula[dim]:,.0f}",
                     f"{m['sent_bytes'] / NVLINK * 1e6:,.2f}", f"{m['sent_bytes'] / INFINIBAND * 1e6:,.2f}"])
    ui.table(f"Bytes rank 0 sent per step, by dimension (dp {dp} x tp {tp})",
             ["dim", "collectives per step", "measured", "planner formula",
              "us at 450 GB/s (NVLink, assumed)", "us at 50 GB/s (InfiniBand, assumed)"], rows)
    dp_sent, tp_sent = (measured.get(d, {}).get("sent_bytes", 0.0) for d in ("dp", "tp"))
    if dp_sent and tp_sent:
        ui.print(f"tp sent {tp_sent / dp_sent:.1f}x what dp sent; the link speeds are typical "
                 f"figures, assumed, not measured here")
    ddp = comm(model, Layout(dp=dp, tp=tp), element=4)["dp"]  # DDP across dp, for comparison
    return {"measured": measured, "formula": formula, "ddp_formula": ddp}


def check_memory(ui, held: dict, dp: int, tp: int) -> dict:
    """Bytes this rank holds (measured) beside the planner's fp32 formula for TP x ZeRO-3."""
    import torch.distributed as dist
    model = recipe_model(dp)
    formula = memory(model, Layout(dp=dp, tp=tp, zero=3), per_param=FP32)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    ui.table(f"Bytes each rank holds, measured / planner (TP {tp} x ZeRO-3 {dp}, fp32)",
             ["rank", "parameters", "gradients", "optimizer state"],
             [[r] + [f"{h[k]:,} / {formula[k]:,.0f}" for k in formula] for r, h in enumerate(everyone)])
    return {"measured": everyone, "formula": formula}


def metrics(comm: dict, memory_check: dict) -> dict:
    """Lesson 15's metrics.json keys, for the 2-D run, and the per-dimension details."""
    import torch.distributed as dist
    measured = comm["measured"]
    return {"comm_bytes_per_step": sum(d["sent_bytes"] for d in measured.values()),
            "comm_formula_bytes": sum(comm["formula"].values()), "ddp_comm_bytes": comm["ddp_formula"],
            "comm_calls_per_step": sum(d["calls"] for d in measured.values()),
            "comm_by_dim": measured, "comm_formula_by_dim": comm["formula"],
            "strategy": "fsdp+tp", "reshard_after_forward": True,
            "per_rank_bytes": memory_check["measured"][dist.get_rank()],
            "per_rank_bytes_all": [{"measured": h, "formula": memory_check["formula"]}
                                   for h in memory_check["measured"]]}


def check_flags(args):
    """Lesson 19's flags beyond --dp and --tp (the lesson checks those by Part 2's rule, and
    --plan's numbers by the planner's): --device cuda needs a GPU per rank."""
    from common.cli import fail
    args.world_size = args.dp * args.tp  # what lesson 15's code calls the job's size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.plan is None and args.device == "cuda" and 0 < gpus < args.world_size:
        fail(f"--device cuda with --dp {args.dp} --tp {args.tp} needs {args.world_size} GPUs (one per "
             f"rank), but {gpus} are visible; use fewer ranks (dp x tp <= {gpus}) or --device cpu")
    return args


def device_note(note: str | None) -> str | None:
    """plan_device's note, with lesson 19's flags in place of --world-size."""
    if note and " (--world-size" in note:
        return note.split(" (--world-size")[0] + " (fewer ranks, e.g. --dp 1 --tp 2, use the GPUs)"
    return note
