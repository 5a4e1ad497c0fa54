"""MNIST and CIFAR-10 loading, on small files written here in those data sets' real formats."""
import pickle
import struct

import numpy as np

from common import recipe
from conftest import run_lesson, load_run, one_error_line


def write_mnist(root, n_train=192, n_test=40):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 50, size=(n, 28, 28), dtype=np.uint8)
        images[np.arange(n), labels * 2, :] = 255  # a learnable stripe: row 2*label lit up
        # IDX format: magic (0x0803 images / 0x0801 labels), sizes, then raw bytes, big-endian
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x0803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x0801, n) + labels.tobytes())


def write_cifar10(root, per_batch=40, n_test=20):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        labels = [int(x) for x in rng.integers(0, 10, size=n)]
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f)


def test_mnist_loads_through_torchvision(tmp_path):
    write_mnist(tmp_path)
    data = recipe.load_data("mnist", tmp_path)
    x, y = data.train.tensors
    assert x.shape == (192, 1, 28, 28) and data.in_features == 784 and data.classes == 10
    assert y.tolist()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert abs(x.mean().item()) < 1.0  # normalised, not raw bytes
    assert len(data.test) == 40


def test_cifar10_loads_and_is_trimmed_to_whole_batches(tmp_path):
    write_cifar10(tmp_path)
    data = recipe.load_data("cifar10", tmp_path)
    x, _ = data.train.tensors
    assert x.shape == (192, 3, 32, 32)  # 200 images, trimmed to 2 global batches of 96
    assert data.in_features == 3072 and len(data.test) == 20


def test_missing_dataset_is_one_clear_line(tmp_path):
    proc = run_lesson("01", "--dataset", "cifar10", "--data-dir", tmp_path, check=False)
    line = one_error_line(proc)
    assert "--download" in line and "cifar-10-batches-py" in line


def test_corrupt_cifar_file_is_one_clear_line(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    line = one_error_line(run_lesson("01", "--dataset", "cifar10", "--data-dir", tmp_path, check=False))
    assert "data_batch_3" in line


def test_lesson_01_trains_on_mnist_files(tmp_path):
    write_mnist(tmp_path / "data")
    run_lesson("01", "--dataset", "mnist", "--data-dir", tmp_path / "data", "--epochs", "3",
               "--out", tmp_path / "out")
    state, metrics = load_run(tmp_path / "out")
    assert metrics["dataset"] == "mnist" and state["fc1.weight"].shape == (64, 784)
    assert len(metrics["losses"]) == 3 * 2
