"""Lesson 21's ring attention: causal attention over a sequence that N ranks hold 1/N each.

    ring = Ring(layout, rank, world)     # which tokens each rank holds; bytes and work counted
    out = RingAttention.apply(q, k, v, ring)   # q, k, v: (B, heads, S/N, head_dim), our tokens
    out, lse = merge(out, lse, out_b, lse_b)   # two partial attentions -> one (online softmax)

The layout (Step 2 of the lesson): every sequence of S tokens is cut into 2N chunks of S/2N,
and each rank holds two of them: chunks 2r and 2r+1 (contiguous) or chunks r and 2N-1-r
(balanced). The ring moves keys and values one hop per step; a rank computes attention only
on the tiles (one chunk of queries against one chunk of keys) where some query may see some
key, so causal masking decides each rank's work (Step 4 counts it).

Forward: at each of N hops, start sending the block of keys and values we hold to the next
rank and receiving the previous rank's (dist.batch_isend_irecv), compute on the block we hold
while it travels, then wait. Each tile gives a partial attention and its log-sum-exp; merge()
folds it into the running result, as flash attention does.

Backward (written by hand, as flash attention's): the keys and values go around the ring
again; each rank computes its queries' gradient, and its queries' part of the gradient of the
keys and values it holds. Those parts are summed on the way: an accumulator follows each block
one hop behind, from the first rank it visits to the last, which sends it home: N-1 sends of
dK and dV, as N-1 of K and V.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

KV, GRADS = 0, 1  # message tags: keys and values, and their gradients, travel side by side


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, int]:
    """The two chunks (of 2 x world) of every sequence that `rank` holds."""
    return (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def positions(rank: int, world: int, layout: str, seq: int) -> torch.Tensor:
    """The places in the whole sequence of the tokens `rank` holds, in the order it holds them."""
    size = seq // (2 * world)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, world, layout)])


def spans(pos: torch.Tensor) -> str:
    """'0-7, 24-31' for the positions of two chunks; '0-15' when they touch."""
    pos, out, start = pos.tolist(), [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            out.append(f"{pos[start]}-{pos[i - 1]}")
            start = i
    return ", ".join(out)


def merge(out, lse, out_b, lse_b):
    """Two attentions of the same queries over disjoint sets of keys -> the attention over both.

    out = softmax-weighted values, lse = log of the sum of exp(scores) (one per query). Each
    part counts as much as its share of the probability mass: exp(lse_b - lse_new) of it.
    Working in logs keeps it finite where exp(score) alone would overflow.
    """
    new = torch.logaddexp(lse, lse_b)
    return out * (lse - new).exp() + out_b * (lse_b - new).exp(), new


def attend(q, k, v, hidden):
    """Attention of q over k, v only: (output, log-sum-exp). hidden: scores to mask, or None."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp() @ v, lse


class Ring:
    """This rank's place in the ring, the layout, and what the ring did (bytes, tiles, scores)."""

    def __init__(self, layout: str, rank: int, world: int, seq: int):
        self.layout, self.rank, self.world = layout, rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        self.positions = [positions(r, world, layout, seq) for r in range(world)]
        self.mine = self.positions[rank]
        self.sent = {"forward": 0, "backward": 0}  # bytes this rank sent, by pass
        self.tiles = 0        # tiles of scores computed in forward: this rank's work
        self.score_bytes = 0  # the largest block of scores held at once
        self._tiles: dict = {}  # owner -> its tiles, worked out once

    def pass_on(self, tensor, phase: str, tag: int = KV):
        """Send `tensor` to the next rank, receive the same shape from the previous one.
        Returns at once; call the returned function to wait for what arrives."""
        arriving = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, tag=tag),
                                        dist.P2POp(dist.irecv, arriving, self.prev, tag=tag)])
        self.sent[phase] += tensor.numel() * tensor.element_size()

        def wait():
            for work in works:
                work.wait()
            return arriving
        return wait

    def tiles_of(self, owner: int) -> list:
        """(our query slice, their key slice, mask or None) for each tile of our queries
        against `owner`'s keys where some query may see some key (causal: key place <= query
        place). A tile wholly in the future is skipped; only a tile on the diagonal needs a mask."""
        if owner not in self._tiles:
            half = len(self.mine) // 2
            halves, self._tiles[owner] = (slice(0, half), slice(half, 2 * half)), []
            for qs in halves:
                qp = self.mine[qs]
                for ks in halves:
                    kp = self.positions[owner][ks]
                    if kp.min() <= qp.max():
                        self._tiles[owner].append(
                            (qs, ks, (kp[None, :] > qp[:, None]) if kp.max() > qp.min() else None))
        return self._tiles[owner]


class RingAttention(torch.autograd.Function):
    """Causal attention of our queries over every rank's keys and values, around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = torch.zeros_like(q), q.new_full((*q.shape[:-1], 1), float("-inf"))
        kv = torch.stack([k, v])  # one message per hop: our keys and values
        for hop in range(ring.world):
            owner = (ring.rank - hop) % ring.world  # whose keys we hold at this hop
            if hop < ring.world - 1:
                arriving = ring.pass_on(kv, "forward")  # the next block travels while we compute
            for qs, ks, mask in ring.tiles_of(owner):
                hidden = None if mask is None else mask.to(q.device)
                o, l = attend(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], hidden)
                out[..., qs, :], lse[..., qs, :] = merge(out[..., qs, :], lse[..., qs, :], o, l)
                ring.tiles += 1
                ring.score_bytes = max(ring.score_bytes, l.numel() * (ks.stop - ks.start) * q.element_size())
            if hop < ring.world - 1:
                kv = arriving()
        ctx.save_for_backward(q, k, v, out, lse)  # no scores: backward computes them again
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, q.shape[-1] ** -0.5
        delta = (dout * out).sum(-1, keepdim=True)  # softmax's backward needs sum(dO * O) per query
        dq, kv = torch.zeros_like(q), torch.stack([k, v])
        for hop in range(ring.world):
            owner = (ring.rank - hop) % ring.world
            if hop < ring.world - 1:
                arriving = ring.pass_on(kv, "backward")  # the keys and values go round again
            dkv = torch.zeros_like(kv)  # our queries' part of the gradient of owner's k and v
            for qs, ks, mask in ring.tiles_of(owner):
                s = q[..., qs, :] @ kv[0][..., ks, :].transpose(-2, -1) * scale
                if mask is not None:
                    s = s.masked_fill(mask.to(q.device), float("-inf"))
                p = (s - lse[..., qs, :]).exp()  # the probabilities of forward, recomputed
                dkv[1][..., ks, :] += p.transpose(-2, -1) @ dout[..., qs, :]
                ds = p * (dout[..., qs, :] @ kv[1][..., ks, :].transpose(-2, -1) - delta[..., qs, :])
                dq[..., qs, :] += ds @ kv[0][..., ks, :] * scale
                dkv[0][..., ks, :] += ds.transpose(-2, -1) @ q[..., qs, :] * scale
            if hop == 0:
                own = dkv  # our queries' part of our own keys' gradient stays here
            else:  # the rest travels: an accumulator per block, one hop behind the block
                if hop > 1:
                    dkv += grads()  # owner's gradient from the ranks it visited before us
                grads = ring.pass_on(dkv, "backward", tag=GRADS)
            if hop < ring.world - 1:
                kv = arriving()
        if ring.world > 1:
            own += grads()  # the accumulator of our block, home after visiting every other rank
        dk, dv = own
        return dq, dk, dv, None


def average_gradients(model):
    """The other half of context parallel: every rank holds the whole model, and its loss is
    the mean over its 1/N of the tokens, so the mean of the ranks' gradients is the whole
    batch's. One flat all-reduce (lesson 14's buckets); gloo has ReduceOp.AVG on torch 2.14.1."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))
