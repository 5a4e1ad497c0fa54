"""Lesson 19: 2-D parallelism: FSDP2 across one mesh dimension, tensor parallel across the other.

Parent: lesson 15 (lessons/15_zero_fsdp.py)

New since lesson 15: the ranks form a 2-D DeviceMesh ("dp", "tp"), D x T. Each block is
split across tp (lesson 17), then fully_shard shards what each rank holds across dp. The
batch is split across dp only. Measured: who talks to whom, the bytes each dimension sends
beside the planner's formulas (lessons/19_two_d_mesh/planner.py: --plan 7e9 prints a real job's table).

Kept from lesson 13 (its steps, now on every rank): the Part 2 recipe, a small decoder-only
transformer trained with AdamW on token sequences from a Markov chain whose best possible
loss is known (common/transformer.py). This run is the baseline: lessons 14-20 train the
same model in parallel and must end with these weights. Then we count the memory, because
that is why anyone shards a model: parameters, gradients and AdamW state beside the formula
(4 + 4 + 8 bytes per parameter), the activations autograd saves for backward, and two ways to
shrink those: activation checkpointing per block and bf16 autocast.

Run:
    make lesson-19
    make lesson-19 ARGS="--dp 4 --tp 1"
    .venv/bin/python lessons/19_two_d_mesh.py --dp 1 --tp 4
    .venv/bin/python lessons/19_two_d_mesh.py --plan 7e9 --gpus 64 --gpu-gb 80

Doc: docs/19_two_d_mesh.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 19_two_d_mesh/

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, parallel as tp
from torch.utils.checkpoint import checkpoint

from apparatus.memory import SavedTensors, formula_bytes, mib, seconds
from apparatus import sharding
import planner
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--dp", type=positive_int, default=2, help="ranks across the data (FSDP2)")
    parser.add_argument("--tp", type=positive_int, default=2, help="ranks across each block (tensor parallel)")
    planner.add_plan_flags(parser)  # --plan 7e9 --gpus 8 --gpu-gb 80 ...
    return planner.check_flags(parser.parse_args())


def forward_checkpointed(model, x):
    """model(x), except that each block keeps only its input for backward: autograd
    recomputes the block's forward during backward to get the rest back."""
    x = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1], device=x.device))
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return model.head(model.norm(x))


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    if args.plan is not None:  # the planner alone: formulas, no processes (lessons/19_two_d_mesh/planner.py)
        return planner.show_plan(ui, args)
    ui.title(f"Lesson 19: a {args.dp} x {args.tp} mesh (dp x tp) on {args.world_size} ranks")

    # Step 1: Choose the device
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(1, "Choose the device")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(planner.device_note(note) or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)),
                      PYTHONWARNINGS="ignore:FSDP2-wrapped module")  # our logits are a view
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


def worker(rank: int, world: int, args, kind: str) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = pick_device(kind, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env(backend_for(device), args.timeout, device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Make the data
    # Sequences from an order-2 Markov chain: the next token depends on the previous two,
    # so the model must use attention to see them. We know the chain's transition table,
    # so we can compute the best loss any model could reach: the floor.
    ui.step(2, "Make the data")
    x, y = T.batch(0, args.seed)
    ui.print(f"{T.VOCAB} tokens; one global batch = {tuple(x.shape)} inputs and "
             f"{tuple(y.shape)} targets (the inputs shifted by one)")
    for row in (0, 1):  # some pairs of tokens are almost always followed by the same token
        ui.print(f"row {row}: {x[row, :12].tolist()} ... -> targets {y[row, :12].tolist()} ...")
    floor = T.loss_floor()
    ui.print(f"loss of uniform guessing: ln {T.VOCAB} = {torch.tensor(T.VOCAB).log():.4f}; "
             f"the floor (best possible): {floor:.4f} nats/token")

    # Step 3: Build the model and move it to the device
    # Split each block across tp (lesson 17), then shard what each rank holds across dp.
    ui.step(3, "Build the model and move it to the device")
    model = T.make_model(args.seed).to(device)
    mesh = dist.init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    planner.show_mesh(ui, mesh)
    plan = {f"blocks.*.{name}": tp.ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    plan |= {f"blocks.*.{name}": tp.RowwiseParallel() for name in ("attn.proj", "mlp.proj")}
    # q, k, v share one input: one DTensor at the attention, so backward all-reduces it once
    plan["blocks.*.attn"] = tp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False)
    tp.parallelize_module(model, mesh["tp"], plan)
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"])  # ZeRO-3 across dp: each block, then the root
    sharding.show_shards(ui, model)
    train_model = model  # what the batches go through (lesson 15's DDP wrapped it)
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    ui.step(4, "Train")
    losses: list[float] = []
    timer = Timer()
    counter = planner.CountByDim(mesh)  # every collective, with the mesh dimension it used
    dp_rank = mesh.get_local_rank("dp")  # picks my rows of the batch: a tp group's ranks share them
    log_every = max(1, args.steps // 5)
    with ui.progress(args.steps, "training") as bar, counter:
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            x, y = T.shard(x, dp_rank, args.dp).to(device), T.shard(y, dp_rank, args.dp).to(device)
            loss = T.loss_fn(train_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    final_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = sharding.mean_over_ranks(losses)
    comm = planner.report_dims(ui, counter, args.steps, args.dp, args.tp)  # tp: activations, dp: weights

    # Step 5: Evaluate against the floor
    # Eight batches no step trained on. No model beats the floor on average (one batch may,
    # by luck); how close we got is the number to watch in every later lesson too.
    ui.step(5, "Evaluate against the floor")
    held_out, accuracy = 0.0, 0.0
    with torch.no_grad():
        for i in range(8):
            x, y = (t.to(device) for t in T.batch(args.steps + i, args.seed))
            logits = model(x)
            held_out += T.loss_fn(logits, y).item() / 8
            accuracy += (logits.argmax(-1) == y).float().mean().item() / 8
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 6: Count parameters, gradients and optimizer state
    # Read off the tensors themselves, beside the formula. AdamW keeps two numbers per
    # parameter (exp_avg, exp_avg_sq): the optimizer state is twice the model.
    ui.step(6, "Count parameters, gradients and optimizer state")
    held = sharding.held_bytes(model, optimizer)  # mine, from my local shards, padding included
    fp32, mixed = formula_bytes(n_params), formula_bytes(n_params, mixed=True)
    ui.table(f"Bytes held for {n_params:,} parameters", ["", "measured", "fp32 formula",
             "per parameter", "mixed precision (ZeRO paper)"],
             [[k, f"{held[k]:,}", f"{fp32[k]:,}", held[k] // n_params, f"{mixed[k]:,}"]
              for k in held] + [["total", f"{sum(held.values()):,}", f"{sum(fp32.values()):,}",
                                 sum(held.values()) // n_params, f"{sum(mixed.values()):,}"]])
    per_rank = planner.check_memory(ui, held, args.dp, args.tp)  # the planner's formula
    model = T.make_model(args.seed).to(device)  # steps 7-9 on a plain copy and my rows only:
    x, y = T.shard(x, dp_rank, args.dp), T.shard(y, dp_rank, args.dp)  # as in training

    # Step 7: Measure the activations
    # Autograd keeps some tensors of the forward pass until backward needs them. The
    # saved_tensors_hooks in apparatus/memory.py see each one as it is saved.
    ui.step(7, "Measure the activations")
    with SavedTensors(model) as plain:
        loss_plain = T.loss_fn(model(x), y)
    ui.print(f"one batch of {x.numel():,} tokens saves {mib(plain.bytes)} of activations "
             f"({plain.bytes / held['parameters']:.1f}x the parameters)")

    # Step 8: Activation checkpointing
    # Keep only each block's input; recompute the rest in backward. Same numbers, less
    # memory, one extra forward of every block per step.
    ui.step(8, "Activation checkpointing")
    with SavedTensors(model) as ckpt:
        loss_ckpt = T.loss_fn(forward_checkpointed(model, x), y)
    ui.print(f"saved for backward: {mib(plain.bytes)} plain -> {mib(ckpt.bytes)} checkpointed; "
             f"loss {loss_plain.item():.6f} vs {loss_ckpt.item():.6f}")
    retrain = T.make_model(args.seed).to(device)  # a fresh run: do the losses stay the same?
    retrain_opt = T.make_optimizer(retrain)
    k = min(10, args.steps)
    ckpt_losses = []
    for step in range(k):
        xb, yb = (t.to(device) for t in T.batch(step, args.seed))
        loss = T.loss_fn(forward_checkpointed(retrain, xb), yb)
        retrain_opt.zero_grad(set_to_none=True)
        loss.backward()
        retrain_opt.step()
        ckpt_losses.append(loss.item())
    ui.print(f"first {k} training losses identical with and without checkpointing: "
             f"{ckpt_losses == T.train_reference(args.seed, k)['losses'].tolist()}")
    t_plain = seconds(lambda: T.loss_fn(model(x), y).backward())
    t_ckpt = seconds(lambda: T.loss_fn(forward_checkpointed(model, x), y).backward())
    ui.print(f"forward + backward: {t_plain * 1e3:.1f} ms plain, {t_ckpt * 1e3:.1f} ms "
             f"checkpointed ({t_ckpt / t_plain - 1:+.0%}: the recomputed forward)")

    # Step 9: bf16 autocast
    # Matmuls run in bfloat16 (2 bytes) while LayerNorm and the loss stay in float32.
    ui.step(9, "bf16 autocast")
    with SavedTensors(model) as bf16, torch.autocast(device.type, dtype=torch.bfloat16):
        loss_bf16 = T.loss_fn(model(x), y)
    ui.print(f"activations: {mib(plain.bytes)} fp32 -> {mib(bf16.bytes)} under bf16 autocast "
             f"(+ {mib(bf16.weight_copy_bytes)} of bf16 weight copies autocast saved too)")
    ui.print(f"loss: {loss_plain.item():.6f} fp32, {loss_bf16.item():.6f} bf16 "
             f"(difference {abs(loss_bf16.item() - loss_plain.item()):.1e})")

    # Step 10: Save the results
    # final_state is the full state dict gathered to rank 0's CPU: a plain model loads it.
    # Lesson 13's weights within 1e-3, beside the floor: one process in N chunks, as N ranks.
    ui.step(10, "Save the results")
    folder = out_dir("19", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    del train_model, optimizer
    if rank != 0:  # rank 0 alone writes
        return teardown()
    diff, gap = sharding.compare_with_lesson_13(ui, final_state, args.seed, args.steps, args.dp)
    save_results(folder, final_state, make_metrics(
        lesson="19", world_size=world, mesh_shape=[args.dp, args.tp], backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, memory_bytes={**held, "activations": plain.bytes},
        activations_checkpointed_bytes=ckpt.bytes, activations_bf16_bytes=bf16.bytes,
        checkpointed_losses=ckpt_losses, loss_bf16=loss_bf16.item(),
        seconds_forward_backward={"plain": t_plain, "checkpointed": t_ckpt},
        max_abs_diff_vs_single_device=diff, chunked_floor=gap, **planner.metrics(comm, per_rank)))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")
    teardown()


if __name__ == "__main__":
    run(main)
