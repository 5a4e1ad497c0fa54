"""Lesson 13: a transformer on one device, and where its memory goes.

New here (it opens Part 2, so it has no parent): the Part 2 recipe, a small decoder-only
transformer trained with AdamW on token sequences from a Markov chain whose best possible
loss is known (common/transformer.py). This run is the baseline: lessons 14-20 train the
same model in parallel and must end with these weights. Then we count the memory, because
that is why anyone shards a model: parameters, gradients and AdamW state beside the formula
(4 + 4 + 8 bytes per parameter), the peak of one training step beside them (torch's
MemTracker), the activations autograd saves for backward, and two ways to shrink those:
activation checkpointing per block and bf16 autocast.

Run:
    make lesson-13
    make lesson-13 ARGS="--steps 200"
    .venv/bin/python lessons/13_transformer_memory.py --device cpu --out runs/my-try

Doc: docs/13_transformer_memory.md
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
from torch.utils.checkpoint import checkpoint

from apparatus.memory import SavedTensors, StepPeak, formula_bytes, mib, report_peak, seconds, state_bytes
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import pick_device
from apparatus.results import claim_out, make_metrics, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


def parse_args():
    parser = lesson_parser(__doc__, recipe=False)
    parser.add_argument("--steps", type=positive_int, default=T.STEPS,
                        help="optimizer steps (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    return parser.parse_args()


def forward_checkpointed(model, x):
    """model(x), except that each block keeps only its input for backward: autograd
    recomputes the block's forward during backward to get the rest back."""
    x = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1], device=x.device))
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return model.head(model.norm(x))


def main() -> None:
    args = parse_args()
    folder = claim_out(out_dir("13", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title("Lesson 13: a transformer on one device, and where its memory goes")

    # Step 1: Choose the device
    # One thread on the CPU: bitwise reproducible (the reference is computed the same way),
    # and in the next lessons several ranks share the cores anyway.
    ui.step(1, "Choose the device")
    device = pick_device(args.device)
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
    optimizer = T.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"Transformer: {T.N_BLOCKS} blocks, width {T.DIM}, {T.N_HEADS} heads, "
             f"{n_params:,} parameters; AdamW lr={T.LR} eps={T.EPS}")

    # Step 4: Train
    # The same loop as lesson 01, with a new batch every step instead of epochs.
    # torch's MemTracker follows the last step (apparatus/memory.py): its peak is in Step 6.
    ui.step(4, "Train")
    losses: list[float] = []
    timer = Timer()
    log_every = max(1, args.steps // 5)
    peak = StepPeak(model, optimizer, args.steps - 1)  # slows the ops it sees: one step only
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            peak.at(step)
            x, y = T.batch(step, args.seed)
            x, y = x.to(device), y.to(device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.advance()
            if (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>4}/{args.steps} | loss {loss.item():.4f} | "
                         f"{timer.rate((step + 1) * x.numel()):>9,.0f} tokens/s")
    peak.stop()  # the tracker leaves the ops alone again
    wall = timer.seconds
    final_state = plain_state_dict(model)  # what we save; the measurements below change no weight

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
    held = state_bytes(model, optimizer)
    fp32, mixed = formula_bytes(n_params), formula_bytes(n_params, mixed=True)
    ui.table(f"Bytes held for {n_params:,} parameters", ["", "measured", "fp32 formula",
             "per parameter", "mixed precision (ZeRO paper)"],
             [[k, f"{held[k]:,}", f"{fp32[k]:,}", held[k] // n_params, f"{mixed[k]:,}"]
              for k in held] + [["total", f"{sum(held.values()):,}", f"{sum(fp32.values()):,}",
                                 sum(held.values()) // n_params, f"{sum(mixed.values()):,}"]])
    # At rest is between steps; inside one, the activations and temporaries come on top.
    peaks = report_peak(ui, peak, sum(held.values()))

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
             f"{ckpt_losses == losses[:k]}")
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
    # Every Part 2 lesson compares its final.pt with this one (within 1e-3).
    ui.step(10, "Save the results")
    samples = args.steps * T.GLOBAL_BATCH
    save_results(folder, final_state, make_metrics(
        lesson="13", world_size=1, backend="none", device=str(device), losses=losses,
        final_accuracy=accuracy, wall_seconds=wall, samples=samples, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, held_out_loss=held_out,
        loss_floor=floor, memory_bytes={**held, "activations": plain.bytes},
        activations_checkpointed_bytes=ckpt.bytes, activations_bf16_bytes=bf16.bytes,
        checkpointed_losses=ckpt_losses, loss_bf16=loss_bf16.item(),
        seconds_forward_backward={"plain": t_plain, "checkpointed": t_ckpt}, **peaks))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} sequences/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
