"""DDP under torch.compile (lesson 29's Step 6): where dynamo cuts the graph, and the bucket trap.

DDP starts a bucket's all-reduce from autograd hooks, the moment that bucket's gradients are
ready (lesson 14). A compiled graph's backward is one autograd node: every gradient in it is
ready at once, when it ends. So when dynamo compiles a frame inside DDP's forward (DDP sets
DistributedDataParallel._active_ddp_module around it), and torch._dynamo.config.optimize_ddp
is "ddp_optimizer" (True, the default), convert_frame.py hands the graph to a DDPOptimizer
(torch/_dynamo/backends/distributed.py) instead: it walks the graph backwards, adds up the
parameters' bytes, cuts a new piece where a bucket would be full, and compiles each piece on
its own. Each piece's backward is a node of its own, so its gradients are ready, and DDP's
hooks fire, while the pieces before it are still computing theirs: the all-reduces overlap
backward again. optimize_ddp=False: one graph, all gradients at the end, no overlap.

The trap: convert_frame.py (line 2627) builds DDPOptimizer(bucket_bytes_cap=
ddp_module.bucket_bytes_cap) and passes no first_bucket_cap, so DDPOptimizer takes
torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) for the first piece, and asserts that it
is not larger than the others (distributed.py line 465). DDP itself uses that 1 MiB first
bucket only when bucket_cap_mb is left at its default: given bucket_cap_mb, its first bucket is
that cap (torch/nn/parallel/distributed.py, line 108). Any bucket_cap_mb below 1 under compile
therefore fails at the first forward. PRIVATE API: DDPOptimizer is torch._dynamo's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from graph_census import Counted, nice_name


def bucket_trap(model: torch.nn.Module, x: torch.Tensor, cap_mb: float) -> dict:
    """DDP(model, bucket_cap_mb=cap_mb) with each block compiled, one forward: the error it
    raises, in one line (None if it ran), and the two caps that disagree. On every rank."""
    torch._dynamo.reset()  # no compiled Block from before: this one goes through convert_frame
    ddp_model = DDP(model, bucket_cap_mb=cap_mb)
    for block in model.blocks:
        block.compile(backend="eager")  # the backend does not matter: DDPOptimizer fails first
    try:
        ddp_model(x)
        error = None
    except AssertionError as exc:  # dynamo raises it as it is, at the first compiled frame
        error = f"{type(exc).__name__}: {exc}"
    caps = {"bucket_cap_bytes": ddp_model.bucket_bytes_cap,
            "first_bucket_bytes_dynamo": dist._DEFAULT_FIRST_BUCKET_BYTES}
    del ddp_model
    torch._dynamo.reset()
    return {"cap_mb": cap_mb, "error": error, **caps}


def split_at_buckets(model: torch.nn.Module, x: torch.Tensor, cap_bytes: int) -> list[dict]:
    """What DDPOptimizer does to the whole model's graph with buckets of cap_bytes, the first
    one included (first_bucket_cap=cap_bytes, which DDP cannot pass it): the pieces in forward
    order, each with its parameters' bytes and names. One process, backend "eager"."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    torch._dynamo.reset()
    captured = []

    def capture(gm, example_inputs):  # a backend that keeps the graph dynamo hands it
        captured.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture)(x)
    gm, example_inputs = captured[0]
    pieces = Counted("eager")
    splitter = DDPOptimizer(bucket_bytes_cap=cap_bytes, backend_compile_fn=pieces, first_bucket_cap=cap_bytes)
    splitter.compile_fn(gm, example_inputs)  # compiles each piece through `pieces`
    torch._dynamo.reset()
    assert len(pieces.graphs) == len(splitter.buckets)  # one compiled graph per bucket
    return [{"bytes": b.size, "params": [nice_name(p) for p in b.params], "calls": g["calls"]}
            for b, g in zip(splitter.buckets, pieces.graphs)]
