"""Lesson 23: a cluster on a laptop: one process plays rank 0 of a 1,024-rank job.

Parent: lesson 19 (lessons/19_two_d_mesh.py)

New since lesson 19: no other rank exists. A "fake" process group tells this process it is rank
0 of W and answers every collective at once; FakeTensorMode gives tensors shapes and no memory,
so a 1B-7B transformer costs nothing. On it runs torch's real code: lesson 19's mesh, its
tensor-parallel plan and fully_shard, one training step. Measured on this one rank: the bytes it
holds, every collective and its bytes per mesh dimension, beside lesson 19's planner
(lessons/19_two_d_mesh/planner.py), and with FSDP2 alone (--tp 1) its peak memory (torch's
FSDPMemTracker). --vocab-parallel also splits the embedding and the head across tp, by
vocabulary, with loss_parallel. --real runs the same code on real gloo ranks (a tiny model, 1 to
8 ranks) and compares every count, byte and the peak with the fake run.

PRIVATE API: FakeStore and the "fake" backend come from torch.testing._internal.distributed.fake_pg,
torch's own test helpers, not its public API; checked on torch 2.14.1 only
(lessons/23_cluster_on_a_laptop/fake_cluster.py says where each private piece comes from).

Run:
    make lesson-23
    make lesson-23 ARGS="--model 7b --world-size 1024 --tp 1"
    make lesson-23 ARGS="--vocab-parallel"
    .venv/bin/python lessons/23_cluster_on_a_laptop.py --model 3b --dp 64 --tp 8 --microbatches 2
    .venv/bin/python lessons/23_cluster_on_a_laptop.py --real --model tiny --world-size 4 --tp 2
    .venv/bin/python lessons/23_cluster_on_a_laptop.py --real --model tiny --world-size 2 --tp 1

Doc: docs/23_cluster_on_a_laptop.md
"""
import contextlib
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 23_cluster_on_a_laptop/
sys.path.insert(1, str(Path(__file__).resolve().parent / "19_two_d_mesh"))  # lesson 19's planner.py

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode  # private (a leading underscore)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, parallel as tp

from apparatus.comm import CommLog
import cluster_report
import fake_cluster
from common import transformer as T
from common.cli import lesson_parser, run, seed_number
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True)
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the tokens")
    cluster_report.add_flags(parser)  # --model, --world-size, --dp, --tp, --microbatches, --real, --vocab-parallel
    return cluster_report.check_flags(parser.parse_args())  # dp x tp = world size; tp divides the heads


def main() -> None:
    args = parse_args()
    folder = claim_out(out_dir("23", args.out))  # checked now, not after the work; ours alone
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 23: rank 0 of {args.world_size:,} ({args.dp} x {args.tp}, dp x tp), "
             f"a {args.model} transformer, in one process")
    ui.print(fake_cluster.version_note())

    # Step 1: Join a fake process group of W ranks: this process is rank 0
    # Nothing listens on a port and no other process starts: FakeStore is a store that stores
    # nothing, the "fake" backend a process group whose collectives return at once (PRIVATE API).
    ui.step(1, "Join a fake process group of W ranks: this process is rank 0")
    fake_cluster.join_fake_group(args.world_size)
    warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # our logits are a view, as in lesson 19
    ui.print(f"rank {dist.get_rank()} of {dist.get_world_size():,}, backend {dist.get_backend()!r}, "
             f"process {os.getpid()}: the only one")
    fake, plan, worst = worker(0, args.world_size, args, ui)
    if not args.real:
        return finish(ui, args, folder, fake, plan, worst)
    ui.pause(next_step=(7, "Run the same code on real gloo ranks, compare, save the results"))
    dist.destroy_process_group()  # the fake group: the real ranks start their own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(real_rank, args=(args.world_size, args, folder, (fake, plan, worst)), nprocs=args.world_size)


def real_rank(rank: int, world: int, args, folder: Path, fake: tuple) -> None:
    """The same worker() on one of W real gloo processes (--real); rank 0 compares and saves."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env("gloo", args.timeout)
    torch.set_num_threads(1)
    real, _, _ = worker(rank, world, args, UI(rank=-1))  # -1: silent; the fake run told the steps
    if rank == 0:
        finish(UI(step_mode=args.step), args, folder, *fake, real)
    teardown()


def worker(rank: int, world: int, args, ui: UI) -> tuple[dict, dict, float]:
    fake = dist.get_backend() == "fake"
    size = args.size

    # Step 2: Build the mesh, outside FakeTensorMode
    # The mesh holds real tensors (its ranks' numbers) and makes real process groups: build it
    # before any fake tensor exists. Rows of the mesh are tp groups, columns dp groups.
    ui.step(2, "Build the mesh, outside FakeTensorMode")
    mesh = dist.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    ui.print(f"mesh {tuple(mesh.shape)} ('dp', 'tp'); rank {rank} is at {tuple(mesh.get_coordinate())}, "
             f"its dp group has {mesh['dp'].size()} ranks, its tp group {mesh['tp'].size()}")

    # Step 3: Build the model on the meta device, split each block across tp, shard across dp
    # The meta device: shapes, no storage, no Python per tensor. Lesson 19's plan and
    # fully_shard, unchanged; FSDP2 cuts each parameter into dp chunks here, where it is cheap.
    ui.step(3, "Build the model on the meta device, split each block across tp, shard across dp")
    with torch.device("meta"):
        model = fake_cluster.make_model(size)
    n_params = sum(p.numel() for p in model.parameters())
    plan = {f"blocks.*.{name}": tp.ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    plan |= {f"blocks.*.{name}": tp.RowwiseParallel() for name in ("attn.proj", "mlp.proj")}
    # q, k, v share one input: one DTensor at the attention, so backward all-reduces it once
    plan["blocks.*.attn"] = tp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False)
    if args.vocab_parallel:  # lesson 19 leaves these two whole: the largest tensors of the model
        plan["tok_emb"] = tp.RowwiseParallel(input_layouts=Replicate())  # a row per token; all-reduce the output
        plan["head"] = tp.ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)  # logits split by vocabulary
    tp.parallelize_module(model, mesh["tp"], plan)
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"])  # ZeRO-3 across dp: each block, then the root
    ui.print(f"Transformer {args.model}: {size.blocks} blocks, width {size.dim}, {size.heads} heads, "
             f"vocabulary {size.vocab}, {size.seq} tokens; {n_params:,} parameters")

    # Step 4: Give this rank's shards fake storage
    # Inside FakeTensorMode every new tensor is fake: to_empty swaps each meta shard for a fake
    # CPU one of the same shape. With --real the same lines make real storage.
    ui.step(4, "Give this rank's shards fake storage")
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model.to_empty(device="cpu")
        torch.manual_seed(args.seed)
        for p in model.parameters():
            torch.nn.init.normal_(p.to_local(), std=0.02)  # values matter only to the real run
        optimizer = torch.optim.AdamW(model.parameters(), lr=T.LR, eps=T.EPS)
        local = next(model.parameters()).to_local()
        ui.print(f"tok_emb.weight {tuple(next(model.parameters()).shape)} -> this rank's shard "
                 f"{tuple(local.shape)}, a {type(local).__name__}")

        # Step 5: Train one step, recording every collective and the peak
        # Lesson 19's loop, one optimizer step of M micro-batches. CommLog, the package's one
        # collective counter, sees FSDP2's c10d calls and DTensor's functional ones alike.
        ui.step(5, "Train one step, recording every collective and the peak")
        log, timer = CommLog(), Timer()
        # torch's FSDPMemTracker for the peak: under fake tensors only with FSDP2 alone (Step 7
        # shows why); it refuses micro-batches. CommDebugMode beside CommLog: Step 7.
        peak_wanted = args.microbatches == 1 and (args.tp == 1 or args.real)
        tracker = fake_cluster.Trackers(model, optimizer, memory=peak_wanted, comm=args.real)
        x, y = fake_cluster.tokens(size, mesh.get_local_rank("dp"), args.seed)  # a tp group shares them
        # loss_parallel: cross-entropy on logits split by vocabulary, forward and backward
        with log.recording(), tracker, tp.loss_parallel() if args.vocab_parallel else contextlib.nullcontext():
            for _ in range(args.microbatches):
                loss = T.loss_fn(model(x), y) / args.microbatches
                loss.backward()
            optimizer.step()
        held, peak = fake_cluster.held_bytes(model, optimizer), tracker.peak()
        whole = fake_cluster.whole_across_tp(model)
    ui.print(f"one step of {args.microbatches} micro-batch(es) in {timer.seconds:.1f}s; the loss is a "
             f"{type(loss).__name__}" + (": a shape, no value" if fake else f" = {loss.item():.4f}"))
    ui.print(cluster_report.peak_line(peak, args, fake))

    # Step 6: Count the bytes this rank holds and sends, beside lesson 19's planner
    # Held: from this rank's local shards. Sent: Step 5's collectives sorted by the mesh
    # dimension whose group carried them. Beside lesson 19's formulas for the same job, given
    # every parameter's shape: FSDP2 pads each tensor's rows up to a multiple of dp.
    ui.step(6, "Count the bytes this rank holds and sends, beside lesson 19's planner")
    per_rank = cluster_report.measure(log, mesh, held, whole, peak, tracker.counts())
    ui.table(f"Rank {rank}'s collectives in one step", ["dimension", *cluster_report.KINDS],
             [[d, *(v[k] for k in cluster_report.KINDS)] for d, v in per_rank["collectives_by_dim"].items()])
    plan = cluster_report.planner_keys(size, args.dp, args.tp, args.microbatches, args.vocab_parallel)  # with the shapes, and without
    per_rank["seconds"], per_rank["loss"] = timer.seconds, None if fake else loss.item()
    return per_rank, plan, cluster_report.beside_planner(ui, per_rank, plan, args, n_params, bool(peak) and args.tp == 1)


def finish(ui: UI, args, folder: Path, fake: dict, plan: dict, worst: float, real: dict | None = None) -> None:

    # Step 7: Run the same code on real gloo ranks, compare, save the results
    # --real only: W real processes ran worker() on gloo. Rank 0's counts and bytes against the
    # fake run's: the fake group is trusted as far as they agree. final.pt holds no weights.
    ui.step(7, "Run the same code on real gloo ranks, compare, save the results")
    same, peak_gap = cluster_report.beside_fake(ui, real, fake, args.tp) if real else (None, None)
    ui.print("no real ranks (add --real with --model tiny to compare)" if real is None else
             f"real gloo ranks and the fake group agree on every count and byte: [bold]{same}[/bold]")
    save_results(folder, {}, make_metrics(
        lesson="23", world_size=args.world_size, mesh_shape=[args.dp, args.tp], backend="fake",
        device="cpu (fake tensors)", losses=[], final_accuracy=None, wall_seconds=fake["seconds"],
        samples=args.microbatches * args.dp, model=args.model, parameters=fake_cluster.count_parameters(args.size),
        microbatches=args.microbatches, vocab_parallel=args.vocab_parallel, per_rank=fake, planner=plan,
        max_relative_difference=worst, peak_memory_bytes=fake["peak_bytes"].get("total") if args.tp == 1 else None,
        real=real, fake_equals_real=same, peak_fake_vs_real=peak_gap, torch_version=torch.__version__, checked_on=fake_cluster.CHECKED_ON))
    ui.print(f"wrote {shown(folder / 'metrics.json')} (final.pt: empty, a fake run has no weights)")


if __name__ == "__main__":
    run(main)
