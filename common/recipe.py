"""The shared training recipe (lesson 01): one model, one data set, one optimizer, one order.

Every training lesson uses these, so its final weights can be compared with lesson 01's.
That comparison is exact because the model has no BatchNorm and no dropout (either would
make N devices compute something other than one device), and the global batch (96)
divides by 1, 2, 3 and 4 and the training set (3072 = 96 x 32) by it: no rank is padded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Sampler, TensorDataset

from common import datasets, fail  # datasets imports torchvision only when it loads one

SEED = 0              # initial weights and sample order
EPOCHS = 3            # passes over the training set
GLOBAL_BATCH = 96     # samples per optimizer step, summed over all ranks
LR = 0.05             # SGD learning rate
MOMENTUM = 0.9        # SGD momentum
HIDDEN = 64           # width of the MLP's hidden layers

# The synthetic data: 4 classes in 16 dimensions. Each class is a mixture of two Gaussian
# clusters, so no straight line separates the classes and the hidden layers have work to do.
N_TRAIN = GLOBAL_BATCH * 32   # 3072
N_TEST = 1024
FEATURES = 16
CLASSES = 4
DATA_SEED = 1234      # fixed: the data set never changes, only --seed does


class MLP(nn.Module):
    """Three linear layers with ReLU: small, fast on a CPU, and free of BatchNorm/dropout."""

    def __init__(self, in_features: int = FEATURES, hidden: int = HIDDEN, classes: int = CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)  # images (N, C, H, W) become vectors; vectors stay as they are
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.head(x)


def make_model(seed: int, in_features: int = FEATURES, classes: int = CLASSES) -> MLP:
    """The same seed gives the same initial weights in every process."""
    torch.manual_seed(seed)
    return MLP(in_features, HIDDEN, classes)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def synthetic_data() -> tuple[TensorDataset, TensorDataset]:
    """A learnable classification problem generated in-process: no download, same every time."""
    g = torch.Generator().manual_seed(DATA_SEED)
    centers = torch.randn(CLASSES, 2, FEATURES, generator=g) * 1.0  # two clusters per class

    def draw(n: int) -> TensorDataset:
        y = torch.arange(n) % CLASSES                     # balanced classes
        cluster = torch.randint(0, 2, (n,), generator=g)  # which of the class's two clusters
        x = centers[y, cluster] + torch.randn(n, FEATURES, generator=g)
        perm = torch.randperm(n, generator=g)
        return TensorDataset(x[perm], y[perm])

    return draw(N_TRAIN), draw(N_TEST)


@dataclass
class Data:
    train: TensorDataset
    test: TensorDataset
    in_features: int
    classes: int
    name: str


def load_data(dataset: str = "synthetic", data_dir: Path | None = None,
              download: bool = False) -> Data:
    """The recipe's data: synthetic by default, or MNIST / CIFAR-10 from --data-dir."""
    if dataset == "synthetic":
        train, test = synthetic_data()
        return Data(train, test, FEATURES, CLASSES, "synthetic")
    train, test = datasets.load_image_dataset(dataset, Path(data_dir), download)
    # Drop the tail so the training set is a multiple of the global batch: no rank pads.
    keep = len(train) - len(train) % GLOBAL_BATCH
    if keep == 0:
        fail(f"{dataset} in {data_dir} has only {len(train)} training images; the recipe "
             f"needs at least {GLOBAL_BATCH}")
    train = TensorDataset(train.tensors[0][:keep], train.tensors[1][:keep])
    return Data(train, test, train.tensors[0][0].numel(), 10, dataset)


def check_world_size(n: int, named: str, most: int | None = None, least: int = 1) -> None:
    """The one world-size rule: N ranks split GLOBAL_BATCH into equal batches (and one
    machine runs at most `most` of them, each a process of about 0.4 GB)."""
    most = most or GLOBAL_BATCH
    if GLOBAL_BATCH % n or not least <= n <= most:
        ok = ", ".join(str(d) for d in range(least, most + 1) if GLOBAL_BATCH % d == 0)
        fail(f"{named} cannot split the global batch of {GLOBAL_BATCH} samples into equal "
             f"per-rank batches{' on one machine' if most < GLOBAL_BATCH else ''}; use one of {ok}")


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of the samples in one epoch: a function of (seed, epoch) only.

    It is exactly what `DistributedSampler(shuffle=True, seed=seed)` computes after
    `set_epoch(epoch)`, before it hands rank r the positions r, r+N, r+2N, ...
    """
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class EpochShuffle(Sampler[int]):
    """A one-device sampler with `DistributedSampler`'s order and its `set_epoch` API."""

    def __init__(self, n: int, seed: int = SEED):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(epoch_order(self.n, self.seed, self.epoch))

    def __len__(self) -> int:
        return self.n


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset, device: torch.device,
             batch: int = 1024) -> float:
    """Fraction of `data` the model classifies correctly."""
    was_training = model.training
    model.eval()
    x_all, y_all = data.tensors
    correct = 0
    for start in range(0, len(y_all), batch):
        x = x_all[start:start + batch].to(device)
        y = y_all[start:start + batch].to(device)
        correct += (model(x).argmax(1) == y).sum().item()
    model.train(was_training)
    return correct / len(y_all)


def train_reference(seed: int = SEED, epochs: int = EPOCHS, data: Data | None = None,
                    device: torch.device = torch.device("cpu"),
                    steps: int | None = None) -> dict[str, torch.Tensor]:
    """Lesson 01's training loop, condensed: the single-device answer other lessons compare to.
    steps: only each epoch's first `steps` global batches (the exercise checks' short runs).

    tests/test_lesson_01.py checks that lesson 01 ends with exactly these weights.
    """
    data = data or load_data()
    # One thread: bitwise the same result, and far faster when other processes (ranks,
    # tests) share the cores, because the math library's threads stop fighting over them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(seed, epochs, data, device, steps)
    finally:
        torch.set_num_threads(threads)


def _train_reference(seed: int, epochs: int, data: Data, device: torch.device,
                     steps: int | None = None) -> dict[str, torch.Tensor]:
    model = make_model(seed, data.in_features, data.classes).to(device)
    optimizer = make_optimizer(model)
    x_all, y_all = data.train.tensors
    for epoch in range(epochs):
        order = torch.tensor(epoch_order(len(y_all), seed, epoch))
        for start in range(0, len(order), GLOBAL_BATCH)[:steps]:
            idx = order[start:start + GLOBAL_BATCH]
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def timed_single_process(seed: int, epochs: int, data, device, threads: int):
    """Lesson 01's loop (recipe) in this process with `threads` CPU threads: (weights,
    samples/s). Lesson 05 compares its ranks with it: the same cores, the same work."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        # warm up first (the first forward/backward allocates and initialises), as the
        # ranks did in their Step 5, so that neither side pays it inside the timing
        x, y = data.train.tensors
        model = make_model(seed, data.in_features, data.classes).to(device)
        F.cross_entropy(model(x[:GLOBAL_BATCH].to(device)), y[:GLOBAL_BATCH].to(device)).backward()
        start = time.perf_counter()
        weights = _train_reference(seed, epochs, data, device)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(old)
    return weights, epochs * len(data.train) / max(seconds, 1e-9)
