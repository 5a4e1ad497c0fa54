"""apparatus/state_dicts.py: load_into for every pair of wrappers, and its errors."""
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import recipe
from apparatus.state_dicts import CheckpointError, load_into, strip_wrapper_prefixes, unwrap

KINDS = ["plain", "DataParallel", "DDP", "compile"]
NESTED = ["DDP(compile)", "compile(DDP)", "DataParallel(DataParallel)"]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """DDP needs a process group: a world of one on gloo, with an in-memory store."""
    if dist.is_initialized():  # someone else's group: use it, leave it alone
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    gc.collect()  # free the DDP reducers before the group goes (see common.distributed.teardown)
    dist.destroy_process_group()


def wrap(kind: str, model: nn.Module) -> nn.Module:
    return {
        "plain": lambda: model,
        "DataParallel": lambda: nn.DataParallel(model),
        "DDP": lambda: DDP(model),
        "compile": lambda: torch.compile(model),
        "DDP(compile)": lambda: DDP(torch.compile(model)),
        "compile(DDP)": lambda: torch.compile(DDP(model)),
        "DataParallel(DataParallel)": lambda: nn.DataParallel(nn.DataParallel(model)),
    }[kind]()


def trained() -> nn.Module:
    """A model whose weights differ from a fresh one's (seed 0 vs seed 1)."""
    return recipe.make_model(0)


def assert_same(model: nn.Module, expected: nn.Module) -> None:
    got, want = unwrap(model).state_dict(), expected.state_dict()
    assert list(got) == list(want)
    for k in want:  # .cpu(): with one GPU, DataParallel moves its model to cuda:0
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("target_kind", KINDS + NESTED)
@pytest.mark.parametrize("source_kind", KINDS + NESTED)
def test_every_wrapper_into_every_wrapper(source_kind, target_kind):
    source = trained()
    saved = wrap(source_kind, source).state_dict()
    target = wrap(target_kind, recipe.make_model(1))
    stripped = load_into(target, saved)
    expected_prefix = {"plain": "", "DataParallel": "module.", "DDP": "module.",
                       "compile": "_orig_mod.", "DDP(compile)": "module._orig_mod.",
                       "compile(DDP)": "_orig_mod.module.",
                       "DataParallel(DataParallel)": "module.module."}[source_kind]
    assert stripped == expected_prefix
    assert_same(target, source)


@pytest.mark.parametrize("source_kind", KINDS)
def test_path_sources_str_and_pathlib(tmp_path, source_kind):
    source = trained()
    path = tmp_path / f"{source_kind}.pt"
    torch.save(wrap(source_kind, source).state_dict(), path)
    for given in (path, str(path)):
        target = wrap("DDP", recipe.make_model(1))
        load_into(target, given, map_location="cpu")
        assert_same(target, source)


def test_the_source_dict_is_not_changed():
    saved = DDP(trained()).state_dict()
    keys = list(saved)
    load_into(recipe.make_model(1), saved)
    assert list(saved) == keys  # unlike consume_prefix_in_state_dict_if_present


def test_missing_and_unexpected_keys_are_listed_in_one_line():
    saved = {k: v for k, v in DDP(trained()).state_dict().items() if "head" not in k}
    saved["module.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_into(nn.DataParallel(recipe.make_model(1)), saved)
    message = str(info.value)
    assert "\n" not in message
    assert "does not fit MLP after stripping 'module.'" in message
    assert "2 missing" in message and "head.bias" in message and "head.weight" in message
    assert "1 unexpected" in message and "extra.weight" in message
    assert info.value.missing == ["head.bias", "head.weight"]
    assert info.value.unexpected == ["extra.weight"]


def test_other_model_is_refused_and_nothing_is_loaded():
    target = recipe.make_model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match="missing .*unexpected"):
        load_into(target, nn.Sequential(nn.Linear(16, 4)).state_dict())
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k])


def test_shape_mismatch_is_one_clear_line():
    wide = recipe.make_model(0, in_features=784)
    with pytest.raises(CheckpointError, match=r"fc1.weight \(64, 784\) vs \(64, 16\)"):
        load_into(recipe.make_model(1), DDP(wide).state_dict())


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)  # a child really called `module`


class WithSubmodule(nn.Module):
    def __init__(self):
        super().__init__()
        self.submodule = nn.Linear(4, 4)
        self.block = Residual()


def test_prefix_only_strip_keeps_inner_module_names():
    torch.manual_seed(0)
    source = WithSubmodule()
    saved = DDP(source).state_dict()
    assert "module.submodule.weight" in saved and "module.block.module.weight" in saved
    assert set(strip_wrapper_prefixes(saved)) == set(source.state_dict())
    # the bug the lesson shows: replace() also rewrites the inside of the keys
    assert "subweight" in {k.replace("module.", "") for k in saved}
    target = DDP(WithSubmodule())
    load_into(target, saved)
    assert_same(target, source)


def test_a_model_whose_only_child_is_called_module():
    """Every key of Residual starts with `module.`: stripping it would be wrong."""
    torch.manual_seed(0)
    source = Residual()
    for saved in (source.state_dict(), DDP(source).state_dict(),
                  torch.compile(DDP(source)).state_dict()):
        target = Residual()
        load_into(target, saved)
        assert_same(target, source)


def test_metadata_survives_for_batchnorm():
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    source.train()(torch.randn(8, 4))  # running statistics != their initial values
    saved = DDP(source).state_dict()
    target = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    load_into(torch.compile(target), saved)
    assert_same(target, source)
    stripped = strip_wrapper_prefixes(saved)
    assert stripped._metadata["1"]["version"] == 2 and "" in stripped._metadata


@pytest.mark.parametrize("content, expect", [
    (b"this is not a checkpoint", "not a readable PyTorch checkpoint"),
    (b"", "not a readable PyTorch checkpoint"),
    ("truncated", "not a readable PyTorch checkpoint"),
])
def test_corrupt_files(tmp_path, content, expect):
    path = tmp_path / "bad.pt"
    if content == "truncated":
        torch.save(trained().state_dict(), path)
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_into(recipe.make_model(1), path)
    assert expect in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_into(recipe.make_model(1), tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_into(recipe.make_model(1), tmp_path)


class NotAllowed:  # a class that weights_only=True must refuse to unpickle
    pass


def test_weights_only_refuses_python_objects(tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"fc1.weight": torch.zeros(1), "config": NotAllowed()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True refuses.*NotAllowed"):
        load_into(recipe.make_model(1), path)


def test_a_dict_of_state_dicts_gets_a_hint(tmp_path):
    path = tmp_path / "full.pt"
    torch.save({"model": trained().state_dict(), "optimizer": {"lr": 0.1}, "step": 3}, path)
    with pytest.raises(CheckpointError, match=r"checkpoint\['model'\]"):
        load_into(recipe.make_model(1), path)
    with pytest.raises(CheckpointError, match="not a state_dict"):
        load_into(recipe.make_model(1), [torch.zeros(1)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: saves on cuda, loads on cpu")
def test_gpu_checkpoint_loads_onto_cpu(tmp_path):
    source = trained().cuda()
    path = tmp_path / "gpu.pt"
    torch.save(nn.DataParallel(source).state_dict(), path)  # module. keys, tensors on cuda:0
    target = recipe.make_model(1)
    load_into(target, path, map_location="cpu")
    assert_same(target, source.cpu())
