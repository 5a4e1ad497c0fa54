"""Reference solution of exercises/07_resume_mid_epoch.py."""
from torch.utils.data import DistributedSampler


def still_to_do(global_step: int, world_size: int, rank: int, seed: int = 0,
                dataset_size: int = 3072, global_batch: int = 96) -> list[int]:
    steps_per_epoch = dataset_size // global_batch
    epoch = global_step // steps_per_epoch
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    done = global_step - epoch * steps_per_epoch      # global batches of this epoch done
    per_rank = global_batch // world_size             # this rank's share of one global batch
    return list(sampler)[done * per_rank:]
