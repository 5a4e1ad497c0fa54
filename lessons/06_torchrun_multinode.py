"""Lesson 06: torchrun and several machines (nodes), simulated on one.

New since lesson 05: the script no longer starts its own processes. A launcher, torchrun,
starts them (one torchrun *agent* per machine, N workers per agent) and tells each worker
who it is through environment variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. The same file runs unchanged on one laptop, on two simulated
nodes, or on real machines; and under plain `python` it is a world of one.

Run:
    make lesson-06     # two torchrun agents on 127.0.0.1, 2 workers each = 4 ranks
    .venv/bin/python tools/nodes.py --nnodes 2 --nproc-per-node 2 -- lessons/06_torchrun_multinode.py
    .venv/bin/torchrun --standalone --nproc-per-node 3 lessons/06_torchrun_multinode.py
    .venv/bin/python lessons/06_torchrun_multinode.py        # a world of one

    On two real machines (A is 10.0.0.1), see the doc for firewall and interface notes:
    A$ .venv/bin/torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 lessons/06_torchrun_multinode.py
    B$ .venv/bin/torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 lessons/06_torchrun_multinode.py

Doc: docs/06_torchrun_multinode.md
"""
import datetime
import gc
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import recipe
from common.cli import lesson_parser, nonnegative_int, run
from common.device import backend_for, plan_device, rank_device, share_cpu
from common.distributed import die_with_parent, env_store, free_port
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, save_results, shown
from apparatus.ui import UI, Timer


# @record writes this worker's exception to the file torchrun names in
# TORCHELASTIC_ERROR_FILE, so torchrun's failure summary shows *our* error and traceback
# instead of only "exit code 1". Without torchrun the error file is simply not written.
@record
def main() -> None:
    parser = lesson_parser(__doc__, distributed=True)
    parser.add_argument("--crash-rank", type=nonnegative_int, default=None,
                        help="make this global rank raise an error during training")
    parser.add_argument("--crash-at-step", type=nonnegative_int, default=3,
                        help="the training step at which --crash-rank fails")
    args = parser.parse_args()
    die_with_parent()  # if our torchrun agent is killed (even kill -9), we go too

    # Step 1: Read who we are from the environment
    # torchrun sets these for every worker. (The old torch.distributed.launch passed
    # --local_rank as a command-line argument instead; torchrun does not, so there is no
    # argparse flag for it.) Under plain python none is set: we become a world of one.
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))                  # 0 .. WORLD_SIZE-1, unique in the job
    local_rank = int(os.environ.get("LOCAL_RANK", 0))      # 0 .. LOCAL_WORLD_SIZE-1, on this node
    world_size = int(os.environ.get("WORLD_SIZE", 1))      # workers in the whole job
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # workers on this node
    node_rank = int(os.environ.get("GROUP_RANK", 0))       # which agent (node) started us
    if not launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    ui = UI(rank, world_size, step_mode=args.step)
    ui.title(f"Lesson 06: {world_size} workers on {world_size // local_world_size} node(s), "
             f"{'started by torchrun' if launched else 'plain python: a world of one'}")
    ui.step(1, "Read who we are from the environment")
    recipe.check_world_size(world_size, f"WORLD_SIZE={world_size}")
    ui.print(f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} "
             f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}")
    if rank == 0:
        folder = claim_out(out_dir("06", args.out))  # checked now, not after training

    # Step 2: Join the process group
    # Same call as lesson 05, but rank, world size and the store's address now come from
    # the environment. env_store makes the store init_method="env://" would make (torchrun's
    # agent hosts it, or rank 0 does), bound to MASTER_ADDR only. One GPU per local rank.
    ui.step(2, "Join the process group")
    kind, note = plan_device(args.device, local_world_size)
    if note:
        ui.print(f"[yellow]note:[/yellow] {note}")
    device = rank_device(kind, local_rank)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    share_cpu(local_world_size)
    dist.init_process_group(backend=backend, store=env_store(rank, world_size, args.timeout),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)

    # Step 3: See which rank lives on which node
    # Global rank = node_rank * nproc_per_node + local_rank with static rendezvous. Every
    # worker reports itself; rank 0 prints the map. LOCAL_RANK picks the GPU, RANK picks
    # the data shard and decides who logs and saves.
    ui.step(3, "See which rank lives on which node")
    me = [rank, node_rank, local_rank, socket.gethostname(), os.getpid(), str(device), backend]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, me)
    ui.table("Ranks and nodes", ["rank", "node", "local rank", "host", "pid", "device", "backend"],
             everyone)

    # Step 4: Train with DDP
    # Exactly lesson 05's loop: DistributedSampler by *global* rank, per-rank batch =
    # global batch / WORLD_SIZE, set_epoch every epoch, DDP averaging the gradients.
    ui.step(4, "Train with DDP")
    data = recipe.load_data(args.dataset, args.data_dir, args.download)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(data.train, batch_size=recipe.GLOBAL_BATCH // world_size, sampler=sampler)
    model = recipe.make_model(args.seed, data.in_features, data.classes).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = recipe.make_optimizer(ddp_model)
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # losses since the last log, still on the device (lesson 05)
    steps = args.epochs * len(loader)
    timer = Timer()
    with ui.progress(steps, f"training on {world_size} ranks") as bar:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                if rank == args.crash_rank and len(losses) + len(pending) == args.crash_at_step:
                    raise RuntimeError(f"deliberate crash of rank {rank} (--crash-rank)")
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                pending.append(loss.detach())
                bar.advance()
                if (len(losses) + len(pending)) % len(loader) == 0:  # once per epoch
                    chunk = torch.stack(pending)
                    dist.all_reduce(chunk)
                    losses += (chunk / world_size).tolist()
                    pending = []
                    ui.log(epoch + 1, len(losses), steps, losses[-1],
                           timer.rate(len(losses) * recipe.GLOBAL_BATCH))
    wall = timer.seconds

    # Step 5: Save on rank 0 and compare with one device
    # Only global rank 0 writes, on node 0's disk. On real machines the other nodes have
    # their own disks: a path that exists on node 0 may not exist on node 1.
    ui.step(5, "Save on rank 0 and compare with one device")
    if rank == 0:
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        diff = max_abs_diff(weights, recipe.train_reference(args.seed, args.epochs, data))
        accuracy = recipe.accuracy(model, data.test, device)
        save_results(folder, weights, make_metrics(
            lesson="06", world_size=world_size, backend=backend, device=str(device),
            losses=losses, final_accuracy=accuracy, wall_seconds=wall,
            samples=args.epochs * len(data.train), epochs=args.epochs, seed=args.seed,
            dataset=data.name, nodes=world_size // local_world_size,
            ranks=[{"rank": r[0], "node": r[1], "local_rank": r[2], "host": r[3]} for r in everyone],
            max_abs_diff_vs_single_device=diff))
        ui.print(f"test accuracy {accuracy:.1%}; wrote {shown(folder / 'final.pt')}")
        ui.print(f"same weights as one device? max |w - w_lesson01| = [bold]{diff:.1e}[/bold]")
    dist.barrier()

    # Step 6: Leave the process group
    ui.step(6, "Leave the process group")
    del ddp_model, model, optimizer
    gc.collect()  # before destroy: see lesson 05, Step 8
    dist.destroy_process_group()
    ui.print("done")


if __name__ == "__main__":
    run(main)
