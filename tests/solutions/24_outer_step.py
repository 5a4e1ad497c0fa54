"""Exercise 24, solved: one flat all-reduce of the pseudo-gradients, divided by the world size,
as lesson 24's outer_step does it."""
import torch
import torch.distributed as dist


def outer_step(model, outer, outer_optimizer):
    pseudo = [o - p.detach() for o, p in zip(outer, model.parameters())]  # theta_start - theta_end
    flat = torch.cat([g.flatten() for g in pseudo])  # one message, not one per tensor
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for o, g in zip(outer, flat.split([o.numel() for o in outer])):
        o.grad = g.view_as(o)
    outer_optimizer.step()
    with torch.no_grad():
        for p, o in zip(model.parameters(), outer):
            p.copy_(o)
