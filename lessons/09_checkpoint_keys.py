"""Lesson 09: the `module.` prefix in checkpoints, and one loader for every wrapper.

Parent: lesson 05 (lessons/05_ddp_spawn.py)

New since lesson 05: saving and loading. Rank 0 saves the DDP model itself, a plain model
refuses the file (`module.fc1.weight` is not `fc1.weight`), three fixes (and why
`k.replace("module.", "")` is a bug), every wrapper's prefix and one loader for all of them
(load_into), map_location and weights_only=True (lessons/09_checkpoint_keys/checkpoint_keys.py shows these);
last, lesson 05's rule made visible: rank 0 writes, a barrier, every rank loads. Lesson 05's
start is kept, with spawn() from common/distributed.py in place of mp.spawn, and its
gradient-average check stays in lesson 05.

Run:
    make lesson-09
    make lesson-09 ARGS="--world-size 3"
    .venv/bin/python lessons/09_checkpoint_keys.py --epochs 1 --out runs/my-try

Doc: docs/09_checkpoint_keys.md
"""
import datetime
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 09_checkpoint_keys/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.markup import escape  # error texts hold [brackets] that rich would read as markup
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import checkpoint_keys as shown_keys
from common import recipe
from apparatus.state_dicts import load_into
from common.cli import lesson_parser, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import WORLD_COLUMNS, host_store, master_address, spawn, world_rows
from apparatus.results import (claim_out, make_metrics, max_abs_diff, out_dir, plain_state_dict,
                            save_results, shown)
from apparatus.ui import UI, Timer

# More ranks than this on one machine teach nothing but waiting; and each rank is a whole
# Python process with torch loaded: about 0.4 GB of memory (PSS) each, measured here.
MAX_WORLD = 16


def parse_args():
    parser = lesson_parser(__doc__, distributed=True, world_size=2)
    args = parser.parse_args()
    n = args.world_size
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD)
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 09: the module. prefix in checkpoints, on {args.world_size} processes")

    # Step 1: Start one process per rank with spawn()
    # One process per device is DDP's rule: with 2 GPUs, 2 processes each own one GPU; on a
    # CPU-only machine the processes share the cores and talk over gloo. MASTER_ADDR and
    # MASTER_PORT tell every process where the rendezvous *store* is, a small key-value
    # server they use to find each other. The parent hosts it, listening on 127.0.0.1 only
    # (a TCPStore of its own would listen on every interface), and holds the port until
    # the job ends: a second job on the same port fails at once instead of joining ours.
    ui.step(1, "Start one process per rank with spawn()")
    kind, note = plan_device(args.device, args.world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    folder = claim_out(out_dir("09", args.out))  # checked now, not after training; ours alone
    addr, port = master_address(args.master_port)  # --master-port, else $MASTER_ADDR/$MASTER_PORT
    store, port = host_store(addr, port, args.timeout)  # lives (and holds the port) until we exit
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    ui.print(f"the store listens on {addr}:{port}; next, spawn(worker, nprocs={args.world_size}) "
             f"starts the ranks and each runs worker(rank, ...)")
    ui.pause(next_step=(2, "Join the process group"))
    # spawn() does lesson 05's mp.spawn(..., join=True) job, the package's one way to start
    # ranks (common/distributed.py): each rank is forked from a server that imported torch
    # once, rank 0 gets this terminal for --step, and if one rank fails the others are
    # stopped and the job ends with one line naming it. Ctrl-C stops every rank first.
    spawn(worker, (args.world_size, args, kind, folder), args.world_size)


def worker(rank: int, world_size: int, args, kind: str, folder) -> None:
    """What every process runs. spawn() passes the rank as the first argument."""
    ui = UI(rank, world_size, step_mode=args.step)
    share_cpu(world_size)  # each rank gets its share of the cores, not all of them

    # Step 2: Join the process group
    # Each rank connects to the parent's store at MASTER_ADDR:MASTER_PORT (is_master=False:
    # a client), and init_process_group blocks until all `world_size` ranks have met there.
    # The timeout bounds that wait *and* every later collective: a rank that never comes or
    # never answers turns into an error after `timeout` instead of a frozen terminal.
    # device_id (GPUs only) tells NCCL our device now, so it builds its communicator at once
    # instead of guessing the device at the first collective.
    ui.step(2, "Join the process group")
    device = rank_device(kind, rank)  # one GPU per rank: cuda:<rank>, or the CPU
    backend = backend_for(device)     # nccl for GPUs, gloo for CPU tensors
    if device.type == "cuda":
        torch.cuda.set_device(device)  # so that NCCL and `cuda` without an index mean our GPU
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    ui.table("The world", WORLD_COLUMNS, world_rows(rank, device, backend))

    # Step 3: Split the data with DistributedSampler
    # Each rank reads a different 1/N of every epoch: positions rank, rank+N, rank+2N, ...
    # of one shuffled order. shuffle=True belongs to the *sampler* (a DataLoader with a
    # sampler must not shuffle too), and the per-rank batch is the global batch / N, so one
    # step of N ranks sees exactly the 96 samples of one step of lesson 01.
    ui.step(3, "Split the data with DistributedSampler")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    per_rank = recipe.GLOBAL_BATCH // world_size
    loader = DataLoader(data.train, batch_size=per_rank, sampler=sampler)
    ui.print(f"global batch {recipe.GLOBAL_BATCH} = {world_size} ranks x {per_rank} samples; "
             f"{len(loader)} steps per epoch on every rank")

    # Step 4: Wrap the model with DDP
    # Same seed on every rank gives the same initial weights; DDP also broadcasts rank 0's
    # weights at construction, so the copies start identical either way. device_ids is for
    # GPUs only (one device per process); on the CPU it stays None.
    # find_unused_parameters=False (the default) is right here: every parameter gets a
    # gradient every step. True would make DDP walk the autograd graph after each forward.
    ui.step(4, "Wrap the model with DDP")
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = recipe.make_optimizer(ddp_model)
    keys = list(ddp_model.state_dict())
    ui.print(f"the real model is ddp_model.module ({type(ddp_model.module).__name__}); "
             f"DDP's state_dict keys carry a prefix: {keys[:2]} ...")

    # Step 5: Train
    # The loop is lesson 01's, plus sampler.set_epoch(epoch): without it every epoch would
    # replay epoch 0's order. The loss each rank sees is its local batch's; the global
    # batch's loss is their average over ranks. We keep each step's loss on the device and
    # average them every `log_every` steps in one all-reduce: `.item()` makes the CPU wait
    # for the GPU to finish, and once per step that wait would stall the pipeline.
    ui.step(5, "Train")
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # this rank's losses since the last log, not yet synced
    steps = args.epochs * len(loader)
    log_every = max(1, len(loader) // 4)
    timer = Timer()
    with ui.progress(steps, f"training on {world_size} ranks") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                done = len(losses) + len(pending)
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()       # DDP all-reduces gradients, bucket by bucket, in here
                optimizer.step()      # identical gradients -> identical steps on every rank
                pending.append(loss.detach())
                bar.advance()
                if (len(losses) + len(pending)) % log_every == 0 or done + 1 == steps:
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)  # SUM over ranks (the default op), then divide
                    losses += (chunk / world_size).tolist()  # the one host sync per log line
                    pending = []
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 6: Save the DDP model's state_dict: a plain model refuses it
    # DDP keeps your model as its child `module`, and state_dict() names every tensor by
    # its path from the object you call it on: `module.fc1.weight`. A plain model expects
    # `fc1.weight`; load_state_dict is strict by default, refuses, and lists both sides.
    # Steps 6-9 run on rank 0 while the other ranks wait at Step 10's barrier.
    ui.step(6, "Save the DDP model's state_dict: a plain model refuses it")
    solo = dist.new_group([0])  # every rank makes it; rank 0 alone wraps models in DDP over it
    ddp_path, module_path = folder / "ddp_model.pt", folder / "model.pt"
    if rank == 0:
        torch.save(ddp_model.state_dict(), ddp_path)  # the tempting line: keys module.*
        plain = recipe.make_model(args.seed + 1, data.in_features, data.classes).to(device)
        try:
            plain.load_state_dict(torch.load(ddp_path, weights_only=True))
        except RuntimeError as exc:
            first_error = str(exc)
            ui.print(f"RuntimeError: {escape(first_error)}")
        shown_keys.strict_false(ui, plain, ddp_path, data, device)

    # Step 7: Three fixes: save the module, consume the prefix, strip it by hand
    # Fix 1, at save time (as lesson 05 does): save the model inside the wrapper. Fix 2:
    # consume_prefix_in_state_dict_if_present strips it *in place* (it returns None). Fix 3:
    # k.removeprefix("module."), not k.replace, which breaks a child called `module`.
    ui.step(7, "Three fixes: save the module, consume the prefix, strip it by hand")
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), module_path)  # fix 1
        fixed = plain.load_state_dict(torch.load(module_path, weights_only=True))
        state = torch.load(ddp_path, weights_only=True)
        returned = consume_prefix_in_state_dict_if_present(state, "module.")  # fix 2
        ui.print(f"fix 1 ({shown(module_path)}): {fixed}; fix 2: it returned {returned} and changed "
                 f"the dict in place: {list(state)[:2]} ...: {plain.load_state_dict(state)}")
        replaced, stripped, replace_bug = shown_keys.strip_by_hand(ui, device, solo, args.seed)

    # Step 8: Wrappers in wrappers, and one loader for all: load_into
    # DataParallel keeps the model in `.module` too, torch.compile in `._orig_mod`, and
    # wrappers nest. apparatus/state_dicts.py's load_into(model, source) unwraps the target,
    # strips wrapper prefixes (at the start of a key, while every key has one) and loads
    # strictly; lessons/09_checkpoint_keys/checkpoint_keys.py tries every pair, weight by weight.
    ui.step(8, "Wrappers in wrappers, and one loader for all: load_into")
    if rank == 0:
        make = shown_keys.maker(args.seed, data, device)  # make(k): a fresh model, seed + k
        first_keys = shown_keys.wrapper_prefixes(ui, make, device, solo)
        matrix, worst, mistakes = shown_keys.load_into_matrix(ui, make, plain_state_dict(model), device, solo, {
            "a TinyNet checkpoint": (plain, stripped), "the k.replace keys": (shown_keys.TinyNet(), replaced)})

    # Step 9: Across devices: map_location and weights_only=True
    # torch.save records each tensor's device in the file, and torch.load puts it back
    # there unless map_location says otherwise. weights_only=True (torch.load's default
    # since 2.6) unpickles only tensors and plain containers: a file cannot run code.
    ui.step(9, "Across devices: map_location and weights_only=True")
    locations = (shown_keys.devices_and_types(ui, model, plain, module_path, folder, args.epochs)
                 if rank == 0 else None)

    # Step 10: Every rank loads rank 0's file after a barrier
    # All ranks hold the same weights, so one file is enough: rank 0 wrote it in Step 6.
    # Every rank writing the same path would race; and a rank that reads the file must wait
    # until it is complete, which is what the barrier is for. Each rank starts from its own
    # random weights here, so the weight sums show that every load really happened.
    ui.step(10, "Every rank loads rank 0's file after a barrier")
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    fresh = recipe.make_model(args.seed + 100 + rank, data.in_features, data.classes).to(device)
    before = shown_keys.checksum(fresh)
    dist.barrier()  # nobody reads ddp_model.pt before rank 0 has finished writing it
    load_into(fresh, ddp_path, map_location=device)  # onto this rank's own device
    sums = shown_keys.weight_sums(ui, before, fresh)  # gathered from every rank
    if rank == 0:
        diff = max_abs_diff(weights, recipe.train_reference(args.seed, args.epochs, data))
        accuracy = recipe.accuracy(fresh, data.test, device)
        save_results(folder, plain_state_dict(fresh), make_metrics(
            lesson="09", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=args.epochs * len(data.train), epochs=args.epochs, seed=args.seed,
            dataset=data.name, global_batch=recipe.GLOBAL_BATCH,
            accuracy_before_saving=recipe.accuracy(model, data.test, device), ddp_keys=keys,
            plain_load_error=first_error.splitlines()[0], first_keys=first_keys, load_into=matrix,
            replace_bug=replace_bug, load_into_max_abs_diff=worst, load_into_errors=mistakes,
            checkpoint_locations=locations, resume_checksums=sums, max_abs_diff_vs_single_device=diff))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')} "
                 f"and metrics.json")
        ui.print(f"same weights as one device? max |w_ddp - w_lesson01| = [bold]{diff:.1e}[/bold] "
                 + ("(yes: the only difference is float sums added in another order)" if diff <= 1e-4
                    else "(NO: something differs from lesson 01's recipe)"))
    dist.barrier()

    # Step 11: Leave the process group
    # Free everything that holds the process group (the DDP model's reducer) and collect
    # garbage *before* destroying the group. On torch 2.14.1 gloo otherwise aborts at exit
    # now and then ("terminate called without an active exception").
    ui.step(11, "Leave the process group")
    del ddp_model, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    ui.print("done: every rank left the process group cleanly")


if __name__ == "__main__":
    run(main)
