"""Lesson 17: tensor and sequence parallel, by hand and with DTensor.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13: N ranks hold one model and read the same batch. Each block's heads and
MLP units are split as in Megatron-LM, joined by the conjugate functions f and g (--impl manual),
or by a DTensor plan (--impl dtensor). --sequence-parallel also splits the norms along the
sequence. Measured: each collective (DTensor's own too), the activations, two classic mistakes.

Run:
    make lesson-17
    make lesson-17 ARGS="--world-size 4 --impl dtensor --sequence-parallel"
    .venv/bin/python lessons/17_tensor_parallel.py --world-size 2 --sequence-parallel --device cpu

Doc: docs/17_tensor_parallel.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 17_tensor_parallel/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
from torch.distributed.tensor import Replicate, Shard, init_device_mesh, parallel as tp

import tensor_parallel
from apparatus.comm import CommLog
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--impl", choices=["manual", "dtensor"], default="manual", help="split the layers by hand (Megatron-LM) or DTensor")
    parser.add_argument("--sequence-parallel", action="store_true", help="also split norms and residuals along the sequence")
    parser.add_argument("--use-local-output", action="store_true", help="DTensor's common mistake (Step 6): attention and MLP get plain tensors, q, k, v each sum their input's gradient")
    args = parser.parse_args()
    if args.use_local_output and args.impl != "dtensor":
        parser.error("--use-local-output is a DTensor plan's setting: add --impl dtensor")
    T.check_world_size(args.world_size, "--world-size", divides={f"{T.N_HEADS} attention heads": T.N_HEADS, f"{T.SEQ} tokens": T.SEQ}, splits_batch=False)
    return args


class Comm(torch.autograd.Function):
    """y = fwd(x) in forward, and grad_x = bwd(grad_y) in backward."""
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad.contiguous()), None, None


# (forward, backward): each pair's forward is the other's backward (collectives: tensor_parallel.py)
PAIRS = {"f": (lambda x: x, tensor_parallel.all_reduce), "g": (tensor_parallel.all_reduce, lambda x: x),  # tensor parallel, and
         "f_sp": (tensor_parallel.all_gather, tensor_parallel.reduce_scatter), "g_sp": (tensor_parallel.reduce_scatter, tensor_parallel.all_gather),  # sequence
         "split": (tensor_parallel.split, tensor_parallel.all_gather), "gather": (tensor_parallel.all_gather, tensor_parallel.split)}  # parallel


def parallelize_by_hand(model, rank, world, sp):
    """Megatron-LM's split, on lesson 13's modules: same names, 1/world of each split tensor."""
    keep = lambda lin, name, dim: setattr(  # noqa: E731  our chunk of lin.<name> becomes the parameter
        lin, name, torch.nn.Parameter(getattr(lin, name).detach().chunk(world, dim)[rank].clone()))
    enter, leave = ("f_sp", "g_sp") if sp else ("f", "g")  # what enters / leaves the split layers
    for block in model.blocks:  # column-parallel: our rows, i.e. our heads and our MLP units
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
            keep(lin, "weight", 0), keep(lin, "bias", 0)
        for lin in (block.attn.proj, block.mlp.proj):  # row-parallel: the matching columns;
            keep(lin, "weight", 1)  # g sums the partial outputs, then the bias is added once
            lin.forward = lambda h, lin=lin: Comm.apply(h @ lin.weight.T, *PAIRS[leave]) + lin.bias
        for norm in (block.norm1, block.norm2):  # f: where a column-parallel layer's input enters
            norm.register_forward_hook(lambda m, args, out: Comm.apply(out, *PAIRS[enter]))
            for p in [*norm.parameters(), block.attn.proj.bias, block.mlp.proj.bias, *model.norm.parameters()]:
                p.sequence_parallel = sp  # whole on every rank, but it sees 1/world of the tokens
    if sp:  # the blocks and the last norm work on slices of the sequence; the head on all of it
        model.blocks[0].register_forward_pre_hook(lambda m, args: Comm.apply(args[0], *PAIRS["split"]))
        model.norm.register_forward_hook(lambda m, args, out: Comm.apply(out, *PAIRS["gather"]))
    return model


def parallelize_dtensor(model, rank, world, sp, local_inputs=False):
    """The same as a plan of DTensor placements (Shard(1): split along the sequence; Replicate():
    whole on every rank; PrepareModuleInput: from one to the other). DTensor makes the collectives."""
    mesh = init_device_mesh(next(model.parameters()).device.type, (world,))
    layouts = lambda a, b, local=True: tp.PrepareModuleInput(input_layouts=a, desired_input_layouts=b, use_local_output=local)  # noqa: E731
    plan = {f"blocks.*.{name}": tp.ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    plan |= {f"blocks.*.{name}": tp.RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
             for name in ("attn.proj", "mlp.proj")}  # reduce-scatter to our slice, or all-reduce
    # f: q, k, v share one DTensor input, summed once in backward (local_inputs: each its own)
    plan |= {f"blocks.*.{name}": layouts(Shard(1) if sp else Replicate(), Replicate(), local_inputs) for name in ("attn", "mlp")}
    if sp:  # norms on our slice of the sequence; the head gathers all of it first
        plan |= {"blocks.0": layouts(Replicate(), Shard(1)), "blocks.*.norm*": tp.SequenceParallel(),
                 "norm": tp.SequenceParallel(), "head": layouts(Shard(1), Replicate())}
    return tp.parallelize_module(model, mesh, plan)


def main() -> None:
    args = parse_args()
    claim_out(out_dir("17", args.out))  # checked now, not after training; ours alone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, *plan_device(args.device, args.world_size)), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 17: tensor parallel, {tensor_parallel.variant(args)}, on {world} processes" + (f" ({note})" if note else ""))

    # Step 1: Choose this rank's device and join the process group
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(1, "Choose this rank's device and join the process group")
    device = rank_device(kind, rank)  # one GPU per rank (cuda:<rank>), or the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun would set them
    init_from_env(backend_for(device), args.timeout, device)  # lesson 05's init_process_group
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Make the data
    # Lesson 13's batches (its Step 2 shows them and their floor). Every rank reads every
    # row: what tensor parallel splits is each layer, not the batch.
    ui.step(2, "Make the data")
    floor = T.loss_floor()
    ui.print(f"lesson 13's batches: {T.GLOBAL_BATCH} sequences of {T.SEQ} tokens per step, "
             f"all of them on every rank; the floor {floor:.4f} nats/token")

    # Step 3: Split each block across the ranks
    ui.step(3, "Split each block across the ranks")
    model = T.make_model(args.seed).to(device)
    split_model = parallelize_by_hand if args.impl == "manual" else lambda *a: parallelize_dtensor(*a, args.use_local_output)
    model = split_model(model, rank, world, args.sequence_parallel)  # all of it built (same seed): keep our share
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in T.make_model(args.seed).parameters())  # the whole model
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train the split model, recording every collective
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # Every rank reads the whole batch. CommLog (apparatus/comm.py) records each collective.
    ui.step(4, "Train the split model, recording every collective")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    log, logged = CommLog(modules=True), range(log_every - 1, args.steps, log_every)  # the printed steps
    with ui.progress(args.steps, "training") as bar:
        for step in tensor_parallel.recorded(range(args.steps), log, logged):  # CommLog slows every op: only these
            x, y = T.batch(step, args.seed)
            x, y = x.to(device), y.to(device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in filter(lambda p: getattr(p, "sequence_parallel", False), model.parameters()):
                torch.distributed.all_reduce(p.grad)  # by hand, our tokens' share: sum it (Step 8)
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    final_state = tensor_parallel.full_state_dict(model)  # the shards gathered, under lesson 13's names

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = T.evaluate(model, args.steps, args.seed, device)  # as lesson 13's Step 5
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Count the collectives of one training step
    ui.step(6, "Count the collectives of one training step")
    counts = tensor_parallel.report(log, len(logged), model, ui)  # forward, backward, after it (by hand), AdamW's step

    # Step 7: Measure what sequence parallel saves
    ui.step(7, "Measure what sequence parallel saves")
    saved = tensor_parallel.saved_activations(split_model, args.impl, rank, world, args, device, ui)  # for backward

    # Step 8: The sequence-parallel mistake
    ui.step(8, "The sequence-parallel mistake")  # a LayerNorm gradient from our tokens only (Step 4)
    mistake = tensor_parallel.sequence_parallel_mistake(parallelize_by_hand, rank, world, args, device, ui)
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return  # rank 0 compares and saves: the weights it gathered are everyone's

    # Step 9: Compare with lesson 13, save the results
    ui.step(9, "Compare with lesson 13, save the results")
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=world)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")
    folder = out_dir("17", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="17", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, impl=args.impl, sequence_parallel=args.sequence_parallel,
        **tensor_parallel.metrics(counts, saved, mistake), **compared))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
