"""Exercise 15, a solution: ZeRO-2 by hand (see exercises/15_zero2.py)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import Variable

try:  # make check-15 has put the repository on sys.path, wherever this file is
    from common import lesson_module
except ImportError:  # this file run on its own, from tests/solutions/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
    from common import lesson_module
lesson_15 = lesson_module("15")  # its main() does not run: only the classes are defined
sharded = lesson_15.sharded  # flat_row, pieces: lessons/15_zero_fsdp/sharded.py


class ZeroTwo(lesson_15.ShardedOptimizer):
    """ShardedOptimizer(params, optimizer_class, **defaults) that shards the gradients too."""

    BUCKET = 1024  # elements: a bucket is sent as soon as it holds at least this many

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.bucket: list = []
        for p in self.param_groups[0]["params"]:
            if p.requires_grad:  # runs once backward has finished p's gradient
                p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, p) -> None:
        if not self.bucket:  # the first of a bucket: what is left goes when backward ends
            Variable._execution_engine.queue_callback(self._send)
        self.bucket.append(p)  # every rank's backward reaches the parameters in one order
        if sum(q.numel() for q in self.bucket) >= self.BUCKET:
            self._send()

    def _send(self) -> None:
        bucket, self.bucket = self.bucket, []
        if bucket:
            self.reduce_scatter(bucket)

    @torch.no_grad()
    def reduce_scatter(self, bucket: list) -> None:
        """Each rank gets the mean gradient of its own parameters in the bucket; the others'
        gradients are freed: ShardedOptimizer.step's reduce-scatter, one bucket at a time."""
        ids = {id(p) for p in bucket}
        parts = [[p for p in shard if id(p) in ids] for shard in self.shards]  # row r: rank r's
        size = max(sum(p.numel() for p in part) for part in parts)  # rows padded to the biggest
        rows = torch.cat([sharded.flat_row(part, size, self.device, grad=True) for part in parts])
        mine, row = parts[dist.get_rank()], rows.new_empty(size)
        dist.reduce_scatter_single(row, rows)  # row `rank` of every rank, summed
        for p, grad in zip(mine, sharded.pieces(row / dist.get_world_size(), mine)):
            p.grad.copy_(grad)  # the mean, in the gradient's own storage
        for p in bucket:
            if id(p) not in {id(q) for q in mine}:
                p.grad = None  # another rank steps it: free it now, not after step()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.run(closure)
        self.optim.step()  # this rank's parameters, with the gradients backward left it
        for owner, shard in enumerate(self.shards):
            for p in shard:  # no N x shard buffer: each parameter from its owner, in place
                dist.broadcast(p, src=owner)
        return loss
