"""DataParallel's four forward stages, on GPUs (torch's own) or on simulated CPU devices.

Lesson 03 (lessons/03_data_parallel.py) trains with `nn.DataParallel` when it has 2 or more
GPUs. Without them, DataParallel's own scatter, replicate and gather refuse CPU devices, so the
lesson runs the same algorithm written out here by hand, one Python thread per simulated device
(`sim:0`, `sim:1`, ...). Each `*_by_hand` function mirrors one in torch/nn/parallel/ (named in
its docstring); `stages()` hands the lesson either torch's functions or these, with one
signature, and `SimulatedDataParallel` chains them the way `DataParallel.forward` does.

Doc: docs/03_data_parallel.md (Steps 1, 3 and 7).
"""
from __future__ import annotations

import copy
import threading
import time
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.markup import escape

from common.cli import fail


def choose_devices(args, device: torch.device, ui) -> tuple[torch.device, bool, list[str]]:
    """(device 0, real, device names): real DataParallel on --devices GPUs (device 0: cuda:0),
    or that many simulated devices on the CPU, said plainly, with DataParallel's own refusals
    of CPU devices printed. `device` is what --device resolved to (auto: cuda if any)."""
    wanted = args.devices
    if not 2 <= wanted <= 8:
        fail(f"--devices {wanted}: data parallelism needs between 2 and 8 devices here")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        fail(f"nn.DataParallel needs at least 2 GPUs and this machine has {gpus}; "
             f"use --device cpu to run the simulated version")
    if gpus >= 2:
        if wanted > gpus:
            fail(f"--devices {wanted} needs {wanted} GPUs but {gpus} are visible; use --devices {gpus}")
        names = [f"cuda:{i}" for i in range(wanted)]
        ui.print(f"{gpus} GPUs: nn.DataParallel on {', '.join(names)}")
        return torch.device("cuda", 0), True, names
    names = [f"sim:{i}" for i in range(wanted)]
    ui.print(f"{'no GPU' if gpus == 0 else 'only 1 GPU'} here: "
             f"simulating {wanted} devices ({', '.join(names)}) on the CPU,\none thread per "
             f"replica, with the stages written out by hand. DataParallel's own functions refuse CPU devices:")
    from torch.nn.parallel import gather, replicate, scatter
    probes = [("scatter(x, ['cpu', 'cpu'])", lambda: scatter(torch.ones(4, 2), ["cpu", "cpu"])),
              ("replicate(model, ['cpu', 'cpu'])", lambda: replicate(nn.Linear(2, 2), ["cpu", "cpu"])),
              ("gather([cpu, cpu], 'cpu')", lambda: gather([torch.ones(2)] * 2, "cpu"))]
    for text, probe in probes:
        try:
            probe()
            ui.print(escape(f"  {text}: worked"))
        except Exception as exc:
            ui.print(escape(f"  {text} -> {type(exc).__name__}: {exc}"))
    ids = nn.DataParallel(nn.Linear(2, 2)).device_ids
    ui.print(f"  nn.DataParallel(model).device_ids = {ids}: with "
             f"{'no device' if not ids else 'one device'} its forward just calls the model")
    return torch.device("cpu"), False, names


def scatter_by_hand(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """scatter_gather.scatter: equal chunks along dim 0, one per device."""
    return x.chunk(n, dim=0)


def replicate_by_hand(network: nn.Module, n: int) -> list[nn.Module]:
    """replicate.replicate: per device, a shallow copy of every module whose parameters are
    *autograd-connected* copies of the originals (not leaves), so that backward sends each
    replica's gradient back to the original parameter, where the copies' gradients add up.

    Replica 0 aliases the originals (view_as shares storage), as DataParallel guarantees
    for device 0; the others get a real copy (clone), as a broadcast to another GPU would.
    """
    modules = list(network.modules())
    replicas = []
    for j in range(n):
        # _replicate_for_data_parallel is what replicate.py calls: a new module object
        # sharing the original's __dict__, but with an empty _parameters dict.
        copies = {m: m._replicate_for_data_parallel() for m in modules}
        for m, r in copies.items():
            for key, child in m._modules.items():
                setattr(r, key, copies[child])
            for key, p in m._parameters.items():
                setattr(r, key, p.view_as(p) if j == 0 else p.clone())  # a plain attribute now
            for key, b in m._buffers.items():  # the recipe's MLP has none; BatchNorm would
                setattr(r, key, b if j == 0 else b.detach().clone())
        replicas.append(copies[network])
    return replicas


def parallel_apply_by_hand(replicas: list[nn.Module], chunks) -> tuple[list, list[float]]:
    """parallel_apply.parallel_apply: one Python thread per replica, results in order;
    also returns how long each replica's forward took, timed in its own thread."""
    n = len(replicas)
    outputs, seconds, errors = [None] * n, [0.0] * n, [None] * n
    grad_enabled = torch.is_grad_enabled()

    def worker(i: int) -> None:
        torch.set_grad_enabled(grad_enabled)  # grad mode is per thread: copy the caller's
        try:
            start = time.perf_counter()
            outputs[i] = replicas[i](chunks[i])
            seconds[i] = time.perf_counter() - start
        except Exception as exc:  # re-raised in the caller's thread, like ExceptionWrapper
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return outputs, seconds


def gather_by_hand(outputs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """scatter_gather.gather: concatenate along dim 0 on the output device (device 0)."""
    return torch.cat([o.to(device) for o in outputs], dim=0)


class Stages(NamedTuple):
    """The four stages of DataParallel.forward, bound to n devices and device 0."""
    scatter: object         # x -> chunks
    replicate: object       # model -> replicas
    parallel_apply: object  # (replicas, chunks) -> outputs
    gather: object          # outputs -> one tensor on device 0


def stages(dp) -> Stages:
    """The stages `dp(x)` runs: for nn.DataParallel torch's own functions (what its forward
    calls, on its device_ids), for SimulatedDataParallel the by-hand versions above."""
    if isinstance(dp, SimulatedDataParallel):
        n, dev0 = len(dp.device_ids), next(dp.module.parameters()).device
        return Stages(lambda x: scatter_by_hand(x, n), lambda m: replicate_by_hand(m, n),
                      lambda reps, xs: parallel_apply_by_hand(reps, xs)[0],
                      lambda outs: gather_by_hand(outs, dev0))
    from torch.nn.parallel import gather, parallel_apply, replicate, scatter
    ids = dp.device_ids
    return Stages(lambda x: scatter(x, ids), lambda m: replicate(m, ids),
                  lambda reps, xs: parallel_apply(reps, [(c,) for c in xs], None, ids),
                  lambda outs: gather(outs, ids[0]))


class SimulatedDataParallel:
    """`SimulatedDataParallel(model, device_ids=[0, 1])`: `dp(x)` as nn.DataParallel's forward
    does it (scatter, replicate, parallel forward, gather) on simulated devices: one CPU
    thread per device id, the model where it is (device 0)."""

    def __init__(self, module: nn.Module, device_ids: list[int]):
        self.module, self.device_ids = module, list(device_ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s = stages(self)
        chunks = s.scatter(x)
        replicas = s.replicate(self.module)[:len(chunks)]  # as DP: device_ids[:len(inputs)]
        return s.gather(s.parallel_apply(replicas, chunks))


def replica_grads(model: nn.Module, replicas: list[nn.Module]) -> list[list[torch.Tensor]]:
    """Clear the model's old gradients; hook every replica's fc1.weight, so that its gradient
    is caught on its way back to the original."""
    model.zero_grad(set_to_none=True)
    caught = [[] for _ in replicas]
    for i, r in enumerate(replicas):
        r.fc1.weight.register_hook(lambda g, i=i: caught[i].append(g))
    return caught


def show_one_batch(ui, names, model, x, y, chunks, replicas, outputs, out, loss, caught) -> None:
    """Print each stage's shapes, then check after backward that fc1.weight.grad is the sum of
    the replicas' gradients and equals one device's gradient on the whole batch."""
    dev0 = out.device
    ui.print(f"1 scatter    x {tuple(x.shape)} -> " +
             ", ".join(f"{names[i]} {tuple(c.shape)}" for i, c in enumerate(chunks)) +
             f"; labels y {tuple(y.shape)} stay whole, for device 0")
    w = replicas[1].fc1.weight
    n_params = sum(p.numel() for p in model.parameters())
    ui.print(f"2 replicate  {n_params:,} parameters copied to each of {len(replicas)} devices; "
             f"replica 1's fc1.weight: leaf={w.is_leaf}, grad_fn={type(w.grad_fn).__name__}")
    ui.print(f"3 forward    {len(replicas)} threads -> " +
             ", ".join(f"{names[i]} {tuple(o.shape)}" for i, o in enumerate(outputs)))
    ui.print(f"4 gather     -> {tuple(out.shape)} on {names[0]}")
    ui.print(f"5 loss       cross-entropy over all {out.shape[0]} samples on {names[0]}: "
             f"{loss.item():.4f}")
    summed = sum(c[0].to(dev0) for c in caught)
    single = copy.deepcopy(model)
    single.zero_grad(set_to_none=True)
    F.cross_entropy(single(x.to(dev0)), y.to(dev0)).backward()
    diff_sum = (model.fc1.weight.grad - summed).abs().max().item()
    diff_single = (model.fc1.weight.grad - single.fc1.weight.grad).abs().max().item()
    ui.print(f"  backward   fc1.weight.grad = sum of the {len(replicas)} replicas' gradients "
             f"(max diff {diff_sum:.1e}); vs one device on the whole batch: max diff {diff_single:.1e}")
    assert diff_sum <= 1e-6 and diff_single <= 1e-6, (diff_sum, diff_single)
