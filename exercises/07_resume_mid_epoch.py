"""Exercise 07: resume mid-epoch without training a sample twice.

Lesson 07's snapshot counts progress in *global* steps: after `global_step` optimizer steps
of `global_batch` samples each, a restarted job must carry on with the very next batch of
the same epoch, on however many ranks it comes back with. As written, `still_to_do` hands
each rank its whole share of the current epoch again: every batch trained before the
snapshot in this epoch is trained a second time, and the final weights are no longer
lesson 01's.

Your task: return the sample ids that `rank` still has to train in the current epoch, in
the order DistributedSampler gives them, so that the ranks together train every sample of
the epoch that the snapshot had not reached, exactly once, and none that it had. It must
also work when the job comes back with another world size than it was saved with.
Hint: lesson 07, Step 3 (why steps are counted in global batches) and Step 5 (how the
training loop starts mid-epoch).

Check it:  make check-07
"""
from torch.utils.data import DistributedSampler


def still_to_do(global_step: int, world_size: int, rank: int, seed: int = 0,
                dataset_size: int = 3072, global_batch: int = 96) -> list[int]:
    """Sample ids `rank` trains from now to the end of the current epoch, in order."""
    steps_per_epoch = dataset_size // global_batch
    epoch = global_step // steps_per_epoch
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)  # a sampler only needs len(dataset)
    sampler.set_epoch(epoch)
    return list(sampler)  # this rank's whole share of the epoch


if __name__ == "__main__":
    # rank 0 of 2, resuming after 40 global steps: epoch 1 (0-based), 8 of its 32 steps done
    print(still_to_do(40, world_size=2, rank=0)[:8], "...")
