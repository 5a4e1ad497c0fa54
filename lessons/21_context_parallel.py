"""Lesson 21: context parallel, ring attention by hand.

Parent: lesson 13 (lessons/13_transformer_memory.py)

New since lesson 13: N ranks each hold 1/N of every sequence and the whole model. Keys and
values travel around a ring of ranks while each rank computes on the block it holds; partial
results merge by the log-sum-exp rule (online softmax); backward, by hand, sends their
gradients around too (lessons/21_context_parallel/). Causal masking loads the last rank most;
the balanced layout evens it out. Each rank saves 1/N of lesson 13's activations for backward,
the reason context parallel exists, and it ends with lesson 13's weights.

Run:
    make lesson-21
    make lesson-21 ARGS="--world-size 4 --layout balanced"
    .venv/bin/python lessons/21_context_parallel.py --world-size 4 --layout balanced

Doc: docs/21_context_parallel.md
"""
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 21_context_parallel/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist

import ring_attention
import ring_measure
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer

LAYOUTS = ("contiguous", "balanced")


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--layout", choices=LAYOUTS, default="contiguous",
                        help="which 2 of the 2N chunks of a sequence each rank holds while training")
    args = parser.parse_args()  # each rank holds 2 chunks of S/2N tokens: N divides S/2
    T.check_world_size(args.world_size, "--world-size", divides={f"{T.SEQ // 2} tokens of half a sequence": T.SEQ // 2}, splits_batch=False)
    return args


def context_parallel_attention(attn, x, ring):
    """Lesson 13's Attention.forward on our tokens, with the ring where SDPA was."""
    B, L, _ = x.shape
    q, k, v = (lin(x).view(B, L, -1, T.HEAD_DIM).transpose(1, 2) for lin in (attn.q, attn.k, attn.v))
    y = ring_attention.RingAttention.apply(q, k, v, ring)  # (B, heads, L, HEAD_DIM): our queries, every key
    return attn.proj(y.transpose(1, 2).reshape(B, L, -1))


def forward_context_parallel(model, x, ring):
    """model(x) for our tokens of every sequence: their places in the whole sequence pick the
    position embeddings (with the balanced layout they are not 0..L-1), then the blocks."""
    x = model.tok_emb(x) + model.pos_emb(ring.mine.to(x.device))
    for block in model.blocks:
        x = block(x)
    return model.head(model.norm(x))


def main() -> None:
    args = parse_args()  # a world size that does not split the sequence stops here, one line
    claim_out(out_dir("21", args.out))  # checked now, not after training; ours alone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, *plan_device(args.device, args.world_size)), args.world_size)


def worker(rank: int, world: int, args, kind: str, note: str | None) -> None:
    ui = UI(rank, world, step_mode=args.step)
    ui.title(f"Lesson 21: context parallel, ring attention by hand, on {world} processes" + (f" ({note})" if note else ""))

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

    # Step 2: Cut every sequence into 2N chunks, two per rank
    # Lesson 13's batches: every rank reads all 48 rows but keeps only its tokens of each.
    # Contiguous: rank r holds chunks 2r and 2r+1. Balanced: chunks r and 2N-1-r.
    ui.step(2, "Cut every sequence into 2N chunks, two per rank")
    x, y = T.batch(0, args.seed)
    ui.print(f"{T.VOCAB} tokens; one global batch = {tuple(x.shape)} inputs and "
             f"{tuple(y.shape)} targets (the inputs shifted by one)")
    rings = {layout: ring_attention.Ring(layout, rank, world, T.SEQ) for layout in LAYOUTS}
    ring_measure.show_layouts(rings, world, ui)  # which positions each rank holds, in each layout
    floor = T.loss_floor()

    # Step 3: Check ring attention against attention on the whole sequence
    # Random q, k, v; F.scaled_dot_product_attention on the whole sequence is the answer.
    ui.step(3, "Check ring attention against attention on the whole sequence")
    checked = ring_measure.check_against_sdpa(rings, args.seed, device, ui)  # max |difference|: output, dq, dk, dv

    # Step 4: Count each rank's attention work in both layouts
    # A tile is one chunk of queries against one chunk of keys. Under the causal mask a tile
    # wholly in the future is skipped: contiguous, rank r computes 4r+3; balanced, 2N+1 each.
    ui.step(4, "Count each rank's attention work in both layouts")
    work = ring_measure.show_work(rings, world, ui)  # the tiles of Step 3's forward, per rank

    # Step 5: Build the model and give its attention the ring
    # Every rank builds lesson 13's whole model (same seed); only the attention changes.
    ui.step(5, "Build the model and give its attention the ring")
    ring = ring_attention.Ring(args.layout, rank, world, T.SEQ)
    model = T.make_model(args.seed).to(device)
    for block in model.blocks:
        block.attn.forward = functools.partial(context_parallel_attention, block.attn, ring=ring)
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters, on every rank; training layout: [bold]{args.layout}[/bold]")

    # Step 6: Train on our tokens, averaging the gradients over the ring
    # Lesson 13's loop on our tokens of every sequence; after backward, the gradients' mean.
    ui.step(6, "Train on our tokens, averaging the gradients over the ring")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            x, y = x[:, ring.mine].to(device), y[:, ring.mine].to(device)  # our tokens of each row
            loss = T.loss_fn(forward_context_parallel(model, x, ring), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ring_attention.average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} (rank 0's tokens) | "
                         f"{timer.rate((step + 1) * x.numel() * world):>9,.0f} tokens/s")
    wall = timer.seconds
    sent = dict(ring.sent)  # the training's bytes (evaluation below sends more)
    dist.all_reduce(every := torch.tensor(losses, device=device), op=dist.ReduceOp.AVG)
    losses = every.tolist()  # the mean of the ranks' losses is the whole batch's loss
    final_state = plain_state_dict(model)

    # Step 7: Evaluate against the floor
    # Eight batches no step trained on, through the ring; the mean of the ranks' losses.
    ui.step(7, "Evaluate against the floor")
    held_out, accuracy = T.mean_over_ranks(T.evaluate(lambda x: forward_context_parallel(model, x, ring),
                                                      args.steps, args.seed, device, positions=ring.mine))
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}; "
             f"held-out batches {held_out:.4f}")
    ui.print(f"held-out loss is {T.floor_gap(held_out)}; next-token accuracy {accuracy:.1%}")

    # Step 8: Count the bytes each rank sends and the activations it saves
    # Per layer and step, beside the formulas; a block is our keys (or values): B x S/N x D floats.
    # Then why CP pays: a rank saves for backward only its tokens' activations, every layer's.
    ui.step(8, "Count the bytes each rank sends and the activations it saves")
    counted = ring_measure.show_bytes(ring, sent, args.steps, world, ui)
    forward = functools.partial(forward_context_parallel, model, ring=ring)
    saved = ring_measure.show_activations(model, forward, ring, args.seed, device, ui)
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return

    # Step 9: Compare with lesson 13, save the results
    # The floor: lesson 13 summing its batch in N chunks, float rounding alone.
    ui.step(9, "Compare with lesson 13, save the results")
    compared = T.compare_with_lesson_13(final_state, args.seed, args.steps, chunks=world)
    ui.print(f"same weights as lesson 13? {T.weights_gap(compared)}")
    folder = out_dir("21", args.out)
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="21", world_size=world, backend=backend_for(device), device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, layout=args.layout, **checked, work_per_rank=work, **counted, **saved,
        **compared))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
