"""Reference solution of exercises/12_eval_accuracy.py."""
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset


@torch.no_grad()
def distributed_accuracy(model, dataset) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = Subset(dataset, range(rank, len(dataset), world))  # no padding: some get one less
    correct = total = 0
    for x, y in DataLoader(mine, batch_size=32):
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    counts = torch.tensor([correct, total])  # int64: counts add up exactly
    dist.all_reduce(counts)                  # SUM of correct answers and of samples
    return counts[0].item() / counts[1].item()
