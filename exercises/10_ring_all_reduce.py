"""Exercise 10: finish the ring all-reduce, for any number of ranks.

Lesson 10 builds all-reduce out of point-to-point messages: the tensor is cut into N
chunks, and N-1 steps of reduce-scatter (each rank adds the chunk arriving from its left
neighbour) are followed by N-1 steps of all-gather (each rank overwrites a chunk with the
finished one arriving from the left). Below, everything is in place except the chunk
numbers: which chunk a rank sends and which it receives at each step. They were written
for 2 ranks, where each phase has a single step, so with 2 ranks the result is right.
With 3 or more it is not.

Your task: make `send_c` and `recv_c` right in both loops, for any N >= 2 and any tensor
size (also sizes that N does not divide, and sizes smaller than N). Keep it a ring: every
rank sends only to its right neighbour, and sends no more than 2(N-1)/N of the tensor.
Hint: lesson 10, Step 3: the picture shows, step by step, which chunk every rank sends and
what each chunk holds afterwards. Which chunk is complete on rank r when reduce-scatter
ends, and so which one must rank r send first in all-gather?

On GPUs (NCCL) post a step's send and receive as one `dist.batch_isend_irecv([...])` of
`dist.P2POp`s, and pass `device_id=` to `init_process_group`: separate isend/irecv calls,
fine on gloo, can deadlock or run one after the other on NCCL for N >= 3.

Check it:  make check-10   (runs 2, 3 and 4 ranks on gloo and compares every result with
                            dist.all_reduce, for tensor sizes 1, N-1, N, N+1, 10 and 1001)
"""
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over all ranks of the default process group, in place, around a ring."""
    n, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % n, (me - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))  # N views into `tensor`, no copies
    scratch = torch.empty_like(chunks[0])           # chunk 0 is never smaller than the others

    for step in range(n - 1):  # reduce-scatter: add the chunk that arrives from the left
        send_c, recv_c = me, (me - 1) % n  # right for 2 ranks only
        inbox = scratch[:chunks[recv_c].numel()]
        # send and receive at the same time, or every rank would wait for the others
        works = [dist.isend(chunks[send_c], right), dist.irecv(inbox, left)]
        for work in works:
            work.wait()
        chunks[recv_c] += inbox

    for step in range(n - 1):  # all-gather: pass the finished chunks on, overwriting
        send_c, recv_c = (me + 1) % n, me  # right for 2 ranks only
        works = [dist.isend(chunks[send_c], right), dist.irecv(chunks[recv_c], left)]
        for work in works:
            work.wait()
