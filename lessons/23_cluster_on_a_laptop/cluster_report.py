"""Lesson 23's report: the measured rank beside lesson 19's planner, the fake run beside real
gloo ranks, its flags and its metrics.json.

    add_flags(parser), check_flags(args)    --model --world-size --dp --tp --microbatches --real
                                            --vocab-parallel
    planner_model(size, m, vocab=...)       lesson 19's planner.Model for one of our sizes, its shapes
    planner_keys(size, dp, tp, m, vocab)    the planner's bytes for the job, with and without shapes
    peak_line(peak, args, fake)             Step 5's line on FSDPMemTracker's peak (or why none)
    measure(log, mesh, held, ...)           what one rank measured, in metrics.json's keys
    beside_planner(ui, measured, ...)       measured / planner, and the largest relative gap
    beside_fake(ui, real, fake)             the same job on real gloo ranks vs the fake group
"""
from __future__ import annotations

import torch

import planner  # lessons/19_two_d_mesh/planner.py: lesson 19's formulas, checked here
from fake_cluster import SIZES, Size, count_parameters, make_model

COLWISE = ("attn.q", "attn.k", "attn.v", "mlp.fc")  # lesson 19's plan: rows split across tp
ROWWISE = ("attn.proj.weight", "mlp.proj.weight")  # columns split across tp
VOCABULARY = ("tok_emb.", "head.")  # --vocab-parallel: rows (one per token of the vocabulary) across tp
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
HELD = ("parameters", "gradients", "optimizer_state")
MOST_WORLD = 4096  # run here up to 4,096 ranks (tiny; 1b and 7b at 1,024); beyond, untested
MOST_REAL = 8      # --real starts this many gloo processes at most, each a full tiny model
WORLD = 1024       # the default job: 1,024 ranks
PEAK_TOLERANCE = 0.05  # Step 7: a fake peak this close to the real one is reported by fake runs


def add_flags(parser) -> None:
    parser.add_argument("--model", choices=sorted(SIZES), default="1b",
                        help="the transformer's size (fake_cluster.py's SIZES)")
    parser.add_argument("--world-size", type=int, default=None,
                        help=f"ranks in the job (dp x tp); default: --dp x --tp when both are given, else {WORLD:,}")
    parser.add_argument("--tp", type=int, default=8, help="ranks across each block (tensor parallel); 1: FSDP2 alone")
    parser.add_argument("--dp", type=int, default=None,
                        help="ranks across the data (FSDP2); default: --world-size / --tp")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="forward and backward passes per optimizer step (gradient accumulation)")
    parser.add_argument("--real", action="store_true",
                        help="also run the same code on real gloo ranks and compare (--model tiny, at most 8 ranks)")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="also split the token embedding and the head across tp, by vocabulary "
                             "(the loss then runs under loss_parallel)")


def check_flags(args):
    """One line naming the problem and the fix, before any work; sets args.dp and args.size."""
    from common.cli import fail
    if args.device == "cuda":  # fake tensors have no device to run on; --real ranks use gloo
        fail("this lesson runs on the CPU by design (fake tensors, and gloo for --real): "
             "its numbers do not depend on the device; leave out --device")
    size = args.size = SIZES[args.model]
    given = ("world_size",) if args.world_size is not None else ()
    for flag in ("tp", "microbatches") + given + (("dp",) if args.dp is not None else ()):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be a whole number of 1 or more")
    if args.world_size is None:  # --dp 64 --tp 8 is a job of 512 ranks
        args.world_size = args.dp * args.tp if args.dp is not None else WORLD
    if args.world_size > MOST_WORLD:
        fail(f"--world-size {args.world_size}: this lesson is checked up to {MOST_WORLD} ranks; use fewer")
    if args.microbatches > 16:
        fail(f"--microbatches {args.microbatches}: at most 16 (each one is a forward and backward pass)")
    if args.dp is None:
        if args.world_size % args.tp:  # name only a --tp that every check below accepts
            fits = [t for t in range(1, args.world_size + 1) if args.world_size % t == 0 and size.heads % t == 0
                    and not (args.vocab_parallel and size.vocab % t)]
            fail(f"--tp {args.tp} does not divide --world-size {args.world_size}; pick a --tp that does "
                 f"(and divides --model {args.model}'s {size.heads} heads): {', '.join(map(str, fits))}")
        args.dp = args.world_size // args.tp
    if args.dp * args.tp != args.world_size:
        fail(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} ranks, not --world-size "
             f"{args.world_size}; make dp x tp equal the world size")
    if size.heads % args.tp:
        fail(f"--tp {args.tp} does not divide --model {args.model}'s {size.heads} attention heads "
             f"(each rank holds whole heads); use a divisor of {size.heads}")
    if args.vocab_parallel and size.vocab % args.tp:
        fail(f"--vocab-parallel: --tp {args.tp} does not divide --model {args.model}'s vocabulary of "
             f"{size.vocab:,} (each tp rank holds vocabulary / tp rows); use a divisor of it")
    if args.real and (args.model != "tiny" or args.world_size > MOST_REAL):
        fail(f"--real starts {args.world_size} real processes, each holding its shards: use --model tiny "
             f"and at most {MOST_REAL} ranks (e.g. --real --model tiny --world-size 4 --tp 2)")
    return args


def split_of(name: str, vocab: bool = False) -> str:
    """What lesson 19's plan splits across tp: ColwiseParallel rows, RowwiseParallel columns;
    with vocab (--vocab-parallel), the token embedding's and the head's rows too."""
    if any(s in name for s in COLWISE) or (vocab and name.startswith(VOCABULARY)):
        return "rows"
    return "cols" if any(s in name for s in ROWWISE) else ""


def planner_model(size: Size, microbatches: int, shapes: bool = True, vocab: bool = False) -> planner.Model:
    """Lesson 19's planner.Model for one of our sizes: one sequence per micro-batch per dp rank;
    `replicated`: the parameters the plan leaves whole on every tp rank; `shapes`: every
    parameter's shape, tp split and FSDP group (the block it is in, or the root), so the planner
    counts FSDP2's padding. shapes=False: the planner's even division, for comparison. No block
    is checkpointed: 4 tp all-reduces per block. planner_keys passes element=4: every tensor
    here is fp32, so the planner's mixed-precision sizes would not compare."""
    with torch.device("meta"):
        named = list(make_model(size).named_parameters())
    replicated = sum(p.numel() for n, p in named if not split_of(n, vocab))
    tensors = [planner.Tensor(tuple(p.shape), split_of(n, vocab), ".".join(n.split(".")[:2]) if n.startswith("blocks.") else "root")
               for n, p in named]
    return planner.Model(count_parameters(size), size.blocks, size.dim, size.seq, 1, microbatches, replicated,
                   tensors if shapes else None, checkpoint=False)  # our blocks are not checkpointed


def planner_keys(size: Size, dp: int, tp: int, microbatches: int, vocab: bool = False) -> dict:
    """The planner's numbers under metrics.json's keys: fp32 AdamW, TP x ZeRO-3 (FSDP2), from the
    shapes; "even_held_bytes": the same without shapes, every tensor divided evenly by dp;
    "activation_bytes": its estimate of the activations one rank keeps (fp32, no checkpointing).
    With vocab, the bytes sent across tp add what the planner does not count: the embedding's
    all-reduce in forward and the head's in backward, (1, seq, dim) each, per micro-batch
    (loss_parallel's all-reduces of one number per token are left out: they are small)."""
    model, lay = planner_model(size, microbatches, vocab=vocab), planner.Layout(dp=dp, tp=tp, zero=3)
    held, even = (planner.memory(m, lay, per_param=planner.FP32)
                  for m in (model, planner_model(size, microbatches, False, vocab)))
    sent = planner.comm(model, lay, element=4)
    if vocab:
        sent["tp"] += microbatches * 2 * 2 * planner.ring(tp) * size.seq * size.dim * 4
    return {"held_bytes": {k: round(held[k]) for k in HELD},
            "sent_bytes": {d: round(sent[d]) for d in ("dp", "tp")},
            "even_held_bytes": {k: round(even[k]) for k in HELD},
            "activation_bytes": round(planner.activations(model, lay, element=4))}


def peak_line(peak: dict, args, fake: bool) -> str:
    """Step 5's line: FSDPMemTracker's peak where a fake run can trust it (Step 7 measures
    where that is), or why there is none."""
    kinds = ", ".join(f"{k} {v:,}" for k, v in peak.items() if k != "total")
    if peak and (args.tp == 1 or not fake):
        return f"FSDPMemTracker's peak: [bold]{peak['total']:,}[/bold] bytes ({kinds})"
    if args.microbatches > 1:
        return ("peak: not measured with micro-batches (FSDPMemTracker refuses a root module that "
                "runs forward twice); use --microbatches 1")
    why = ("with tensor parallel the tracker counts DTensor's whole-shape fake tensors as this "
           "rank's (Step 7 measures the gap; with --tp 1 it holds)")
    if peak:
        return f"FSDPMemTracker's peak under fake tensors: {peak['total']:,} bytes, not reported: {why}"
    return f"peak: not measured: {why}"


def measure(log, mesh, held: dict, whole: dict, peak: dict, debug_counts: dict) -> dict:
    """What this rank measured: bytes held by kind, and of the parameters tp leaves whole;
    collectives by kind (CommLog's, and with --real torch's CommDebugMode's), bytes sent by mesh
    dimension (a collective's process group names its dimension), FSDPMemTracker's peak."""
    dims = {mesh[d].get_group().group_name: d for d in ("dp", "tp")}
    by_dim = log.tally(lambda c: dims.get(c.group, "other"), 1)
    return {"held_bytes": held, "whole_across_tp": whole,
            "collectives": {k: sum(1 for c in log.calls if c.kind == k) for k in KINDS},
            "collectives_by_dim": {d: {k: v.get(k, 0) for k in KINDS} for d, v in by_dim.items()},
            "sent_bytes": {d: round(by_dim.get(d, {}).get("sent_bytes", 0.0)) for d in ("dp", "tp")},
            "peak_bytes": peak, "comm_debug_mode": debug_counts}


def relative(measured: float, formula: float) -> float:
    """|measured - formula| / formula; 0 when both are 0, 1 when only the formula is 0."""
    if formula == 0:
        return 0.0 if measured == 0 else 1.0
    return abs(measured - formula) / formula


def beside_planner(ui, per_rank: dict, plan: dict, args, parameters: int, reported_peak: bool) -> float:
    rows, worst = [], 0.0
    for group in ("held_bytes", "sent_bytes"):
        for key, formula in plan[group].items():
            got = per_rank[group][key]
            gap = relative(got, formula)
            worst = max(worst, gap)
            what = key if group == "held_bytes" else f"sent across {key}"
            rows.append([what, f"{got:,}", f"{formula:,}", f"{gap:.2%}"])
    ui.table("Rank 0, one step: measured / lesson 19's planner (fp32 AdamW, TP x ZeRO-3)",
             ["bytes", "measured", "planner", "difference"], rows)
    if args.vocab_parallel:
        ui.print("(--vocab-parallel: the planner's tp bytes plus the embedding's all-reduce in forward "
                 "and the head's in backward, which lesson 19's plan does not have)")
    ui.print(f"largest difference from the planner: [bold]{worst:.2%}[/bold] (allowed 10%)")
    held, even = per_rank["held_bytes"]["parameters"], plan["even_held_bytes"]["parameters"]
    ui.print(f"FSDP2's padding: rank 0 holds {held:,} bytes of parameters, every tensor divided "
             f"evenly by dp {even:,} (+{relative(held, even):.2%}): each dp rank gets ceil(rows / dp) "
             f"rows of every tensor; the planner counts them from the model's shapes")
    whole, total, world = per_rank["whole_across_tp"], parameters, args.world_size
    if args.tp > 1:  # why rank 0 holds more than parameters x 4 / world: "an even split" of what?
        ui.print(f"tensor parallel leaves {whole['parameters']:,} of the {total:,} parameters whole on "
                 f"every tp rank (FSDP2 divides them by dp only): {whole['held_bytes']:,} of rank 0's "
                 f"{held:,} bytes ({whole['held_bytes'] / held:.0%}); all {world:,} ranks sharing every "
                 f"parameter evenly would hold {round(4 * total / world):,} each")
    peak = per_rank["peak_bytes"]
    if reported_peak:
        act = peak.get("activation", 0)
        ui.print(f"activations at FSDPMemTracker's peak: {act:,} bytes; the planner estimates "
                 f"{plan['activation_bytes']:,} for all of them (Korthikanti et al., fp32, no "
                 f"checkpointing): {act / plan['activation_bytes']:.2f}x")
    if worst > 0.10:
        ui.print("over 10%: the planner is wrong here, a bug to fix (lessons/19_two_d_mesh/planner.py)")
    return worst


def beside_fake(ui, real: dict, fake: dict, tp: int) -> tuple[bool, float]:
    """Rank 0 of real gloo ranks beside rank 0 of the fake group, the same code: every count and
    byte (and torch's CommDebugMode beside CommLog on both); then FSDPMemTracker's peaks, and
    what their gap says."""
    keys = [("held_bytes", k) for k in HELD] + [("collectives", k) for k in KINDS] + \
           [("comm_debug_mode", k) for k in KINDS] + [("sent_bytes", d) for d in ("dp", "tp")]
    rows = [[f"{g}: {k}", f"{fake[g].get(k, 0):,}", f"{real[g].get(k, 0):,}",
             "yes" if fake[g].get(k, 0) == real[g].get(k, 0) else "NO"] for g, k in keys]
    ui.table("Rank 0: the fake group beside real gloo ranks, the same code", ["", "fake", "real", "same"], rows)
    if not real["peak_bytes"]:
        ui.print("no peaks: FSDPMemTracker refuses a root module that runs twice (micro-batches); use --microbatches 1")
        return all(r[-1] == "yes" for r in rows), None
    peaks = [[k, f"{fake['peak_bytes'].get(k, 0):,}", f"{real['peak_bytes'].get(k, 0):,}"]
             for k in sorted(set(fake["peak_bytes"]) | set(real["peak_bytes"]))]
    ui.table("FSDPMemTracker's peak on rank 0, by kind (bytes)", ["", "fake", "real"], peaks)
    gap = relative(fake["peak_bytes"]["total"], real["peak_bytes"]["total"])
    ui.print(peak_verdict(gap, tp))
    return all(r[-1] == "yes" for r in rows), gap


def peak_verdict(gap: float, tp: int) -> str:
    """What Step 7's measured gap between the fake and the real peak says."""
    said = f"FSDPMemTracker's peak under fake tensors is {gap:.1%} off the real one"
    if gap <= PEAK_TOLERANCE:
        return (f"{said} (within {PEAK_TOLERANCE:.0%}; it files some bytes under other kinds): "
                f"here the fake run's peak holds" + (", and fake runs with --tp 1 report it" if tp == 1 else ""))
    if tp > 1:
        return (f"{said} (over {PEAK_TOLERANCE:.0%}): with tensor parallel it counts DTensor's "
                f"whole-shape fake tensors as this rank's, so fake runs with --tp above 1 report no peak")
    return f"{said} (over {PEAK_TOLERANCE:.0%}): not to be trusted for this job"
