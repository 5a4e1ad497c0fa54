"""Real image data sets for the recipe: torchvision's MNIST and CIFAR-10.

Only imported with `--dataset mnist|cifar10`, because `import torchvision` costs about two
seconds that the synthetic default does not need. Images become float tensors in memory
(both sets fit easily), so every lesson indexes them exactly like the synthetic data.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import socket
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from common import fail

# Per-channel mean and std of the training sets, the values torchvision's examples use.
MNIST_STATS = ((0.1307,), (0.3081,))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def _normalise(images: torch.Tensor, stats) -> torch.Tensor:
    mean = torch.tensor(stats[0]).view(1, -1, 1, 1)
    std = torch.tensor(stats[1]).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std


# Seconds any one network wait of a download may take (connect, or the next bytes of an
# answer); LESSON_DOWNLOAD_TIMEOUT overrides it. Without a bound, a proxy that accepts and
# never answers keeps a download waiting forever.
DOWNLOAD_TIMEOUT = 30.0


@contextlib.contextmanager
def bounded_network_waits():
    """socket.setdefaulttimeout for the urllib calls inside torchvision's download."""
    seconds = float(os.environ.get("LESSON_DOWNLOAD_TIMEOUT", DOWNLOAD_TIMEOUT))
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield seconds
    finally:
        socket.setdefaulttimeout(old)


def _download_failure(what: str, root: Path, exc: BaseException, seconds: float, fix: str) -> str:
    why = " ".join(str(exc).split())[:160] or type(exc).__name__
    if isinstance(exc, (TimeoutError, socket.timeout)) or "timed out" in why:
        why = f"no answer within {seconds:g} s: {why}"
    return (f"could not download {what} into {root} ({type(exc).__name__}: {why}); check the "
            f"network and any proxy (https_proxy), or {fix}")


def load_mnist(root: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    """torchvision's MNIST class reads root/MNIST/raw/*-idx?-ubyte (downloading if asked)."""
    from torchvision.datasets import MNIST

    sets = []
    for train in (True, False):
        with bounded_network_waits() as seconds:
            try:
                ds = MNIST(str(root), train=train, download=download)
            except Exception as exc:  # torchvision: "Dataset not found. You can use download=True"
                if download:
                    fail(_download_failure("MNIST", root, exc, seconds,
                                           f"copy the four *-ubyte files into {root / 'MNIST' / 'raw'}"))
                fail(f"MNIST not found in {root / 'MNIST' / 'raw'} ({exc}); "
                     f"add --download, or copy the four *-ubyte files there")
        images = ds.data.unsqueeze(1)  # (N, 28, 28) uint8 -> (N, 1, 28, 28)
        sets.append(TensorDataset(_normalise(images, MNIST_STATS), ds.targets.long()))
    return sets[0], sets[1]


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR-10 batch holds: dicts, lists, strings, numbers and numpy
    arrays of plain numbers. Any other global (os.system, a class with __reduce__) is
    refused *before* it can run: a data file must never run code."""

    def find_class(self, module: str, name: str):
        import numpy as np

        core = getattr(np, "_core", None) or np.core
        allowed = {
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): _plain_dtype,
            ("numpy.core.multiarray", "_reconstruct"): core.multiarray._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): core.multiarray._reconstruct,
            ("numpy.core.numeric", "_frombuffer"): core.numeric._frombuffer,
            ("numpy._core.numeric", "_frombuffer"): core.numeric._frombuffer,
            ("_codecs", "encode"): _latin1_bytes,  # how protocol 2 stores bytes
        }
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"refused {module}.{name}: not part of a CIFAR-10 batch")
        return allowed[(module, name)]


def _plain_dtype(*args):
    import numpy as np

    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError("refused an array of Python objects")
    return dtype


def _latin1_bytes(text, encoding="latin1"):
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("refused a codec call")
    return text.encode("latin1")


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch: a pickled dict with b'data' (N x 3072 uint8) and b'labels'."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
        if not isinstance(entry, dict) or not isinstance(entry.get("data"), np.ndarray) \
                or entry["data"].dtype != np.uint8:
            raise ValueError("no uint8 array under 'data'")
        data = torch.tensor(entry["data"], dtype=torch.uint8).view(-1, 3, 32, 32)
        labels = torch.tensor(entry["labels"] if "labels" in entry else entry["fine_labels"])
    except FileNotFoundError:
        fail(f"CIFAR-10 file {path} is missing; add --download, or unpack "
             f"cifar-10-python.tar.gz into {path.parent.parent}")
    except Exception as exc:  # a truncated, foreign or crafted file: say which one
        why = f": {' '.join(str(exc).split())[:100]}" if isinstance(exc, pickle.UnpicklingError) else ""
        fail(f"CIFAR-10 file {path} is not a valid CIFAR-10 batch ({type(exc).__name__}{why}); "
             f"delete {path.parent} and run again with --download")
    return data, labels


def load_cifar10(root: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    """Reads root/cifar-10-batches-py/{data_batch_1..5,test_batch}, the layout torchvision uses.

    Downloading uses torchvision's URL and md5 for the archive; reading is done here, with
    an unpickler that only lets numpy arrays and plain types out, so small test files work
    too and a crafted file cannot run code.
    """
    folder = root / "cifar-10-batches-py"
    if download and not folder.exists():
        from torchvision.datasets import CIFAR10
        from torchvision.datasets.utils import download_and_extract_archive
        with bounded_network_waits() as seconds:
            try:
                # download, check the md5, unpack; not CIFAR10(...), which would also
                # unpickle the batches with plain pickle: we read them below, safely
                download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename,
                                             md5=CIFAR10.tgz_md5)
            except Exception as exc:
                fail(_download_failure("CIFAR-10", root, exc, seconds,
                                       "copy cifar-10-batches-py there yourself"))
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
