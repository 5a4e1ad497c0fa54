"""Choosing the device and the backend that goes with it.

Rule of thumb: NCCL talks GPU to GPU and is the fastest choice on CUDA; gloo works on
CPU tensors (and on any machine), so it is the backend of every CPU-only run here.
"""
from __future__ import annotations

import os

import torch

from common.cli import fail


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """auto -> cuda:<local_rank> when CUDA works, else cpu. cuda without CUDA -> clear error."""
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        fail("--device cuda was asked for, but torch.cuda.is_available() is False on this "
             "machine; use --device cpu (or auto)")
    if choice == "cpu" or not has_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        fail(f"local rank {local_rank} needs GPU cuda:{local_rank}, but only {count} GPU(s) "
             f"are visible; start at most {count} processes per node, or use --device cpu")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def plan_device(choice: str, procs_per_node: int) -> tuple[str, str | None]:
    """'cuda' or 'cpu' for a job with `procs_per_node` processes on each machine.

    One process per GPU is the rule: NCCL refuses two ranks on one GPU. With fewer GPUs
    than processes, auto falls back to the CPU (gloo) and returns a note saying so;
    an explicit --device cuda is an error instead. Call it once, before starting ranks.
    """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda":
        if n == 0:
            pick_device("cuda")  # the one-line "no CUDA here" error
        if n < procs_per_node:
            fail(f"--device cuda with {procs_per_node} processes per machine needs {procs_per_node} "
                 f"GPUs (one per rank), but {n} are visible; use --world-size {n} or --device cpu")
        return "cuda", None
    if choice == "cpu":
        return "cpu", None
    if n == 0:
        return "cpu", "no GPU on this machine: every rank computes on the CPU and talks over gloo"
    if n < procs_per_node:
        return "cpu", (f"{procs_per_node} ranks need {procs_per_node} GPUs but {n} are visible: "
                       f"running every rank on the CPU with gloo instead (--world-size {n} uses the GPUs)")
    return "cuda", None


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device of one rank: its own GPU (cuda:<local_rank>), or the CPU."""
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")


def share_cpu(procs_per_node: int) -> int:
    """Give each of this machine's ranks an equal share of the cores (at least one thread).

    Without it every rank starts one thread per core, and N ranks fight over the same cores.
    """
    threads = max(1, (os.cpu_count() or 1) // procs_per_node)
    torch.set_num_threads(threads)
    return threads
