"""Lesson 02: the trace of Module._apply, and what a conversion does to Python objects."""
import json
import re

import pytest
import torch
import torch.nn as nn

from conftest import import_lesson, make_lesson, one_error_line, run_lesson

# The order PyTorch's Module._apply visits the lesson's Net in: children first (depth
# first, in registration order), then each module's own parameters, each followed by its
# .grad, then its buffers. Written out by hand from torch/nn/modules/module.py.
EXPECTED_MODULES = ["Net", "body", "body.0", "body.1", "body.2", "head"]
EXPECTED_TENSORS = [
    "body.0.weight", "body.0.weight.grad", "body.0.bias", "body.0.bias.grad",
    "body.1.weight", "body.1.weight.grad", "body.1.bias", "body.1.bias.grad",
    "body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked",
    "head.weight", "head.weight.grad", "head.bias", "head.bias.grad",
    "scale", "scale.grad",
]


def load_lesson():
    return import_lesson("02")


@pytest.fixture(scope="module")
def lesson():
    return load_lesson()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson02")
    proc = make_lesson("02", "--out", folder)
    return proc, json.loads((folder / "trace.json").read_text())


def test_trace_follows_the_real_recursion(default_run):
    proc, trace = default_run
    events = trace["events"]
    assert [e["name"] for e in events if e["event"] == "module"] == EXPECTED_MODULES
    assert [e["name"] for e in events if e["event"] == "tensor"] == EXPECTED_TENSORS
    # a module's children come before its own tensors: Net's `scale` is the very last
    assert events[-2]["name"] == "scale" and events[-2]["depth"] == 1
    # every floating tensor was converted; the integer counter only by a device change
    for e in events:
        if e["event"] == "tensor" and e["name"] != "body.1.num_batches_tracked":
            assert e["before"] != e["after"], e
    assert re.search(r"^\s+fn\(body\.1\.running_mean\)\s+buffer", proc.stdout, re.M)


def test_parameters_stay_buffers_are_replaced(default_run):
    _, trace = default_run
    identity = trace["identity"]
    for name in ("scale", "body.0.weight", "head.bias"):
        assert identity[name] == {"same_object": True, "new_storage": True,
                                  "grad_same_object": True}
    assert identity["body.1.running_mean"] == {"same_object": False, "converted": True}
    if trace["conversion"] == "model.double()":  # .double() leaves an int64 buffer alone
        assert identity["body.1.num_batches_tracked"] == {"same_object": True, "converted": False}


def test_optimizer_built_before_the_move(default_run):
    _, trace = default_run
    default, overwrite, swap = trace["optimizer_before_move"]
    assert (default["mode"], overwrite["mode"], swap["mode"]) == ("default", "overwrite", "swap")
    assert default["optimizer_holds_model_params"] and default["model_change"] > 1e-3
    assert default["losses"][-1] < 0.8 * default["losses"][0]
    assert not overwrite["optimizer_holds_model_params"]
    assert overwrite["model_change"] == 0.0 and len(set(overwrite["losses"])) == 1
    assert swap["optimizer_holds_model_params"] and swap["losses"] == default["losses"]


def test_meta_makes_new_parameter_objects(default_run):
    proc, trace = default_run
    assert trace["meta"]["compatible"] is False
    assert [e["name"] for e in trace["meta"]["events"] if e["event"] == "tensor"] == EXPECTED_TENSORS
    assert all(e["after"].endswith("meta") for e in trace["meta"]["events"] if e["event"] == "tensor")
    assert "same Parameter object: False" in proc.stdout


def test_steps_are_printed_in_order(default_run):
    proc, _ = default_run
    steps = [int(n) for n in re.findall(r"^Step (\d+):", proc.stdout, re.M)]
    assert steps == [1, 2, 3, 4, 5]
    if not torch.cuda.is_available():
        assert "no GPU here" in proc.stdout and "model.double()" in proc.stdout


def test_default_conversion_keeps_parameter_objects(lesson):
    net = lesson.make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    params = list(net.parameters())
    grads = [p.grad for p in params]
    running_mean = net.body[1].running_mean
    with lesson.conversion_mode("default"):
        net.double()
    assert all(a is b for a, b in zip(params, net.parameters()))
    assert all(p.grad is g and g.dtype == torch.float64 for p, g in zip(net.parameters(), grads))
    assert net.body[1].running_mean is not running_mean
    assert running_mean.dtype == torch.float32 and net.body[1].running_mean.dtype == torch.float64
    assert optimizer.param_groups[0]["params"][0] is net.scale


def test_overwrite_flag_leaves_the_old_optimizer_behind(lesson):
    net = lesson.make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    old = list(net.parameters())
    with lesson.conversion_mode("overwrite"):
        net.double()
    assert not any(a is b for a, b in zip(old, net.parameters()))
    assert all(p.dtype == torch.float32 for p in optimizer.param_groups[0]["params"])
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    optimizer.step()  # steps the old float32 tensors, whose grads are stale or None
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    # the flags are global: the context manager must put them back
    assert torch.__future__.get_overwrite_module_params_on_conversion() is False
    assert torch.__future__.get_swap_module_params_on_conversion() is False


def test_flags_and_apply_are_restored_after_an_error(lesson):
    original = nn.Module._apply
    with pytest.raises(RuntimeError):
        with lesson.conversion_mode("overwrite"), lesson.trace_apply(lesson.make_net()):
            raise RuntimeError("boom")
    assert nn.Module._apply is original
    assert torch.__future__.get_overwrite_module_params_on_conversion() is False


def test_trace_apply_does_not_change_the_result(lesson):
    traced, plain = lesson.make_net(), lesson.make_net()
    with lesson.trace_apply(traced) as events:
        traced.double()
    plain.double()
    for (n, a), (_, b) in zip(traced.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), n
    assert len(events) == len(EXPECTED_MODULES) + len(EXPECTED_TENSORS)


def test_cuda_keeps_parameter_objects(lesson):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: checks that real .cuda() keeps the Parameter objects")
    net = lesson.make_net()
    params = list(net.parameters())
    buffer = net.body[1].num_batches_tracked
    net.cuda()
    assert all(a is b and a.is_cuda and a.grad.is_cuda for a, b in zip(params, net.parameters()))
    assert net.body[1].num_batches_tracked is not buffer and net.body[1].num_batches_tracked.is_cuda


def test_bad_flags_are_one_clear_line():
    line = one_error_line(run_lesson("02", "--device", "tpu", check=False))
    assert line.startswith("error:") and "--device" in line
    if not torch.cuda.is_available():
        line = one_error_line(run_lesson("02", "--device", "cuda", check=False))
        assert "--device cpu" in line
