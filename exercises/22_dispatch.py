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
    world, rank = dist.get_world_size(), dist.get_rank()
    local = experts // world  # experts per rank
    send = torch.bincount(expert, minlength=experts)  # rows for each expert: given
    # TODO: tell every rank how many rows it will get (the counts), then send the rows.
    mine = expert // local == rank  # below: our own rows for our own experts, nothing else
    recv_counts = torch.zeros_like(send)
    recv_counts[rank * local:(rank + 1) * local] = send[rank * local:(rank + 1) * local]
    return rows[mine], recv_counts
