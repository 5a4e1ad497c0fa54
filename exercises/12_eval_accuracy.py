"""Exercise 12: distributed evaluation that counts every sample once.

Each rank evaluates its share of a validation set and the ranks combine their results, so
that every rank ends with the accuracy on the whole set. As written, the number comes out
close, but not equal, to what one process measures on the same model and data: exactly
the kind of silent bug that lesson 12 reproduces, because nothing fails.

Your task: make `distributed_accuracy` return exactly the single-process accuracy on every
rank, for any number of ranks, also when it does not divide the size of the data set. Keep
the work split: each sample is evaluated on one rank, not on all of them.
Hint: lesson 12, Step 8 (look at what DistributedSampler hands out when the ranks cannot
split the data evenly, and at how the per-rank numbers are combined).

Check it:  make check-12   (101 validation samples, on 2 and on 3 ranks)
"""
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


@torch.no_grad()
def distributed_accuracy(model, dataset) -> float:
    """Accuracy of `model` on `dataset` (a TensorDataset of (x, y)), every rank its share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    correct = total = 0
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    accuracy = torch.tensor([correct / total], dtype=torch.float64)
    dist.all_reduce(accuracy)           # the sum of the ranks' accuracies ...
    return accuracy.item() / world      # ... divided by N: their mean
