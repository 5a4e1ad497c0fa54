"""A solution to exercise 14: each all-reduce starts from a hook during backward."""
import torch
import torch.distributed as dist


class OverlappedSync:
    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.world = dist.get_world_size()
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.works = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._start)

    def _start(self, param: torch.Tensor) -> None:
        # backward has finished adding into param.grad: send it now, wait later
        self.works.append((param, dist.all_reduce(param.grad, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        for param, work in self.works:
            work.wait()
            param.grad.div_(self.world)
        self.works.clear()
