"""Lesson 19's companion: the planner's formulas (mesh_checks.py holds the instruments).

The planner (no processes, no GPU): for a model (parameters, layers, hidden size, sequence
length, micro-batch, micro-batches per step), a GPU count and a GPU memory size, the bytes
each GPU holds and sends per step under DDP, ZeRO-1/2/3, tensor parallel (TP), pipeline
parallel (PP) and their combinations. Every formula is one the lessons taught:

    memory (lesson 13, the ZeRO paper): fp32 AdamW 4 + 4 + 8 bytes per parameter;
        mixed precision 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master, exp_avg,
        exp_avg_sq). TP keeps 1/T of every split tensor, PP 1/P of the layers; then ZeRO-1
        divides the 12 (or 8) by D, ZeRO-2 the gradients too, ZeRO-3 everything (lesson 15).
    data parallel (lessons 10, 15): all-reduce 2(D-1)/D of the gradients (DDP, and ZeRO-1/2:
        reduce-scatter + all-gather, (D-1)/D each); ZeRO-3 all-gathers the weights in forward
        and again in backward and reduce-scatters the gradients: 3(D-1)/D, in every
        micro-batch (FSDP2 gathers and reduce-scatters each one: measured by lesson 23).
    tensor parallel (lesson 17): per block, two all-reduces of the activations (b, s, h) in
        forward and two in backward, 2(T-1)/T each, per micro-batch.
    pipeline parallel (lesson 18): each micro-batch's activations (b, s, h) go to the next
        stage and their gradient comes back (point to point); idle share (p-1)/(m+p-1).
    activations (an estimate, lesson 13's checkpointing): with every block checkpointed, a
        stage keeps each block's input, b * s * h * 2 bytes (bf16), for every micro-batch in
        flight (1 without PP; p on 1F1B's first stage), divided by T (sequence parallel).
    padding (lesson 23, optional): Model.shapes lists every parameter tensor. Then ZeRO-3 counts,
        tensor by tensor, what FSDP2 really holds: TP splits rows (ColwiseParallel) or columns
        (RowwiseParallel), then FSDP2 gives every dp rank ceil(rows / D) rows, the last ranks'
        padded: ceil(rows / D) * cols elements each, and its collectives move D of those. The
        source (torch 2.14.1, torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
        FSDPParam._init_sharded_param): chunks = _chunk_with_empty(param_data, shard_world_size,
        dim=shard_dim), torch.chunk's pieces of ceil(rows / D) rows (empty ones appended when
        there are fewer), and padded_sharded_size = chunks[0].size() ("0th always padded"): every
        rank's storage has chunk 0's size. Rank 0, which this counts, holds exactly that. A
        tensor of 8 rows on 256 ranks costs every rank a whole row, 32 times an even share.
        ZeRO-1 and ZeRO-2 (lesson 15: whole tensors dealt to ranks) stay an even division.
        Without shapes, every tensor divides evenly (at most a row per tensor less).

The instruments that check these formulas inside lesson 19's job: mesh_checks.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


# Assumptions, not measurements: typical published per-GPU figures, in bytes per second.
NVLINK = 450e9     # inside a node: NVLink 4 (H100 SXM), about 450 GB/s each way per GPU
INFINIBAND = 50e9  # between nodes: one 400 Gb/s InfiniBand NIC per GPU, about 50 GB/s
MIXED = (2, 2, 12)  # bytes per parameter: weights, gradients, optimizer state (ZeRO paper)
FP32 = (4, 4, 8)


def ring(n: int) -> float:
    """Share of S a rank sends in a ring all-gather or reduce-scatter: (N-1)/N."""
    return (n - 1) / n


def bubble(p: int, m: int) -> float:
    """GPipe's and 1F1B's idle share: (p-1)/(m+p-1) for p stages and m micro-batches."""
    return (p - 1) / (m + p - 1)


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor, for Model.shapes: its full shape, what TP splits ("rows": dim 0,
    ColwiseParallel; "cols": dim 1, RowwiseParallel; "": whole on every TP rank), and its FSDP
    group ("root": the last fully_shard, not gathered again in backward; any other name: a block)."""
    shape: tuple[int, ...]
    split: str = ""
    group: str = "block"

    def rows_cols(self, tp: int) -> tuple[int, int]:
        """Rows and elements per row on one TP rank (a 1-D tensor: n rows of 1)."""
        rows, cols = self.shape[0], math.prod(self.shape[1:])
        return rows // (tp if self.split == "rows" else 1), cols // (tp if self.split == "cols" else 1)


@dataclass
class Model:
    params: float           # parameters
    layers: int             # transformer blocks
    hidden: int             # model width h
    seq: int                # tokens per sequence s
    micro_batch: int = 1    # sequences per micro-batch b
    microbatches: int = 8   # micro-batches per optimizer step on each data-parallel rank
    replicated: float = 0   # parameters tensor parallel leaves whole (norms, ...)
    shapes: list[Tensor] | None = None  # every parameter tensor: ZeRO-3 then counts FSDP2's padding


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0           # 0: DDP; 1, 2, 3: ZeRO stage across dp

    @property
    def name(self) -> str:
        dp = f"{['DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][self.zero]} {self.dp}" if self.dp > 1 else ""
        parts = [f"TP {self.tp}" if self.tp > 1 else "", f"PP {self.pp}" if self.pp > 1 else "", dp]
        return " x ".join(p for p in parts if p) or "1 GPU"


def fsdp2_shard(model: Model, lay: Layout, group: str | None = None) -> float:
    """Elements of one rank's ZeRO-3 shard (of one FSDP group, or of all), from model.shapes as
    FSDP2 cuts them: ceil(rows / D) * cols per tensor after TP's split (see the docstring)."""
    return sum(math.ceil(rows / lay.dp) * cols for t in model.shapes if group in (None, t.group)
               for rows, cols in [t.rows_cols(lay.tp)]) / lay.pp


def memory(model: Model, lay: Layout, per_param=MIXED) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one GPU."""
    local = ((model.params - model.replicated) / lay.tp + model.replicated) / lay.pp
    w, g, o = (b * local for b in per_param)
    if lay.zero >= 1:
        o /= lay.dp
    if lay.zero >= 2:
        g /= lay.dp
    if lay.zero >= 3:
        w /= lay.dp
    if lay.zero >= 3 and model.shapes:  # FSDP2's padded shards, tensor by tensor
        w, g, o = (b * fsdp2_shard(model, lay) for b in per_param)
    return {"parameters": w, "gradients": g, "optimizer_state": o}


def activations(model: Model, lay: Layout, element: int = 2) -> float:
    """Estimate: checkpointed block inputs of the micro-batches in flight (see the docstring)."""
    inflight = min(lay.pp, model.microbatches) if lay.pp > 1 else 1
    per_block = model.micro_batch * model.seq * model.hidden * element / lay.tp
    return model.layers / lay.pp * per_block * inflight


def comm(model: Model, lay: Layout, element: int = 2, group_bytes: list[float] | None = None) -> dict[str, float]:
    """Bytes one GPU sends per optimizer step, per dimension ("dp", "tp", "pp").

    group_bytes: for ZeRO-3, the bytes of each FSDP group's weights on a rank before the dp
    split; the last one is the root, which FSDP2 does not gather again in backward (lesson 19
    measures it). Without it, every weight is gathered twice (large models: the same). With
    model.shapes, the groups and FSDP2's padding come from the shapes (fsdp2_shard)."""
    local = ((model.params - model.replicated) / lay.tp + model.replicated) / lay.pp * element
    act = model.micro_batch * model.seq * model.hidden * element  # one micro-batch, one tensor
    steps = model.microbatches
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    if lay.zero < 3:
        out["dp"] = 2 * ring(lay.dp) * local
    elif model.shapes:  # D padded shards gathered in forward and backward (the root once), reduce-scattered
        per_element = element * (lay.dp - 1) * steps  # a ring sends (D-1)/D of D shards
        out["dp"] = per_element * (3 * fsdp2_shard(model, lay) - fsdp2_shard(model, lay, "root"))
    elif group_bytes:  # ZeRO-3: every micro-batch gathers the weights again (lesson 23 measures)
        out["dp"] = ring(lay.dp) * (3 * sum(group_bytes[:-1]) + 2 * group_bytes[-1]) * steps
    else:
        out["dp"] = 3 * ring(lay.dp) * local * steps
    out["tp"] = model.layers / lay.pp * 4 * 2 * ring(lay.tp) * act * steps
    out["pp"] = (2 if lay.pp > 2 else 1) * act * steps if lay.pp > 1 else 0.0  # a middle stage
    return out


# --- the plan table -----------------------------------------------------------------------

def layouts(gpus: int, per_node: int) -> list[Layout]:
    """Data parallel alone, then TP inside a node (and PP across nodes) with DP over the rest."""
    out = [Layout(dp=gpus, zero=z) for z in range(4)]
    tp = min(per_node, gpus)
    if tp > 1:
        out += [Layout(tp=tp, dp=gpus // tp, zero=z) for z in (1, 3)] if gpus > tp else [Layout(tp=tp)]
        out.append(Layout(tp=tp // 2, dp=gpus // (tp // 2), zero=3) if tp >= 4 else Layout())
    if gpus >= 4:
        out.append(Layout(pp=min(4, gpus), dp=gpus // min(4, gpus), zero=1))
    if gpus >= 2 * per_node > 1:  # tensor parallel across two nodes: what not to do
        out.append(Layout(tp=2 * per_node, dp=gpus // (2 * per_node), zero=3))
    if gpus > per_node and per_node > 1:
        pp = min(4, gpus // per_node)
        out.append(Layout(tp=per_node, pp=pp, dp=gpus // (per_node * pp), zero=1))
    fitting = [lay for lay in out if lay.dp * lay.tp * lay.pp == gpus]
    return list({lay.name: lay for lay in fitting}.values())  # 1 GPU: one row, not four


def crosses_nodes(lay: Layout, per_node: int) -> dict[str, bool]:
    """Ranks are numbered tp fastest, then dp, then pp (tp groups are neighbours)."""
    inner = lay.tp * lay.dp
    return {"tp": lay.tp > per_node, "dp": inner > per_node and lay.dp > 1,
            "pp": lay.pp > 1 and inner * lay.pp > per_node}


def plan_rows(model: Model, gpus: int, gpu_gb: float, per_node: int) -> list[list[str]]:
    rows = []
    for lay in layouts(gpus, per_node):
        mem = sum(memory(model, lay).values())
        act = activations(model, lay)
        sent = comm(model, lay)
        cross = crosses_nodes(lay, per_node)
        seconds = sum(b / (INFINIBAND if cross[d] else NVLINK) for d, b in sent.items())
        total = (mem + act) / 1e9
        rows.append([lay.name, f"{mem / 1e9:,.1f}", f"{act / 1e9:,.1f}",
                     f"{total:,.1f}" + ("" if total <= gpu_gb else " NO"),
                     " ".join(f"{d} {b / 1e9:,.1f}" for d, b in sent.items() if b) or "-",
                     " ".join(d for d, c in cross.items() if c) or "none",
                     f"{seconds:,.2f}", f"{bubble(lay.pp, model.microbatches):.0%}" if lay.pp > 1 else "-"])
    return rows


COLUMNS = ["layout", "state GB", "act. GB", "total GB", "GB sent", "off-node", "comm s", "bubble"]


def add_plan_flags(parser) -> None:
    parser.add_argument("--plan", type=float, default=None, metavar="PARAMS",
                        help="print the planner's table for a model of PARAMS parameters (e.g. 7e9) and exit")
    parser.add_argument("--gpus", type=int, default=8, help="--plan: GPUs in the job")
    parser.add_argument("--gpu-gb", type=float, default=80, help="--plan: memory of one GPU in GB")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="--plan: GPUs per node")
    parser.add_argument("--layers", type=int, default=32, help="--plan: transformer blocks")
    parser.add_argument("--hidden", type=int, default=4096, help="--plan: model width")
    parser.add_argument("--seq-len", type=int, default=4096, help="--plan: tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1, help="--plan: sequences per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="--plan: micro-batches per step on each data-parallel rank")


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


def show_plan(ui, args) -> list[list[str]]:
    model = Model(args.plan, args.layers, args.hidden, args.seq_len, args.micro_batch, args.microbatches)
    ui.print(f"A model of {args.plan / 1e9:g}B parameters ({args.layers} blocks, width {args.hidden}, "
             f"{args.seq_len} tokens, micro-batch {args.micro_batch} x {args.microbatches} per step) on "
             f"{args.gpus} GPUs of {args.gpu_gb:g} GB, {args.gpus_per_node} per node; mixed precision "
             f"AdamW (2 + 2 + 12 bytes per parameter), bf16 activations and gradients")
    rows = plan_rows(model, args.gpus, args.gpu_gb, args.gpus_per_node)
    ui.table("The plan: per GPU, per optimizer step", COLUMNS, rows)
    ui.print("state: weights + gradients + AdamW; act.: checkpointed activations (an estimate); "
             f"total: fits in {args.gpu_gb:g} GB or NO; GB sent: per dimension; off-node: dimensions "
             "whose groups span nodes (ranks numbered tp fastest, then dp, then pp); bubble: PP idle "
             "share (p-1)/(m+p-1)")
    ui.print(f"comm s = bytes / bandwidth, with ASSUMED bandwidths (typical figures, not measured): "
             f"{NVLINK / 1e9:.0f} GB/s per GPU inside a node (NVLink), {INFINIBAND / 1e9:.0f} GB/s "
             f"per GPU between nodes (InfiniBand); no overlap with compute counted.")
    return rows
