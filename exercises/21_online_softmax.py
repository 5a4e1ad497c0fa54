"""Exercise 21: merge two partial attentions, the online-softmax rule of ring attention.

In lesson 21's ring, a rank never holds every key at once: at each hop it computes the
attention of its queries over one block of keys only. For each query that gives two things:

    out = softmax(scores over the block) @ values of the block     (B, heads, queries, head_dim)
    lse = log(sum(exp(scores over the block)))                     (B, heads, queries, 1)

merge(out, lse, out_b, lse_b) must turn the results over two disjoint blocks of keys into the
result over both: the attention output over all their keys, and its lse (so that the next
block can be merged in the same way). The ring starts from out = 0, lse = -inf ("no keys yet").

Below, merge() averages the two outputs and keeps the larger lse: right only when both blocks
happen to hold the same share of the softmax. Make it right for any two blocks, and keep it
finite where scores are large (exp of anything above about 88.7 overflows float32).
Hint: lesson 21, Step 3, and docs/21_context_parallel.md (online softmax).

Check it:  make check-21   (your merge over blocks of keys against softmax over all of them,
                            with large scores too, then inside lesson 21's ring on 2 and 4
                            ranks against F.scaled_dot_product_attention)
"""
import torch


def merge(out, lse, out_b, lse_b):
    """The attention over the keys of both parts, and its log-sum-exp."""
    return (out + out_b) / 2, torch.maximum(lse, lse_b)
