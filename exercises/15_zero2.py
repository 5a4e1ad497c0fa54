"""Exercise 15: ZeRO-2 by hand: shard the gradients too, during backward.

Lesson 15's ShardedOptimizer is ZeRO-1: each rank keeps the AdamW state of its own shard of
the parameters (self.shards[rank]), but backward leaves every rank a gradient for every
parameter, and step() then stacks them all into one N x (biggest shard) buffer: at the end
of backward a rank holds every gradient, and more in step(). ZeRO-2 sends each gradient to
its owner as soon as backward has made it, and frees it on every other rank.

ZeroTwo below already collects the gradients in buckets as backward produces them (a hook on
each parameter; a bucket is sent once it holds BUCKET elements, the rest when backward ends),
and its step() only steps this rank's parameters and broadcasts them from their owners. What
it does with a bucket, reduce_scatter(), is still DDP's: every rank all-reduces and keeps
every gradient.

Your task: make reduce_scatter(bucket) leave each rank the mean gradient of only the
parameters in the bucket that it owns, and free (set to None) the gradients of the others,
with the weights still those of one process.
Hint: lesson 15, Step 3 (ShardedOptimizer.step's first four lines do this for all the
parameters at once: do it for the bucket's), self.shards, dist.get_rank().

Check it:  make check-15   (3 ranks on gloo, a small model with a tied weight and a frozen
                            layer, 3 AdamW steps, compared with one process; the peak of one
                            step measured by torch's MemTracker beside ShardedOptimizer's)
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import Variable

try:  # make check-15 has put the repository on sys.path, wherever this file is
    from common import lesson_module
except ImportError:  # this file run on its own, from exercises/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
        """The bucket's gradients, averaged over the ranks. TODO: ZeRO-2 (see the docstring)."""
        for p in bucket:  # DDP's way: every rank ends with every gradient
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.run(closure)
        self.optim.step()  # this rank's parameters, with the gradients backward left it
        for owner, shard in enumerate(self.shards):
            for p in shard:  # no N x shard buffer: each parameter from its owner, in place
                dist.broadcast(p, src=owner)
        return loss
