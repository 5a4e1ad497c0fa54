"""Lesson 03: nn.DataParallel, one process driving several devices with threads

Parent: lesson 01 (lessons/01_single_device.py)

New since lesson 01: several devices, one changed line in the loop (`dp(x)`), and the five
stages behind it: scatter, replicate, parallel forward, gather, backward's sum. Without 2 GPUs
they run by hand on simulated CPU devices (lessons/03_data_parallel/simulated_dp.py; load: lessons/03_data_parallel/dp_load.py).

Run:
    make lesson-03
    make lesson-03 ARGS="--devices 4"
    .venv/bin/python lessons/03_data_parallel.py --device cpu --devices 3 --out runs/my-try
    .venv/bin/python lessons/03_data_parallel.py --device cuda --devices 2   # 2+ GPUs

Doc: docs/03_data_parallel.md
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 03_data_parallel/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dp_load import measure_load
from simulated_dp import SimulatedDataParallel, choose_devices, replica_grads, show_one_batch, stages
from common import recipe
from common.cli import lesson_parser, run
from common.device import pick_device
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI, Timer


def main() -> None:
    parser = lesson_parser(__doc__)
    parser.add_argument("--devices", type=int, default=2, help="how many devices share "
                        "each batch (GPUs if there are enough, else simulated CPU devices), 2 to 8")
    args = parser.parse_args()
    folder = claim_out(out_dir("03", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title("Lesson 03: nn.DataParallel")

    # Step 1: Choose the devices
    # auto means "cuda if this machine has a working GPU, else cpu". Everything the model
    # touches lives on device 0 or its copies; without 2+ GPUs we simulate the devices.
    ui.step(1, "Choose the devices")
    device = pick_device(args.device)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")
    device, real, names = choose_devices(args, device, ui)  # device 0: cuda:0 or cpu

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
    # The original stays on device 0: the optimizer updates it, every forward copies it.
    dp = (nn.DataParallel if real else SimulatedDataParallel)(model, device_ids=list(range(args.devices)))

    # Step 4: Train
    # The classic loop: forward, loss, zero the old gradients, backward, optimizer step.
    # One change from lesson 01: `dp(x)` runs the forward on every device (Step 7 opens it).
    ui.step(4, "Train")
    torch.set_num_threads(1 if not real else torch.get_num_threads())  # one core per simulated device
    losses: list[float] = []
    timer = Timer()
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    with ui.progress(steps, "training") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new order every epoch; lesson 12 shows what happens without
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(dp(x), y)
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

    # Device 0 does more than the others: measured on a copy, stage by stage (lessons/03_data_parallel/dp_load.py).
    load = measure_load(dp, optimizer, next(iter(loader)), names, ui)

    # Step 6: Save the results
    # Weights are copied to the CPU before saving, so the file loads on a machine without
    # a GPU. Every later lesson compares its own final.pt with this one.
    ui.step(6, "Save the results")
    diff = None  # the reference on a real data set takes as long as this lesson: skip it
    if data.name == "synthetic":  # each step computed lesson 01's gradient, up to float rounding
        diff = max_abs_diff(plain_state_dict(model), recipe.train_reference(args.seed, args.epochs, data))
        ui.print(f"max |w_03 - w_01| = {diff:.1e} (lesson 01's loop, same seed and epochs)")
    samples = args.epochs * len(data.train)
    save_results(folder, plain_state_dict(model), make_metrics(
        lesson="03", world_size=1, backend="none", device=str(device), losses=losses,
        final_accuracy=final_accuracy, wall_seconds=wall, samples=samples,
        epochs=args.epochs, seed=args.seed, dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
        devices=args.devices, simulated=not real, device_names=names, max_abs_diff_vs_01=diff, **load))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')} "
             f"({samples / wall:,.0f} samples/s over {wall:.2f}s)")

    # Step 7: Follow one batch through the five stages
    # What `dp(x)` and backward did at every step, one stage at a time, then two checks.
    ui.step(7, "Follow one batch through the five stages")
    scatter, replicate, parallel_apply, gather = stages(dp)
    x, y = next(iter(loader))
    chunks = scatter(x)                         # 1: x split along dim 0, one chunk per device
    replicas = replicate(model)[:len(chunks)]   # 2: copies of the weights, autograd-connected
    outputs = parallel_apply(replicas, chunks)  # 3: one thread per replica
    out = gather(outputs)                       # 4: the outputs concatenated on device 0
    loss = F.cross_entropy(out, y.to(device))   # 5: the loss of the whole batch, on device 0
    caught = replica_grads(model, replicas)     # old gradients cleared, each replica's caught
    loss.backward()                             # each replica's gradient flows back and adds up
    show_one_batch(ui, names, model, x, y, chunks, replicas, outputs, out, loss, caught)

if __name__ == "__main__":
    run(main)
