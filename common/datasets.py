"""Real image data sets for the recipe: torchvision's MNIST and CIFAR-10.

Only imported with `--dataset mnist|cifar10`, because `import torchvision` costs about two
seconds that the synthetic default does not need. Images become float tensors in memory
(both sets fit easily), so every lesson indexes them exactly like the synthetic data.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from common.cli import fail

# Per-channel mean and std of the training sets, the values torchvision's examples use.
MNIST_STATS = ((0.1307,), (0.3081,))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def _normalise(images: torch.Tensor, stats) -> torch.Tensor:
    mean = torch.tensor(stats[0]).view(1, -1, 1, 1)
    std = torch.tensor(stats[1]).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std


def load_mnist(root: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    """torchvision's MNIST class reads root/MNIST/raw/*-idx?-ubyte (downloading if asked)."""
    from torchvision.datasets import MNIST

    sets = []
    for train in (True, False):
        try:
            ds = MNIST(str(root), train=train, download=download)
        except RuntimeError as exc:  # torchvision: "Dataset not found. You can use download=True"
            fail(f"MNIST not found in {root / 'MNIST' / 'raw'} ({exc}); "
                 f"add --download, or copy the four *-ubyte files there")
        images = ds.data.unsqueeze(1)  # (N, 28, 28) uint8 -> (N, 1, 28, 28)
        sets.append(TensorDataset(_normalise(images, MNIST_STATS), ds.targets.long()))
    return sets[0], sets[1]


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch: a pickled dict with b'data' (N x 3072 uint8) and b'labels'."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        data = torch.tensor(entry["data"], dtype=torch.uint8).view(-1, 3, 32, 32)
        labels = torch.tensor(entry["labels"] if "labels" in entry else entry["fine_labels"])
    except FileNotFoundError:
        fail(f"CIFAR-10 file {path} is missing; add --download, or unpack "
             f"cifar-10-python.tar.gz into {path.parent.parent}")
    except Exception as exc:  # a truncated or foreign file: say which one
        fail(f"CIFAR-10 file {path} is not a valid CIFAR-10 batch ({type(exc).__name__}); "
             f"delete {path.parent} and run again with --download")
    return data, labels


def load_cifar10(root: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    """Reads root/cifar-10-batches-py/{data_batch_1..5,test_batch}, the layout torchvision uses.

    Downloading goes through torchvision's CIFAR10 class (which verifies every file's md5);
    reading is done here with the same pickle format, so small test files work too.
    """
    folder = root / "cifar-10-batches-py"
    if download and not folder.exists():
        from torchvision.datasets import CIFAR10
        try:
            CIFAR10(str(root), train=True, download=True)
        except Exception as exc:
            fail(f"could not download CIFAR-10 into {root} ({exc}); check the network, or "
                 f"copy cifar-10-batches-py there yourself")
    if not folder.exists():
        fail(f"CIFAR-10 not found in {folder}; add --download, or unpack "
             f"cifar-10-python.tar.gz into {root}")
    train = [_read_cifar_batch(folder / f"data_batch_{i}") for i in range(1, 6)]
    test_x, test_y = _read_cifar_batch(folder / "test_batch")
    train_x = torch.cat([x for x, _ in train])
    train_y = torch.cat([y for _, y in train])
    return (TensorDataset(_normalise(train_x, CIFAR10_STATS), train_y.long()),
            TensorDataset(_normalise(test_x, CIFAR10_STATS), test_y.long()))


def load_image_dataset(name: str, root: Path, download: bool):
    if name == "mnist":
        return load_mnist(root, download)
    if name == "cifar10":
        return load_cifar10(root, download)
    fail(f"unknown dataset {name!r}; choose synthetic, mnist or cifar10")
