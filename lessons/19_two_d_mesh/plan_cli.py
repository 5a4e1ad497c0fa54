"""Lesson 19's planner on the command line: --plan's flags, their checks, the three tables it
prints and the plan.json it writes. The formulas themselves are in planner.py, beside this."""
from __future__ import annotations

from planner import INFINIBAND, NVLINK, PEAK, Model, plan


def tables(rows: list[dict]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Three narrow tables (each fits 80 columns): memory, bytes sent, time."""
    gb = lambda b: f"{b / 1e9:,.1f}" if b else "-"
    memory_rows = [[r["layout"], gb(r["state_bytes"]), gb(r["activation_bytes"]),
                    gb(r["state_bytes"] + r["activation_bytes"]), "yes" if r["fits"] else "NO"] for r in rows]
    sent_rows = [[r["layout"], *(gb(r["bytes_sent"][d]) for d in ("dp", "tp", "pp")),
                  " ".join(r["off_node"]) or "none", f"{r['comm_seconds']:,.2f}"] for r in rows]
    time_rows = [[r["layout"], f"{r['compute_seconds']:,.2f}", f"{r['bubble']:.0%}" if r["pp"] > 1 else "-",
                  f"{r['step_seconds']:,.2f}", f"{r['mfu']:.0%}", f"{r['step_seconds_overlap']:,.2f}",
                  f"{r['mfu_overlap']:.0%}"] for r in rows]
    return {"Memory per GPU, GB": (["layout", "state", "act.", "total", "fits"], memory_rows),
            "GB each GPU sends per step, by dimension": (["layout", "dp", "tp", "pp", "off-node", "comm s"], sent_rows),
            "Seconds per step": (["layout", "compute", "bubble", "serial", "MFU", "overlap", "MFU"], time_rows)}


def add_plan_flags(parser) -> None:
    parser.add_argument("--plan", type=float, default=None, metavar="PARAMS",
                        help="print the planner's tables for a model of PARAMS parameters (e.g. 7e9), "
                             "write them to --out's plan.json, and exit")
    parser.add_argument("--gpus", type=int, default=8, help="--plan: GPUs in the job")
    parser.add_argument("--gpu-gb", type=float, default=80, help="--plan: memory of one GPU in GB")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="--plan: GPUs per node")
    parser.add_argument("--layers", type=int, default=32, help="--plan: transformer blocks")
    parser.add_argument("--hidden", type=int, default=4096, help="--plan: model width")
    parser.add_argument("--seq-len", type=int, default=4096, help="--plan: tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1, help="--plan: sequences per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="--plan: micro-batches per step on each data-parallel rank")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="--plan: tensor parallel layouts also split the sequence (lesson 17): "
                             "activations / T; without it every tp rank holds whole activations")


def check_plan_flags(args) -> str | None:
    """The one-line problem with the --plan flags, or None."""
    for flag in ("gpus", "gpus_per_node", "layers", "hidden", "seq_len", "micro_batch", "microbatches"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1"
    if not (0 < args.plan < 1e15 and 0 < args.gpu_gb < 1e6):  # nan and inf fail here too
        return ("--plan and --gpu-gb must be positive finite numbers (at most 1e15 parameters, "
                "1e6 GB), e.g. --plan 7e9 --gpus 8 --gpu-gb 80")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        return f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}"
    return None


def show_plan(ui, args, folder) -> list[dict]:
    """Print the planner's three tables and write them to folder/plan.json (already claimed)."""
    import json

    from apparatus.results import atomic_write, shown
    model = Model(args.plan, args.layers, args.hidden, args.seq_len, args.micro_batch, args.microbatches)
    ui.print(f"A model of {args.plan / 1e9:g}B parameters ({args.layers} blocks, width {args.hidden}, "
             f"{args.seq_len} tokens, micro-batch {args.micro_batch} x {args.microbatches} per step) on "
             f"{args.gpus} GPUs of {args.gpu_gb:g} GB, {args.gpus_per_node} per node. Mixed precision as "
             f"Megatron-LM: 2 + 4 + 12 bytes per parameter (bf16 weights, fp32 gradients, fp32 AdamW); "
             f"gradients sent in fp32, weights and activations in bf16; every block checkpointed; "
             f"sequence parallel {'on (SP)' if args.sequence_parallel else 'off (--sequence-parallel turns it on)'}.")
    rows = plan(model, args.gpus, args.gpu_gb, args.gpus_per_node, args.sequence_parallel)
    for title, (columns, cells) in tables(rows).items():
        ui.table(title, columns, cells)
    odd = sorted({row["tp"] for row in rows if args.hidden % row["tp"]})
    if odd:  # e.g. 3 GPUs: TP 3 of a width of 4,096
        ui.print(f"note: tensor parallel of {', '.join(map(str, odd))} does not divide the width "
                 f"{args.hidden}, so no real job splits these layers that way; those rows only show the formulas")
    ui.print("state: weights + gradients + AdamW; act.: checkpointed block inputs (an estimate); "
             "off-node: dimensions whose groups span nodes (ranks numbered tp fastest, then dp, then pp); "
             "compute: 8 x parameters x tokens / GPUs at the peak (6 + 2 recomputed), stretched by the "
             "bubble, PP's idle share (p-1)/(m+p-1); serial: compute + comm; overlap: the larger of the "
             "two (perfect overlap); MFU: 6 x parameters x tokens / (step s x GPUs x peak). A step is "
             "dp x micro-batch x micro-batches sequences: a layout with less dp takes smaller, shorter "
             "steps, so compare MFU, not seconds.")
    ui.print(f"ASSUMED (typical published figures, not measured): {NVLINK / 1e9:.0f} GB/s per GPU inside "
             f"a node (NVLink), {INFINIBAND / 1e9:.0f} GB/s per GPU between nodes (InfiniBand), "
             f"{PEAK / 1e12:.0f} TFLOP/s per GPU (H100 SXM dense bf16), and kernels that reach that peak.")
    text = json.dumps({"model": {k: v for k, v in vars(model).items() if k != "shapes"}, "gpus": args.gpus, "gpu_gb": args.gpu_gb,
                       "gpus_per_node": args.gpus_per_node, "sequence_parallel": args.sequence_parallel,
                       "assumed": {"nvlink_bytes_per_s": NVLINK, "infiniband_bytes_per_s": INFINIBAND,
                                   "peak_flops_per_s": PEAK, "kernels_reach_peak": True},
                       "rows": rows}, indent=2) + "\n"
    atomic_write(folder / "plan.json", lambda f: f.write(text.encode()))
    ui.print(f"wrote {shown(folder / 'plan.json')}")
    return rows
