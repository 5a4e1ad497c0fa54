"""Lesson 16: distributed checkpoints: every rank writes its own shard; any world size resumes.

Parent: lesson 15 (lessons/15_zero_fsdp.py)

New since lesson 15: FSDP2 only, checkpointed with torch.distributed.checkpoint (DCP): each rank
writes its own shards, nobody gathers the model. --stop-at-step K saves after step K and exits;
--resume DIR continues at any --world-size and ends with the uninterrupted run's weights. Then
async_save against save, and the checkpoint made into one torch.save file for a plain model.

Kept from lesson 13 (its steps, now on every rank): the Part 2 recipe, a small decoder-only
transformer trained with AdamW on token sequences from a Markov chain whose best possible
loss is known (common/transformer.py). This run is the baseline: lessons 14-20 train the
same model in parallel and must end with these weights. Then we count the memory, because
that is why anyone shards a model: parameters, gradients and AdamW state beside the formula
(4 + 4 + 8 bytes per parameter), the activations autograd saves for backward, and two ways to
shrink those: activation checkpointing per block and bf16 autocast.

Run:
    make lesson-16
    make lesson-16 ARGS="--stop-at-step 60 --checkpoint runs/ckpt-16"
    .venv/bin/python lessons/16_distributed_checkpoint.py --world-size 3 --resume runs/ckpt-16

Doc: docs/16_distributed_checkpoint.md
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 16_distributed_checkpoint/

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from apparatus.memory import SavedTensors, formula_bytes, mib, seconds
from apparatus import sharding
import checkpointing
from common import transformer as T
from apparatus.state_dicts import load_into
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, pick_device, plan_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--strategy", choices=("fsdp",), default="fsdp", help="FSDP2 (ZeRO-3); lesson 15 has the others")
    parser.add_argument("--stop-at-step", type=positive_int, help="save after this step, and exit")
    parser.add_argument("--checkpoint", type=Path, default=out_dir("16", None) / "checkpoint", help="DCP checkpoint folder (default: runs/lesson-16/checkpoint)")
    parser.add_argument("--resume", type=Path, help="a DCP checkpoint folder to continue from")
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                        action="store_false", help="fsdp: keep gathered weights until backward")
    return checkpointing.check(sharding.check_world_size(parser, parser.parse_args()))  # before any rank starts


def checkpoint_state(model, optimizer, step: int) -> dict:  # my shards (DTensors), and the step
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


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
    ui.title(f"Lesson 16: {args.strategy} on {args.world_size} ranks, with a distributed checkpoint")

    # Step 1: Choose the device
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(1, "Choose the device")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(note or f"{args.world_size} ranks, one GPU each")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)),
                      PYTHONWARNINGS="ignore:FSDP2-wrapped module")  # our logits are a view
    spawn(worker, args=(args.world_size, args, kind), nprocs=args.world_size)


def worker(rank: int, world: int, args, kind: str) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = pick_device(kind, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", args.timeout, device)  # async_save: CPU
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
    ui.step(3, "Build the model and move it to the device")
    model = T.make_model(args.seed).to(device)
    if args.strategy == "fsdp":  # ZeRO-3: each block one FSDP group, then the root (the rest)
        mesh = dist.init_device_mesh(device.type, (world,))
        for module in (*model.blocks, model):
            fully_shard(module, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
        sharding.show_shards(ui, model)
    optimizer = T.make_optimizer(model)
    start, end = 0, args.stop_at_step or args.steps
    if args.resume:  # each rank reads the pieces of its own shards, whatever world saved them
        state = checkpoint_state(model, optimizer, 0)  # my shards: the places to fill
        dcp.load(state, checkpoint_id=args.resume)  # in place, into those tensors
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = checkpointing.show_resumed(ui, state, optimizer)  # the step saved, AdamW's step counter
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    ui.step(4, "Train")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    with ui.progress(end - start, "training") as bar:
        for step in range(start, end):
            x, y = T.batch(step, args.seed)
            x, y = T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1 - start) * x.numel()):>9,.0f} tokens/s")
    wall = timer.seconds
    final_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = sharding.mean_over_ranks(losses)
    ref = checkpointing.show_losses(ui, losses, start, end, args.seed, args.steps, log_every)

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
    per_rank = sharding.report_bytes(ui, model, optimizer, args.strategy)
    sharded = model  # the FSDP2 model, for Steps 10-11
    model = T.make_model(args.seed).to(device)  # steps 7-9 on a plain copy and my rows only:
    x, y = T.shard(x, rank, world), T.shard(y, rank, world)  # sharding leaves activations be

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

    # Step 10: Save a distributed checkpoint
    # Each rank writes the shards it holds; apparatus/ shows what gathering would cost rank 0.
    ui.step(10, "Save a distributed checkpoint")
    folder = out_dir("16", args.out)
    timer = Timer()
    dcp.save(checkpoint_state(sharded, optimizer, end), checkpoint_id=args.checkpoint)  # every rank writes its own file
    checkpointing.show_files(ui, args.checkpoint, sharded, blocking := timer.seconds)
    if args.stop_at_step:  # interrupted on purpose: the checkpoint is all this run leaves
        return teardown()

    # Step 11: Save without stopping training
    ui.step(11, "Save without stopping training")
    timer = Timer()
    future = dcp.async_save(checkpoint_state(sharded, optimizer, end), checkpoint_id=folder / "checkpoint-async")
    ui.print(f"dcp.save blocked training {blocking:.3f}s; dcp.async_save returned a {type(future).__name__} in {timer.seconds:.3f}s")
    future.result()  # wait before the next save (and before exiting): now the files are done

    # Step 12: Save the results
    # final_state is the full state dict gathered to rank 0's CPU: a plain model loads it.
    # Lesson 13's weights within 1e-3, beside the floor: one process in N chunks, as N ranks.
    ui.step(12, "Save the results")
    samples = (end - start) * T.GLOBAL_BATCH
    del optimizer
    if rank != 0:  # rank 0 alone writes
        return teardown()
    diff, gap = sharding.compare_with_lesson_13(ui, final_state, args.seed, args.steps, world)
    # The DCP checkpoint as one torch.save file (read by one process), for a plain model:
    dcp_to_torch_save(args.checkpoint, folder / "from-dcp.pt")
    load_into(loaded := T.make_model(args.seed + 1), torch.load(folder / "from-dcp.pt", weights_only=True)["model"])
    ui.print(f"{shown(folder / 'from-dcp.pt')} in a plain model: max |w - final| = {max_abs_diff(loaded.state_dict(), final_state):.1e}")
    save_results(folder, final_state, make_metrics(
        lesson="16", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, memory_bytes={**held, "activations": plain.bytes},
        activations_checkpointed_bytes=ckpt.bytes, activations_bf16_bytes=bf16.bytes,
        checkpointed_losses=ckpt_losses, loss_bf16=loss_bf16.item(),
        seconds_forward_backward={"plain": t_plain, "checkpointed": t_ckpt},
        max_abs_diff_vs_single_device=diff, chunked_floor=gap, **per_rank, start_step=start, reference_losses=ref))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")
    teardown()


if __name__ == "__main__":
    run(main)
