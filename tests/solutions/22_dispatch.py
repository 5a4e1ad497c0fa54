"""Exercise 22: send each token to the rank of its expert, with two all-to-alls.

Lesson 22 splits E experts over N ranks: rank r holds experts r*E/N ... (r+1)*E/N - 1. After
routing, every rank holds some rows (one per token and chosen expert), sorted by expert, so
sorted by the rank that holds the expert. dispatch() must deliver them:

    rows    (m, D)  this rank's rows, sorted by expert
    expert  (m,)    the expert (global index, 0 ... E-1) of each row, sorted
    returns (received, recv_counts):
        received     every row sent to one of our experts, from every rank: rank 0's rows
                     first, then rank 1's, ..., each rank's in the order it sent them
        recv_counts  (E,) int64: recv_counts[s * E/N + j] = rows rank s sent to our j-th expert

dist.all_to_all_single(out, rows, output_split_sizes, input_split_sizes) sends input_split_sizes[s]
rows to rank s and receives output_split_sizes[s] rows from it; the splits may differ from rank
to rank. But a rank cannot allocate `out`, nor know its output_split_sizes, before the others
tell it how much is coming: exchange the counts first (a first, small all_to_all_single of
E/N counts to each rank), then the rows.

Below, each rank only keeps its own rows for its own experts: nothing leaves the rank, and
nothing arrives. Make it send.
Hint: lesson 22, moe.py's MoE.forward (steps 1 and 2), and docs/22_expert_parallel.md, Step 5.

Check it:  make check-22   (2 and 4 gloo ranks, uneven splits and empty ones, every row
                            checked where it lands, and the collectives counted)
"""
import torch
import torch.distributed as dist


def dispatch(rows: torch.Tensor, expert: torch.Tensor, experts: int):
    world = dist.get_world_size()
    send = torch.bincount(expert, minlength=experts)  # rows for each expert: given
    recv_counts = torch.empty_like(send)
    dist.all_to_all_single(recv_counts, send)  # E/N counts to each rank, E/N from each
    to_rank = send.view(world, -1).sum(1).tolist()  # input_split_sizes
    from_rank = recv_counts.view(world, -1).sum(1).tolist()  # output_split_sizes
    received = rows.new_empty(sum(from_rank), rows.shape[1])
    dist.all_to_all_single(received, rows.contiguous(), from_rank, to_rank)
    return received, recv_counts
