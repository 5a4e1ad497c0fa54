"""Exercise 05: every epoch should see a different order.

This is the data-loading part of lesson 05, cut down to the sampler. As written, every
epoch hands each rank *the same* samples in *the same* order: the model sees a repeated
sequence of batches, which hurts training and hides the bug behind "it still converges".

Your task: make `epoch_orders` return a different order for every epoch, while the ranks
still split each epoch between them exactly (no sample twice, none missing).
Hint: lesson 05, Step 6; and read DistributedSampler.__iter__ to see where the epoch enters.

Check it:  make check-05
"""
from torch.utils.data import DistributedSampler


def epoch_orders(dataset_size: int, world_size: int, rank: int, epochs: int, seed: int = 0):
    """The indices `rank` reads in each epoch, as a list of lists."""
    dataset = range(dataset_size)  # a sampler only needs len(dataset)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    orders = []
    for epoch in range(epochs):
        orders.append(list(sampler))
    return orders
