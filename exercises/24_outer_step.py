"""Exercise 24: DiLoCo's outer step: average the pseudo-gradients, then step Nesterov.

Lesson 24's replicas each take H inner steps alone. Then, together, every rank calls

    outer_step(model, outer, outer_optimizer)

    model            this replica's model: its weights are where its H inner steps ended (theta_end)
    outer            one tensor per parameter: the weights every replica started the round
                     from (theta_start), the same on every rank
    outer_optimizer  torch.optim.SGD over `outer` (DiLoCo: lr 0.7, momentum 0.9, nesterov=True)

It must take this replica's pseudo-gradient, theta_start - theta_end, average it over the ranks
(a sum by all-reduce, then / world size), give the average to the outer tensors as their .grad,
step the outer optimizer, and copy the new outer weights into the model: every replica starts
the next round from the same weights.

Below, each replica steps with its own pseudo-gradient: nothing leaves the rank, and the
replicas drift apart. Make them talk.
Hint: docs/24_local_sgd_diloco.md, Step 4 (the four lines, in words), and lesson 10 for
all-reduce. Lesson 24's own outer_step is the answer: try it before you read it.

Check it:  make check-24   (2 and 3 gloo ranks, two outer steps so that the momentum counts,
                            the weights beside the formula, and the collectives counted)
"""
import torch
import torch.distributed as dist


def outer_step(model, outer, outer_optimizer):
    pseudo = [o - p.detach() for o, p in zip(outer, model.parameters())]  # theta_start - theta_end
    # TODO: average the pseudo-gradients over every rank: all-reduce (a sum), then divide.
    for o, g in zip(outer, pseudo):
        o.grad = g
    outer_optimizer.step()
    with torch.no_grad():  # the next round starts from the outer weights, on every replica
        for p, o in zip(model.parameters(), outer):
            p.copy_(o)
