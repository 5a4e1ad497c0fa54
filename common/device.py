"""Choosing the device and the backend that goes with it.

Rule of thumb: NCCL talks GPU to GPU and is the fastest choice on CUDA; gloo works on
CPU tensors (and on any machine), so it is the backend of every CPU-only run here.
"""
from __future__ import annotations

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


def gpu_count(device: torch.device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0
