"""Lesson 04: model parallel, the layers of one model split across two devices

Parent: lesson 01 (lessons/01_single_device.py)
New since lesson 01: the *model* is split across two devices (`SplitMLP`: fc1, fc2 | head),
not the batch; the loop stays lesson 01's. Then why naive model parallel leaves one device
idle at a time, and how micro-batches (GPipe's schedule) fill the gaps (lessons/04_model_parallel/micro_batches.py).

Run:
    make lesson-04
    make lesson-04 ARGS="--micro-batches 8"
    .venv/bin/python lessons/04_model_parallel.py --device cpu --pipeline-batch 96

Doc: docs/04_model_parallel.md
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 04_model_parallel/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from micro_batches import SPLIT, check_split, show_timelines, time_stages, two_devices
from common import recipe
from common.cli import lesson_parser, run
from common.device import pick_device
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


class SplitMLP(torch.nn.Module):
    """Lesson 01's MLP, stage 0 (fc1, fc2) on dev0, stage 1 (head) on dev1; the same keys."""

    def __init__(self, mlp: torch.nn.Module, dev0: torch.device, dev1: torch.device):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.fc1, self.fc2, self.head = mlp.fc1.to(dev0), mlp.fc2.to(dev0), mlp.head.to(dev1)

    def stage0(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1).to(self.dev0)))))

    def stage1(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h.to(self.dev1))  # the activation crosses devices here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(x))  # the same operations as MLP.forward, in order


def main() -> None:
    parser = lesson_parser(__doc__)
    parser.add_argument("--micro-batches", type=int, default=4, help="per batch when pipelining (1 = naive), 1-16")
    parser.add_argument("--pipeline-batch", type=int, default=4096, help="rows in the batch that times the stages")
    parser.add_argument("--repeats", type=int, default=10, help="times each task is timed (the fastest counts)")
    args = parser.parse_args()
    folder = claim_out(out_dir("04", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title("Lesson 04: model parallel")

    # Step 1: Choose the device
    # auto means "cuda if this machine has a working GPU, else cpu". Everything the model
    # touches lives on stage 0's device or stage 1's: cuda:0 and cuda:1, or one device for both.
    ui.step(1, "Choose the device")
    device = pick_device(args.device)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")
    dev0, device = two_devices(args, device, ui)  # `device` is now stage 1's: the output's

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
    model = SplitMLP(recipe.make_model(args.seed, data.in_features, data.classes), dev0, device)
    optimizer = recipe.make_optimizer(model)
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"{model.__class__.__name__}: {n_params:,} parameters on "
             f"{next(model.parameters()).device}; SGD lr={recipe.LR} momentum={recipe.MOMENTUM}")
    check = check_split(model, args.seed, data, ui)  # each stage's share; same outputs and grads
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

    # Step 6: Time each stage on micro-batches
    # Micro-batches must give the whole batch's gradient; then every stage's task is timed.
    ui.step(6, "Time each stage on micro-batches")
    measured, check["micro_batch_grad_max_diff"] = time_stages(model, data, args, ui)

    # Step 7: Naive versus pipelined timeline
    # Replayed on two devices at once: stage 0 starts micro-batch k+1 while stage 1 works on k.
    ui.step(7, "Naive versus pipelined timeline")
    pipeline = show_timelines(measured, model, args, ui)

    # Step 8: Save the results
    # Weights are copied to the CPU before saving, so the file loads on a machine without
    # a GPU. Every later lesson compares its own final.pt with this one.
    ui.step(8, "Save the results")
    diff = None  # the same operations in the same order: lesson 01's weights (exactly, on the CPU)
    if data.name == "synthetic":
        diff = max_abs_diff(plain_state_dict(model), recipe.train_reference(args.seed, args.epochs, data))
        ui.print(f"max |w_04 - w_01| = {diff:.1e} (lesson 01's loop, same seed and epochs)")
    samples = args.epochs * len(data.train)
    save_results(folder, plain_state_dict(model), make_metrics(
        lesson="04", world_size=1, backend="none", device=str(device), losses=losses,
        final_accuracy=final_accuracy, wall_seconds=wall, samples=samples,
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
        stage_devices=[str(dev0), str(device)], split=SPLIT, max_abs_diff_vs_01=diff,
        check=check, pipeline=pipeline))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} samples/s over {wall:.2f}s)")


if __name__ == "__main__":
    run(main)
