"""FSDP2 under torch.compile (lesson 29's Step 7): where the graph breaks, and why.

fully_shard gives a module forward hooks that all-gather its parameters before its forward
and free them after (lesson 15). torch 2.14.1 keeps dynamo out of them: FSDPState._pre_forward,
_post_forward, _pre_backward and FSDPParamGroup's pre_backward/post_backward are wrapped in
_dynamo_disable (torch/distributed/fsdp/_fully_shard/_fsdp_common.py), which calls
torch._dynamo.disable(func, recursive=True, reason="skipping FSDP hooks").

* Each block compiled after fully_shard (block.compile(), as torchtitan compiles each
  TransformerBlock): the block's hooks run in Module._call_impl, which dynamo does not trace;
  the first frame it catches is Block.forward. One graph, no break: the hooks run eagerly
  between the graphs, all-gather before a block, free after.
* The whole model compiled: tracing Transformer.forward, dynamo reaches a block's call, then its
  pre-forward hook, and the call to torch._dynamo.disable() is a graph break. It happens in
  the `for block in self.blocks` loop, where dynamo cannot resume ("graph break in loop"), so
  it gives up on the whole forward frame: the embeddings, the final norm and the head run
  eagerly, and only the frames below (each Block.forward) are compiled.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from common import transformer as T
from graph_census import Counted, named_breaks


def compiled_fsdp(seed: int, mesh, x: torch.Tensor, y: torch.Tensor, whole: bool) -> dict:
    """A fresh model, fully_shard on each block and the root, compiled whole or per block
    (backend "eager": the graphs and the breaks are dynamo's, the same for every backend), one
    forward and backward on every rank: {graphs, breaks}, from dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = T.make_model(seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    backend = Counted("eager")
    if whole:
        forward = torch.compile(model, backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)
        forward = model
    T.loss_fn(forward(x), y).backward()
    found = {"graphs": backend.graphs, "breaks": named_breaks(counters)}
    del forward, model
    torch._dynamo.reset()
    return found
