"""Lesson 02: what `.cuda()` and `.to()` do inside a module

New since lesson 01: lesson 01 called `model.to(device)` and moved on. Here we open it up.
Every conversion method of nn.Module (`.cuda()`, `.to()`, `.double()`, `.cpu()`, ...) is a
one-liner that calls `Module._apply(fn)`. We trace that call on a small model with a
BatchNorm layer and watch which tensors it touches, in which order, and what happens to
the Python objects you may still hold: parameters, their gradients, buffers, an optimizer.
Nothing is trained and nothing is compared with lesson 01: this lesson is about mechanism.

Without a GPU the lesson converts with `.double()` (the same `_apply`, the same branch
as `.cuda()`) and with `.to("meta")` (a real change of device), and says so. The tracer that
watches `_apply` (`trace_apply`) is an instrument, not the idea: lessons/02_device_internals/apply_trace.py.

Run:
    make lesson-02
    .venv/bin/python lessons/02_device_internals.py --device cpu
    .venv/bin/python lessons/02_device_internals.py --device cuda     # real .cuda(), on a GPU machine

Doc: docs/02_device_internals.md
"""
import inspect
import json
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 02_device_internals/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.nn as nn

from apply_trace import describe, trace_apply
from common.cli import lesson_parser, run
from common.device import pick_device
from apparatus.results import claim_out, atomic_write, out_dir, shown
from apparatus.ui import UI


class Net(nn.Module):
    """Small, but with every kind of thing `_apply` visits: nested children, parameters,
    buffers (BatchNorm's running statistics) and a parameter on the top module itself."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(()))  # owned by Net, not by a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def make_net(seed: int = 0) -> Net:
    """A Net after one training-mode forward and backward: every parameter has a .grad,
    and BatchNorm's running_mean/running_var/num_batches_tracked are no longer initial."""
    torch.manual_seed(seed)
    net = Net()
    net(torch.randn(16, 4)).pow(2).mean().backward()
    return net


def snapshot(model: nn.Module) -> dict:
    """The Python objects (and storage addresses) a learner might hold before a conversion."""
    return {
        "modules": list(model.modules()),
        "params": dict(model.named_parameters()),
        "ptrs": {n: p.data_ptr() for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
    }


@contextmanager
def conversion_mode(mode: str):
    """default | overwrite | swap: the two torch.__future__ flags `_apply` reads."""
    old = (torch.__future__.get_overwrite_module_params_on_conversion(),
           torch.__future__.get_swap_module_params_on_conversion())
    torch.__future__.set_overwrite_module_params_on_conversion(mode == "overwrite")
    torch.__future__.set_swap_module_params_on_conversion(mode == "swap")
    try:
        yield
    finally:  # global flags: always put them back
        torch.__future__.set_overwrite_module_params_on_conversion(old[0])
        torch.__future__.set_swap_module_params_on_conversion(old[1])


def optimizer_built_before_move(mode: str, convert, steps: int = 5) -> dict:
    """Build SGD, *then* convert the model, then train a few steps on one fixed batch."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with conversion_mode(mode):
        convert(net)
    w = net.head.weight
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)).to(w.device, w.dtype)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    losses = []
    for _ in range(steps):
        loss = net(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    in_optimizer = optimizer.param_groups[0]["params"]
    return {
        "mode": mode,
        "optimizer_holds_model_params": all(a is b for a, b in zip(in_optimizer, net.parameters())),
        "optimizer_tensor": describe(in_optimizer[-1].detach()),
        "model_tensor": describe(net.head.weight.detach()),
        "model_change": max((p.detach() - before[n]).abs().max().item()
                            for n, p in net.named_parameters()),
        "losses": losses,
    }


def main() -> None:
    args = lesson_parser(__doc__, recipe=False).parse_args()
    folder = claim_out(out_dir("02", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title("Lesson 02: what .cuda() and .to() do inside a module")
    device = pick_device(args.device)
    if device.type == "cuda":
        convert, label = (lambda m: m.cuda()), "model.cuda()"
        ui.print(f"GPU found: the lesson converts with real [bold]{label}[/bold]")
    else:
        # .double() is `self._apply(lambda t: t.double() if t.is_floating_point() else t)`.
        # float32 -> float64 on the CPU takes the very branch .cuda() takes (see Step 3).
        convert, label = (lambda m: m.double()), "model.double()"
        ui.print(f"no GPU here: the lesson converts with [bold]{label}[/bold], which runs the "
                 f"same Module._apply as .cuda();\nStep 5 adds a real change of device (meta)")
    source_file = Path(inspect.getsourcefile(nn.Module._apply))
    source_line = inspect.getsourcelines(nn.Module._apply)[1]
    ui.print(f"read along: torch {torch.__version__}, "
             f"{source_file.relative_to(source_file.parents[3])} line {source_line}")

    # Step 1: Build a model with parameters, buffers and gradients
    # A module keeps its state in three dicts: _modules (children), _parameters and
    # _buffers. One forward/backward in training mode gives every parameter a .grad and
    # updates BatchNorm's running statistics, so all three kinds of tensor are real.
    ui.step(1, "Build a model with parameters, buffers and gradients")
    net = make_net()
    for name, m in net.named_modules():
        own_params = ", ".join(m._parameters) or "-"
        own_buffers = ", ".join(m._buffers) or "-"
        ui.print(f"  {name or 'Net (top)':<10} {type(m).__name__:<12} "
                 f"_parameters: {own_params:<14} _buffers: {own_buffers}")
    bn = net.body[1]
    ui.print(f"every parameter has a .grad: {all(p.grad is not None for p in net.parameters())}; "
             f"BatchNorm saw {bn.num_batches_tracked.item()} batch, running_mean[0] = "
             f"{bn.running_mean[0].item():+.4f}")

    # Step 2: Trace the recursion of _apply
    # We wrap Module._apply (for this call only) and print every module it enters and
    # every tensor it hands to fn. Read the order: a module's children are converted
    # *first*, then its own parameters (each followed by its .grad), then its buffers.
    ui.step(2, "Trace the recursion of _apply")
    before = snapshot(net)
    with trace_apply(net) as events:
        returned = convert(net)
    for e in events:
        pad = "  " * (e["depth"] + 1)
        if e["event"] == "module":
            who = e["type"] if e["name"] == e["type"] else f"{e['name']}: {e['type']}"
            ui.print(f"{pad}_apply({who})")
        else:
            ui.print(f"{pad}fn({e['name']})".ljust(40) +
                     f"{e['kind']:<10} {e['before']} -> {e['after']}")
    ui.print(f"{label} returned the same module object: {returned is net}")

    # Step 3: Check what moved and what stayed
    # The module objects never move: only the tensors inside them change. Parameters keep
    # their Python identity (`param.data = new`) while their storage is new; gradients the
    # same; buffers are *replaced* in _buffers, so an old reference to one goes stale.
    ui.step(3, "Check what moved and what stayed")
    after = snapshot(net)
    assert all(a is b for a, b in zip(before["modules"], after["modules"]))
    # The branch is chosen per parameter by this check on (old tensor, converted tensor):
    compatible = torch._has_compatible_shallow_copy_type(torch.empty(0), net.head.weight.detach())
    ui.print(f"torch._has_compatible_shallow_copy_type(float32 cpu, {describe(net.head.weight)}) "
             f"= {compatible}, so _apply ran `param.data = fn(param)`")
    rows = []
    identity = {}
    for name, p in after["params"].items():
        same, moved = p is before["params"][name], p.data_ptr() != before["ptrs"][name]
        grad_same = p.grad is before["grads"][name]
        identity[name] = {"same_object": same, "new_storage": moved, "grad_same_object": grad_same}
        rows.append([name, "parameter", same, moved, describe(p.detach())])
        rows.append([name + ".grad", "gradient", grad_same, "", describe(p.grad)])
        assert same and moved and grad_same and p.grad.dtype == p.dtype and p.grad.device == p.device
    for name, b in after["buffers"].items():
        old = before["buffers"][name]
        changed = (old.dtype, old.device) != (b.dtype, b.device)
        identity[name] = {"same_object": b is old, "converted": changed}
        rows.append([name, "buffer", b is old, "", describe(b)])
        assert (b is not old) == changed  # replaced exactly when fn returned a new tensor
    ui.table(f"after {label}", ["tensor", "kind", "same object?", "new storage?", "now"], rows)
    stale = before["buffers"]["body.1.running_mean"]
    ui.print(f"a reference to running_mean saved before the move is stale: it is still "
             f"{describe(stale)}, the module's is now {describe(bn.running_mean)}")
    if device.type != "cuda":
        ui.print("num_batches_tracked is an integer: .double() only converts floating-point "
                 "tensors, so fn returned it unchanged (.cuda() would move it)")

    # Step 4: The optimizer built before the move
    # An optimizer stores the Parameter objects it was given. By default they survive the
    # move, so the optimizer keeps training the model. With the overwrite flag from
    # torch.__future__, _apply makes new Parameters: the old optimizer steps tensors the
    # model no longer uses, and nothing warns you. The swap flag keeps the objects.
    ui.step(4, "The optimizer built before the move")
    results = [optimizer_built_before_move(mode, convert)
               for mode in ("default", "overwrite", "swap")]
    ui.table("SGD built before the conversion, then 5 steps on one batch",
             ["flag", "optimizer sees model", "optimizer's tensor",
              "weights moved", "loss first -> last"],
             [[r["mode"], r["optimizer_holds_model_params"], r["optimizer_tensor"],
               f"{r['model_change']:.2e}", f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"]
              for r in results])
    default, overwrite, swap = results
    assert default["optimizer_holds_model_params"] and default["model_change"] > 0
    assert default["losses"][-1] < default["losses"][0]
    assert not overwrite["optimizer_holds_model_params"] and overwrite["model_change"] == 0.0
    assert overwrite["losses"][-1] == overwrite["losses"][0]  # it does not learn, silently
    assert swap["optimizer_holds_model_params"] and swap["model_change"] > 0
    ui.print("overwrite: the model did not change and the loss stayed put, with no error and "
             "no warning. Build the optimizer after moving the model.")

    # Step 5: A real device change without a GPU: meta
    # "meta" tensors have a shape and a dtype but no data. Moving to meta walks exactly the
    # same recursion, but CPU and meta tensors are not "shallow-copy compatible", so even
    # by default _apply creates *new* Parameter objects here, unlike .cuda() and .double().
    ui.step(5, "A real device change without a GPU: meta")
    net = make_net()
    before = snapshot(net)
    with trace_apply(net) as meta_events:
        net.to("meta")
    visits = [e["name"] for e in meta_events if e["event"] == "module"]
    ui.print(f"same walk: {' -> '.join(visits)} ({len(meta_events)} events, "
             f"as many as in Step 2: {len(meta_events) == len(events)})")
    w_old, w_new = before["params"]["head.weight"], net.head.weight
    meta_compatible = torch._has_compatible_shallow_copy_type(w_old.detach(), w_new.detach())
    ui.print(f"head.weight is now {describe(w_new.detach())}, shape {tuple(w_new.shape)}, no data; "
             f"same Parameter object: {w_new is w_old}")
    ui.print(f"torch._has_compatible_shallow_copy_type(cpu, meta) = {meta_compatible} -> _apply "
             f"takes the `Parameter(fn(param))` branch: new objects")
    assert len(meta_events) == len(events) and not meta_compatible
    assert all(p.is_meta and p is not before["params"][n] for n, p in net.named_parameters())
    assert all(p.grad is not None and p.grad.is_meta for p in net.parameters())

    record = {"lesson": "02", "conversion": label, "device": str(device),
              "torch": torch.__version__, "events": events, "identity": identity,
              "optimizer_before_move": results,
              "meta": {"compatible": meta_compatible, "events": meta_events}}
    atomic_write(folder / "trace.json", lambda f: f.write(json.dumps(record, indent=2).encode()))
    ui.print(f"\nwrote the trace to {shown(folder / 'trace.json')}")


if __name__ == "__main__":
    run(main)
