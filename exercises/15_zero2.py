"""Exercise 15: ZeRO-2 by hand: shard the gradients too.

Lesson 15's ShardedOptimizer is ZeRO-1: each rank keeps the AdamW state of its own shard of
the parameters (self.shards[rank]), but after step() every rank still holds a gradient for
every parameter: 4 bytes per parameter, on every rank, although it only ever steps its own.
ZeRO-2 keeps only the gradients a rank owns. The class below is still ZeRO-1.

Your task: make ZeroTwo.step() leave each rank holding .grad only for the parameters of its
own shard (the others' gradients freed), with the weights still those of one process.
Hint: lesson 15, Step 3 (ShardedOptimizer.step: which gradients does a rank still need after
the reduce-scatter?), and dist.get_rank().

Check it:  make check-15   (3 ranks on gloo, a small model with a tied weight and a frozen
                            layer, 3 AdamW steps, compared with one process)
"""
import importlib.util
import sys
from pathlib import Path

import torch.distributed as dist

try:  # make check-15 has put the repository on sys.path, wherever this file is
    from common import ROOT
except ImportError:  # this file run on its own, from exercises/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from common import ROOT
_spec = importlib.util.spec_from_file_location("lesson_15", next((ROOT / "lessons").glob("15_*.py")))
lesson_15 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lesson_15)  # its main() does not run: only the classes are defined


class ZeroTwo(lesson_15.ShardedOptimizer):
    """ShardedOptimizer(params, optimizer_class, **defaults) that also shards the gradients."""

    def step(self) -> None:
        super().step()  # reduce-scatter, step my shard, all-gather the parameters
        # TODO: keep only the gradients of my own shard, self.shards[dist.get_rank()]
        assert dist.is_initialized()
