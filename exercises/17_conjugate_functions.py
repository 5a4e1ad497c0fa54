"""Exercise 17: write f and g, the two conjugate functions of tensor parallelism.

Lesson 17 splits an MLP across ranks as Megatron-LM does: each rank holds some rows of the
first Linear (column-parallel) and the matching columns of the second (row-parallel), so it
computes a partial output that must be summed over the ranks. Two autograd functions make
that right in forward *and* backward:

    f: identity in forward, all-reduce (sum) in backward   (where the input enters)
    g: all-reduce (sum) in forward, identity in backward   (where the partial outputs leave)

Below, both are plain identities: every rank's output is only its part, and the gradient of
the input is only its part too. Make them the real f and g (torch.distributed.all_reduce sums
in place: work on a copy, autograd may have saved the tensor you were given).
Hint: lesson 17, Step 3 (Comm and PAIRS), and docs/17_tensor_parallel.md.

Check it:  make check-17   (an MLP split over 2 and 4 ranks on gloo, its output and every
                            gradient compared with one process, its collectives counted)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


class F_(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class G_(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def parallel_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias):
    """This rank's share of proj(gelu(fc(x))): fc_weight/fc_bias are our rows of fc (column-
    parallel), proj_weight our matching columns of proj (row-parallel); proj_bias is whole."""
    h = F.gelu(F.linear(F_.apply(x), fc_weight, fc_bias))
    return G_.apply(F.linear(h, proj_weight)) + proj_bias  # the bias once, after the sum
