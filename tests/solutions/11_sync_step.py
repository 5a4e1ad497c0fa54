"""Reference solution of exercises/11_sync_step.py."""
import torch
import torch.distributed as dist


def synchronous_step(model, optimizer) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # one message for every gradient
    dist.all_reduce(flat)                 # SUM; returns once the slowest worker has sent too
    flat /= dist.get_world_size()         # the mean of N means over 96/N samples: over 96
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    optimizer.step()
