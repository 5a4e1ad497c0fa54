"""Lesson 01: one device, the training loop every later lesson is measured against.

New here: everything. `.to(device)`, the loop, evaluation and saving are written out; the
data, model and sample order are the recipe in common/recipe.py (Steps 2-3 send you there).
Every later lesson must end with the *same weights* as this one: that is how we prove it.

Run:
    make lesson-01
    make lesson-01 ARGS="--epochs 5"
    .venv/bin/python lessons/01_single_device.py --device cpu --epochs 3 --out runs/my-try

Doc: docs/01_single_device.md
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import recipe
from common.cli import lesson_parser, run
from common.device import pick_device
from apparatus.results import claim_out, make_metrics, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


def main() -> None:
    args = lesson_parser(__doc__).parse_args()
    folder = claim_out(out_dir("01", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title("Lesson 01: training on one device")

    # Step 1: Choose the device
    # auto means "cuda if this machine has a working GPU, else cpu". Everything the model
    # touches must live on this one device: its weights and every batch we feed it.
    ui.step(1, "Choose the device")
    device = pick_device(args.device)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Make the data
    # The recipe's data set (common/recipe.py: synthetic_data, EpochShuffle) is made
    # in-process: 3072 training and 1024 test samples, 16 features, 4 classes. The sampler
    # fixes the order of every epoch from (seed, epoch) alone, as DistributedSampler will
    # in lesson 05.
    ui.step(2, "Make the data")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = recipe.EpochShuffle(len(data.train), seed=args.seed)
    loader = DataLoader(data.train, batch_size=recipe.GLOBAL_BATCH, sampler=sampler)
    x0, y0 = data.train[0]
    ui.print(f"{data.name}: {len(data.train)} training samples, {len(data.test)} test samples; "
             f"one sample is a tensor of shape {tuple(x0.shape)} with label {int(y0)}")
    ui.print(f"batch size {recipe.GLOBAL_BATCH} -> {len(loader)} optimizer steps per epoch")

    # Step 3: Build the model and move it to the device
    # The model is recipe.MLP (common/recipe.py: three Linear layers with ReLU). Seeding
    # right before building it makes the initial weights a function of --seed only.
    # `.to(device)` moves every parameter and buffer (lesson 02 shows how), and the
    # optimizer must be built from the parameters *after* they have been moved.
    ui.step(3, "Build the model and move it to the device")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    optimizer = recipe.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"{model.__class__.__name__}: {n_params:,} parameters on "
             f"{next(model.parameters()).device}; SGD lr={recipe.LR} momentum={recipe.MOMENTUM}")
    ui.print(f"accuracy before training: {recipe.accuracy(model, data.test, device):.1%} "
             f"(chance is {1 / data.classes:.0%})")

    # Step 4: Train
    # The classic loop: forward, loss, zero the old gradients, backward, optimizer step.
    # Batches come from the CPU-side DataLoader and are moved to the device one by one.
    ui.step(4, "Train")
    losses: list[float] = []
    timer = Timer()
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    with ui.progress(steps, "training") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new order every epoch; lesson 12 shows what happens without
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())  # .item() waits for the device: fine at this size
                bar.advance()
                if len(losses) % log_every == 0:
                    ui.log(epoch + 1, len(losses), steps, loss.item(),
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 5: Evaluate
    # eval() + no_grad(): no dropout/BatchNorm here, but it is the habit that matters.
    ui.step(5, "Evaluate")
    final_accuracy = recipe.accuracy(model, data.test, device)
    ui.print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f}")
    ui.print(f"test accuracy: [bold green]{final_accuracy:.1%}[/bold green] "
             f"(chance is {1 / data.classes:.0%})")

    # Step 6: Save the results
    # Weights are copied to the CPU before saving, so the file loads on a machine without
    # a GPU. Every later lesson compares its own final.pt with this one.
    ui.step(6, "Save the results")
    samples = args.epochs * len(data.train)
    save_results(folder, plain_state_dict(model), make_metrics(
        lesson="01", world_size=1, backend="none", device=str(device), losses=losses,
        final_accuracy=final_accuracy, wall_seconds=wall, samples=samples,
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} samples/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
