"""Lesson 19's planner: the bytes, FLOPs and step time of a real job, from formulas alone.

Run it by itself, or through lesson 19's --plan (the same flags, the same tables):
    .venv/bin/python lessons/19_two_d_mesh/planner.py 7e9 --gpus 8
    .venv/bin/python lessons/19_two_d_mesh/planner.py 7e9 --gpus 64 --sequence-parallel --out runs/plan
    make lesson-19 ARGS="--plan 7e9 --gpus 8"
It prints three tables (memory, bytes sent, seconds per step) and writes them to --out's
plan.json. Lessons 19 and 23 check its formulas against what their jobs measure
(lessons/19_two_d_mesh/mesh_checks.py, lessons/23_cluster_on_a_laptop/cluster_report.py).

The planner (no processes, no GPU): for a model (parameters, layers, hidden size, sequence
length, micro-batch, micro-batches per step), a GPU count and a GPU memory size, the bytes
each GPU holds and sends per step, the FLOPs it computes and the step time and MFU those imply,
under DDP, ZeRO-1/2/3, tensor parallel (TP, with or without sequence parallel, SP), pipeline
parallel (PP) and their combinations. Every formula is one the lessons taught, or cited here.
W: the parameters a GPU holds before the dp split (TP keeps 1/T of every split tensor, PP 1/P
of the layers); m: micro-batches per step on each dp rank; a ring sends (D-1)/D (lesson 10).

    memory: fp32 AdamW 4 + 4 + 8 bytes per parameter (lesson 13). Mixed precision as
        Megatron-LM keeps it: 2 (bf16 weights) + 4 (fp32 gradients) + 12 (fp32 master weights,
        exp_avg, exp_avg_sq) = 18, the "float16 param, fp32 grads: 18" row of Megatron Core's
        distributed optimizer guide (docs.nvidia.com/megatron-core/developer-guide/latest/
        distrib_optimizer.html; 6 + 12/d once the optimizer state is sharded); fp32 gradients
        because "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"
        (NVIDIA/Megatron-LM, megatron/training/arguments.py). ZeRO-1 divides the 12 (or 8)
        by D, ZeRO-2 the gradients too, ZeRO-3 everything (lesson 15).
    data parallel, in mixed precision gradients moving in fp32 (4 bytes), weights in bf16 (2):
        DDP:    all-reduce the gradients once per step (no_sync keeps the micro-batches'
                gradients local, lesson 08): 2(D-1)/D x W x 4
        ZeRO-1: reduce-scatter the same gradients once per step, then all-gather the updated
                weights: (D-1)/D x W x 4 + (D-1)/D x W x 2
        ZeRO-2: a rank keeps only its 1/D of the gradients, so it cannot accumulate the rest:
                reduce-scatter in every micro-batch, all-gather the weights once:
                (D-1)/D x W x 4 x m + (D-1)/D x W x 2
        ZeRO-3: gather the weights in forward and again in backward, reduce-scatter the
                gradients, in every micro-batch (FSDP2 does: lesson 23 measures it):
                (D-1)/D x W x (2 + 2 + 4) x m; the root is kept through backward, gathered once.
        So DDP's and ZeRO-1's bytes stay put as micro-batches grow the batch; ZeRO-2's and
        ZeRO-3's grow with m.
    tensor parallel (lesson 17): per block and micro-batch, two all-reduces of the activations
        (b, s, h) in forward, two in backward, and, with full activation checkpointing, two
        more in the forward that backward recomputes: 6, each 2(T-1)/T x b*s*h*2 bytes (4
        without checkpointing, as lessons 19 and 23 measure). SP replaces each all-reduce by
        an all-gather and a reduce-scatter of (T-1)/T each: the same bytes.
    pipeline parallel (lesson 18): each micro-batch's activations (b, s, h) go to the next
        stage and their gradient comes back (point to point; with SP each rank sends its 1/T
        of the sequence); idle share (p-1)/(m+p-1).
    activations (an estimate): with full checkpointing, a stage keeps each block's input,
        b*s*h*2 bytes (bf16), for every micro-batch in flight (1 without PP; p on 1F1B's
        first stage). Without SP every TP rank holds the whole input; with SP, its 1/T of the
        sequence. Without checkpointing: Korthikanti et al. 2022 ("Reducing Activation
        Recomputation in Large Transformer Models", Table 2) per block s*b*h*(10 + 24/T)
        bytes, s*b*h*34/T with SP, its attention-score term left out (flash attention keeps
        no scores).
    compute: a step's model FLOPs are about 6 x parameters x tokens (2 forward, 4 backward,
        Kaplan et al. 2020; attention's own s-squared FLOPs left out), tokens = D x b x m x s.
        Full checkpointing runs every forward twice: 8 x parameters x tokens of hardware FLOPs.
        Each GPU does 1/(D T P) of them at PEAK, an ASSUMED figure that we also assume the
        kernels reach (real ones reach perhaps half: real steps are slower); a pipeline idles
        its bubble: compute s = hardware FLOPs per GPU / PEAK / (1 - bubble).
    step time and MFU: comm s = each dimension's bytes / its ASSUMED bandwidth (NVLink inside
        a node, InfiniBand between). Without overlap a step takes compute s + comm s; with
        perfect overlap max(compute s, comm s) (the best case: tp's all-reduces sit between a
        block's matmuls and hide poorly). MFU = model FLOPs / (step s x GPUs x PEAK) (the PaLM
        paper's definition), for each.
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

The instruments that check these formulas inside lesson 19's job: mesh_checks.py. The runs
(lessons 19 and 23) are fp32 throughout and do not checkpoint: they pass element=4 and
Model(checkpoint=False).

Below the formulas, the command line: add_flags (lesson 19 shares them), check_flags, the
three tables, show_plan (print them, write plan.json) and main.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when a learner runs this file

from apparatus.results import atomic_write, claim_out, out_dir, shown
from apparatus.ui import UI
from common.cli import HelpFormatter, LessonParser, fail, run


# Assumptions, not measurements: typical published per-GPU figures.
NVLINK = 450e9     # bytes/s inside a node: NVLink 4 (H100 SXM), about 450 GB/s each way per GPU
INFINIBAND = 50e9  # bytes/s between nodes: one 400 Gb/s InfiniBand NIC per GPU, about 50 GB/s
PEAK = 989e12      # FLOP/s: H100 SXM's dense bf16 peak (NVIDIA's datasheet: 1,979 with sparsity)
MIXED = (2, 4, 12)  # bytes per parameter: bf16 weights, fp32 gradients, fp32 AdamW (Megatron-LM)
FP32 = (4, 4, 8)
WIRE = {"weights": 2, "gradients": 4, "activations": 2}  # bytes per element sent, mixed precision


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
    checkpoint: bool = True  # full activation checkpointing: every block's forward runs again in backward


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0           # 0: DDP; 1, 2, 3: ZeRO stage across dp
    sp: bool = False        # sequence parallel across the tp group (lesson 17)

    @property
    def name(self) -> str:
        dp = f"{['DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][self.zero]} {self.dp}" if self.dp > 1 else ""
        tp = f"TP {self.tp}" + (" SP" if self.sp else "") if self.tp > 1 else ""
        parts = [tp, f"PP {self.pp}" if self.pp > 1 else "", dp]
        return " x ".join(p for p in parts if p) or "1 GPU"


def fsdp2_shard(model: Model, lay: Layout, group: str | None = None) -> float:
    """Elements of one rank's ZeRO-3 shard (of one FSDP group, or of all), from model.shapes as
    FSDP2 cuts them: ceil(rows / D) * cols per tensor after TP's split (see the docstring)."""
    return sum(math.ceil(rows / lay.dp) * cols for t in model.shapes if group in (None, t.group)
               for rows, cols in [t.rows_cols(lay.tp)]) / lay.pp


def local_params(model: Model, lay: Layout) -> float:
    """W: the parameters one GPU holds before the dp split (TP's 1/T, PP's 1/P)."""
    return ((model.params - model.replicated) / lay.tp + model.replicated) / lay.pp


def memory(model: Model, lay: Layout, per_param=MIXED) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one GPU."""
    w, g, o = (b * local_params(model, lay) for b in per_param)
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
    """Estimate: the activations one GPU keeps for the micro-batches in flight (see the docstring)."""
    inflight = min(lay.pp, model.microbatches) if lay.pp > 1 else 1
    sbh = model.micro_batch * model.seq * model.hidden
    if model.checkpoint:  # each block's input: whole on every tp rank, or 1/T of it with SP
        per_block = sbh * element / (lay.tp if lay.sp else 1)
    else:  # Korthikanti et al. 2022, Table 2, in bytes for 16-bit activations
        per_block = sbh * (34 / lay.tp if lay.sp else 10 + 24 / lay.tp) * element / 2
    return model.layers / lay.pp * per_block * inflight


def comm(model: Model, lay: Layout, element: int | None = None,
         group_elements: list[float] | None = None) -> dict[str, float]:
    """Bytes one GPU sends per optimizer step, per dimension ("dp", "tp", "pp").

    element: bytes of every element sent (4: lessons 19's and 23's fp32 runs); None: mixed
    precision, WIRE's sizes. group_elements: for ZeRO-3, the elements of each FSDP group's
    weights on a rank before the dp split; the last one is the root, which FSDP2 does not
    gather again in backward (lesson 19 measures it). Without it, every weight is gathered
    twice (large models: the same). With model.shapes, the groups and FSDP2's padding come
    from the shapes (fsdp2_shard)."""
    w, g, a = (WIRE[k] if element is None else element for k in ("weights", "gradients", "activations"))
    local = local_params(model, lay)
    act = model.micro_batch * model.seq * model.hidden * a  # one micro-batch, one tensor
    m = model.microbatches
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    if lay.zero == 0:  # DDP: one all-reduce of the accumulated gradients per step
        out["dp"] = 2 * ring(lay.dp) * local * g
    elif lay.zero == 1:  # reduce-scatter the accumulated gradients, all-gather the new weights
        out["dp"] = ring(lay.dp) * local * (g + w)
    elif lay.zero == 2:  # reduce-scatter every micro-batch's gradients, all-gather once
        out["dp"] = ring(lay.dp) * local * (g * m + w)
    elif model.shapes:  # D padded shards gathered in forward and backward (the root once), reduce-scattered
        shard, root = fsdp2_shard(model, lay), fsdp2_shard(model, lay, "root")
        out["dp"] = (lay.dp - 1) * m * ((2 * w + g) * shard - w * root)  # a ring sends D-1 of D shards
    elif group_elements:  # ZeRO-3: every micro-batch gathers the weights again (lesson 23 measures)
        blocks, root = sum(group_elements[:-1]), group_elements[-1]
        out["dp"] = ring(lay.dp) * ((2 * w + g) * blocks + (w + g) * root) * m
    else:
        out["dp"] = ring(lay.dp) * local * (2 * w + g) * m
    per_block = 6 if model.checkpoint else 4  # all-reduces (or SP's pairs): forward, recompute, backward
    out["tp"] = model.layers / lay.pp * per_block * 2 * ring(lay.tp) * act * m
    boundary = act / (lay.tp if lay.sp else 1)  # with SP each tp rank sends its part of the sequence
    out["pp"] = (2 if lay.pp > 2 else 1) * boundary * m if lay.pp > 1 else 0.0  # a middle stage
    return out


def flops(model: Model, lay: Layout) -> dict[str, float]:
    """A step's model FLOPs (6 x parameters x tokens), and the hardware FLOPs one GPU runs
    (8 x parameters x tokens with recompute, split over every GPU)."""
    tokens = lay.dp * model.micro_batch * model.microbatches * model.seq
    hardware = (8 if model.checkpoint else 6) * model.params * tokens
    return {"tokens": tokens, "model_flops": 6 * model.params * tokens,
            "hardware_flops_per_gpu": hardware / (lay.dp * lay.tp * lay.pp)}


def step_time(model: Model, lay: Layout, sent: dict[str, float], cross: dict[str, bool],
              peak: float = PEAK) -> dict[str, float]:
    """Seconds per step from compute and communication, without and with overlap, and MFU."""
    f = flops(model, lay)
    idle = bubble(lay.pp, model.microbatches)
    compute = f["hardware_flops_per_gpu"] / peak / (1 - idle)
    comm_s = sum(b / (INFINIBAND if cross[d] else NVLINK) for d, b in sent.items())
    serial, overlap = compute + comm_s, max(compute, comm_s)
    gpus = lay.dp * lay.tp * lay.pp
    return {"compute_seconds": compute, "comm_seconds": comm_s, "bubble": idle,
            "step_seconds": serial, "step_seconds_overlap": overlap,
            "mfu": f["model_flops"] / (serial * gpus * peak),
            "mfu_overlap": f["model_flops"] / (overlap * gpus * peak), **f}


# --- the plan tables ----------------------------------------------------------------------

def layouts(gpus: int, per_node: int, sp: bool = False) -> list[Layout]:
    """Data parallel alone, then TP inside a node (and PP across nodes) with DP over the rest."""
    out = [Layout(dp=gpus, zero=z) for z in range(4)]
    tp = min(per_node, gpus)
    if tp > 1:
        out += [Layout(tp=tp, dp=gpus // tp, zero=z, sp=sp) for z in (1, 3)] if gpus > tp else [Layout(tp=tp, sp=sp)]
        out.append(Layout(tp=tp // 2, dp=gpus // (tp // 2), zero=3, sp=sp) if tp >= 4 else Layout())
    if gpus >= 4:
        out.append(Layout(pp=min(4, gpus), dp=gpus // min(4, gpus), zero=1))
    if gpus >= 2 * per_node > 1:  # tensor parallel across two nodes: what not to do
        out.append(Layout(tp=2 * per_node, dp=gpus // (2 * per_node), zero=3, sp=sp))
    if gpus > per_node and per_node > 1:
        pp = min(4, gpus // per_node)
        out.append(Layout(tp=per_node, pp=pp, dp=gpus // (per_node * pp), zero=1, sp=sp))
    fitting = [lay for lay in out if lay.dp * lay.tp * lay.pp == gpus]
    return list({lay.name: lay for lay in fitting}.values())  # 1 GPU: one row, not four


def crosses_nodes(lay: Layout, per_node: int) -> dict[str, bool]:
    """Ranks are numbered tp fastest, then dp, then pp (tp groups are neighbours)."""
    inner = lay.tp * lay.dp
    return {"tp": lay.tp > per_node, "dp": inner > per_node and lay.dp > 1,
            "pp": lay.pp > 1 and inner * lay.pp > per_node}


def plan(model: Model, gpus: int, gpu_gb: float, per_node: int, sp: bool = False) -> list[dict]:
    """Every layout's row: what plan.json holds (bytes, seconds and FLOPs per GPU per step)."""
    rows = []
    for lay in layouts(gpus, per_node, sp):
        state, act = sum(memory(model, lay).values()), activations(model, lay)
        sent, cross = comm(model, lay), crosses_nodes(lay, per_node)
        rows.append({"layout": lay.name, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero": lay.zero,
                     "sequence_parallel": lay.sp, "micro_batches": model.microbatches,
                     "state_bytes": state, "activation_bytes": act,
                     "fits": (state + act) / 1e9 <= gpu_gb, "bytes_sent": sent,
                     "off_node": [d for d, c in cross.items() if c], **step_time(model, lay, sent, cross)})
    return rows


# --- the command line: planner.py 7e9 --gpus 8, or lesson 19's --plan 7e9 --gpus 8 -----------

def add_flags(parser) -> None:
    """The job's flags beyond the parameter count (a parser, or lesson 19's argument group)."""
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in the job")
    parser.add_argument("--gpu-gb", type=float, default=80, help="memory of one GPU in GB")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks")
    parser.add_argument("--hidden", type=int, default=4096, help="model width")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="micro-batches per step on each data-parallel rank")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="tensor parallel layouts also split the sequence (lesson 17): "
                             "activations / T; without it every tp rank holds whole activations")


def check_flags(args, named: str = "PARAMS") -> None:
    """One line and exit 2 if a number makes no job. args.plan: the parameter count, the flag
    `named` (lesson 19's --plan)."""
    for flag in ("gpus", "gpus_per_node", "layers", "hidden", "seq_len", "micro_batch", "microbatches"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1")
    if not (0 < args.plan < 1e15 and 0 < args.gpu_gb < 1e6):  # nan and inf fail here too
        fail(f"{named} and --gpu-gb must be positive finite numbers (at most 1e15 parameters and "
             f"1e6 GB; e.g. 7e9 parameters on GPUs of 80 GB)")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        fail(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}")


def tables(rows: list[dict]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Three narrow tables (each fits 80 columns): memory, bytes sent, time."""
    def gb(n: float) -> str:
        return f"{n / 1e9:,.1f}" if n else "-"

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


def show_plan(ui, args, folder: Path) -> list[dict]:
    """Print the three tables for args' job and write them to folder/plan.json (already claimed)."""
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
    text = json.dumps({"model": {k: v for k, v in vars(model).items() if k != "shapes"}, "gpus": args.gpus,
                       "gpu_gb": args.gpu_gb, "gpus_per_node": args.gpus_per_node,
                       "sequence_parallel": args.sequence_parallel,
                       "assumed": {"nvlink_bytes_per_s": NVLINK, "infiniband_bytes_per_s": INFINIBAND,
                                   "peak_flops_per_s": PEAK, "kernels_reach_peak": True},
                       "rows": rows}, indent=2) + "\n"
    atomic_write(folder / "plan.json", lambda f: f.write(text.encode()))
    ui.print(f"wrote {shown(folder / 'plan.json')}")
    return rows


def main() -> None:
    parser = LessonParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("plan", type=float, metavar="PARAMS", help="the model's parameters, e.g. 7e9")
    add_flags(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for plan.json (default: runs/lesson-19, as lesson 19's --plan)")
    args = parser.parse_args()
    check_flags(args)
    show_plan(UI(), args, claim_out(out_dir("19", args.out)))


if __name__ == "__main__":
    run(main)
