"""The shared recipe and common/: the properties every lesson relies on."""
import socket
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler

from common import recipe
from apparatus.results import atomic_write
from conftest import ROOT


def test_batch_and_dataset_sizes_never_pad():
    for n in (1, 2, 3, 4):
        assert recipe.GLOBAL_BATCH % n == 0
    assert recipe.N_TRAIN % recipe.GLOBAL_BATCH == 0


def test_model_has_no_batchnorm_or_dropout():
    model = recipe.make_model(0)
    banned = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)
    assert not [m for m in model.modules() if isinstance(m, banned)]


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = recipe.make_model(0), recipe.make_model(0), recipe.make_model(1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.fc1.weight, c.fc1.weight)


def test_synthetic_data_is_deterministic_and_balanced():
    (tr1, te1), (tr2, _) = recipe.synthetic_data(), recipe.synthetic_data()
    assert torch.equal(tr1.tensors[0], tr2.tensors[0])
    assert len(tr1) == recipe.N_TRAIN and len(te1) == recipe.N_TEST
    counts = torch.bincount(tr1.tensors[1], minlength=recipe.CLASSES)
    assert counts.min() == counts.max() == recipe.N_TRAIN // recipe.CLASSES


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_epoch_order_is_what_distributed_sampler_gives(world_size, epoch):
    """Rank r of N gets positions r, r+N, ... of epoch_order: so N ranks see the same global batches."""
    data = recipe.synthetic_data()[0]
    order = recipe.epoch_order(len(data), seed=7, epoch=epoch)
    for rank in range(world_size):
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        assert list(sampler) == order[rank::world_size]
    # and one local batch of every rank, put together, is exactly one global batch
    local = recipe.GLOBAL_BATCH // world_size
    first = sorted(i for r in range(world_size) for i in order[r::world_size][:local])
    assert first == sorted(order[:recipe.GLOBAL_BATCH])


def test_epoch_order_changes_with_epoch_and_seed():
    assert recipe.epoch_order(100, 0, 0) != recipe.epoch_order(100, 0, 1)
    assert recipe.epoch_order(100, 0, 0) != recipe.epoch_order(100, 1, 0)
    assert recipe.epoch_order(100, 3, 2) == recipe.epoch_order(100, 3, 2)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "metrics.json"
    atomic_write(target, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half a fi")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind


def test_free_port_is_on_loopback_and_free():
    from common.distributed import free_port
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise if it were taken


def test_busy_port_is_one_clear_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); " \
               f"from common.distributed import ensure_port_free; ensure_port_free({port})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert f"port {port}" in proc.stderr and "--master-port" in proc.stderr
