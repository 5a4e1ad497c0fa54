"""Lesson 22's mixture of experts: the layer, its router and capacity rule, the two all-to-alls,
and the one-process run every distributed run must match.

    setup = Setup(seed, experts, top_k, capacity_factor, dtype)
    model = moe_model(setup, rank, world)                       # T's transformer, its MLPs -> MoE
    loss = T.loss_fn(model(x), y) + AUX_COEF * aux_loss(model)  # plus the balancing loss
    train_single(setup, steps)                                  # every expert in one process

The MoE layer is written once, for both: with world=1 it holds every expert and sends nothing;
with world=N, rank r holds experts r*E/N ... (r+1)*E/N - 1 and the tokens travel there and back
through AllToAll. The routing, the capacity and the drops are decided per row (one sequence),
so they do not depend on how many ranks share the batch: see docs/22_expert_parallel.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import ROOT, fail, transformer as T

AUX_COEF = 0.01  # weight of the load-balancing loss (the Switch Transformer's alpha)


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with uneven splits, differentiable: rank r sends in_splits[s] rows
    to rank s and receives out_splits[s] rows from it. Its backward is the same exchange the
    other way round: every gradient goes back to the rank its row came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = out_splits, in_splits
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)  # splits swapped
        return back, None, None


@dataclasses.dataclass(frozen=True)
class Setup:
    """What makes one mixture of experts: the lesson's flags."""
    seed: int
    experts: int        # E, per block
    top_k: int          # experts per token
    factor: float       # the capacity factor
    dtype: str = "float64"

    @classmethod
    def of(cls, args) -> "Setup":
        return cls(args.seed, args.experts, args.top_k, args.capacity_factor, args.dtype)

    @property
    def capacity(self) -> int:
        """Slots per expert and row: a row's SEQ x top_k assignments spread evenly, times the factor."""
        return self.capacity_of(T.SEQ)

    def capacity_of(self, group: int) -> int:
        """Slots per expert for a group of `group` tokens (the lesson's group is one row)."""
        return max(1, math.ceil(self.factor * self.top_k * group / self.experts))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def uniform_drop(self, group: int = T.SEQ) -> float:
        """The share of assignments a perfectly uniform router drops, expected, exactly: each
        token's k experts drawn at random, an expert's assignments in a group of `group`
        tokens are X ~ Binomial(group, k/E), and past its capacity C it drops max(0, X - C):
        E x E[max(0, X - C)] / (k x group). The group is a row (T.SEQ) here; C grows with it."""
        cap = self.capacity_of(group)
        p = self.top_k / self.experts  # the chance that one expert is among a token's k

        def chance(x: int) -> float:  # P(X = x), in logs: comb(1536, 768) overflows a float
            if p == 1.0:
                return float(x == group)
            return math.exp(math.lgamma(group + 1) - math.lgamma(x + 1) - math.lgamma(group - x + 1)
                            + x * math.log(p) + (group - x) * math.log1p(-p))
        over = sum((x - cap) * chance(x) for x in range(cap + 1, group + 1))
        return self.experts * over / (self.top_k * group)


class MoE(nn.Module):
    """E experts shaped like T.MLP and a router; this rank holds experts[first : first + E/N]."""

    def __init__(self, setup: Setup, block: int, rank: int = 0, world: int = 1):
        super().__init__()
        self.E, self.k, self.cap, self.world = setup.experts, setup.top_k, setup.capacity, world
        self.local = setup.experts // world
        self.first = rank * self.local
        torch.manual_seed(setup.seed * 1000 + block)  # the same router on every rank
        self.router = nn.Linear(T.DIM, self.E, bias=False)
        self.experts = nn.ModuleDict()  # keyed by the global index: the same names in one process
        for e in range(self.first, self.first + self.local):
            torch.manual_seed(setup.seed * 1000 + 100 * (block + 1) + e)  # expert e: the same weights anywhere
            self.experts[str(e)] = T.MLP()

    def route(self, x):
        """Each token's top-k experts and their weights; which of those assignments fit (keep).
        All in (rows, k, SEQ) order: per row, every token's first choice, then the second ones."""
        probs = self.router(x).softmax(-1)                      # (B, S, E)
        weight, expert = probs.topk(self.k, dim=-1)             # (B, S, k)
        # k > 1, as GShard and Mixtral: the k chosen weights renormalized to sum to 1. k = 1, as the
        # Switch Transformer: the probability itself (renormalized it would always be 1, and the
        # main loss would teach the router nothing)
        if self.k > 1:
            weight = weight / weight.sum(-1, keepdim=True)
        weight, expert = weight.transpose(1, 2), expert.transpose(1, 2)  # (B, k, S)
        onehot = F.one_hot(expert.flatten(1), self.E)           # (B, k*S, E)
        slot = (onehot.cumsum(1) * onehot).sum(-1) - 1          # place in its expert's queue, this row
        keep = (slot < self.cap).view_as(expert)                # the first `cap` of each queue fit
        # Switch Transformer's balancing loss, per row: E * sum_e f_e * P_e (1 when perfectly even)
        f = onehot.to(probs.dtype).mean(1)                      # share of the row's assignments per expert
        self.aux = self.E * (f * probs.mean(1)).sum(-1).mean()
        return weight, expert, keep

    def forward(self, x):
        B, S, D = x.shape
        weight, expert, keep = self.route(x)  # (B, k, S) each
        token = torch.arange(B * S, device=x.device).view(B, 1, S).expand_as(expert)
        routed = torch.bincount(expert.flatten(), minlength=self.E)  # before the capacity
        # The assignments that fit, sorted by expert, so by the rank that holds it (stable: in order)
        fit = keep.flatten().nonzero().squeeze(1)
        fit = fit[expert.flatten()[fit].argsort(stable=True)]
        expert, token, weight = expert.flatten()[fit], token.flatten()[fit], weight.flatten()[fit]
        send = torch.bincount(expert, minlength=self.E)  # rows for each expert
        self.counts = torch.stack([send, routed - send])  # kept and dropped, per expert
        rows = x.reshape(B * S, D)[token]  # one row per assignment (a token picked twice: twice)
        recv = send
        if self.world > 1:
            # 1. The split sizes: to each rank, E/N counts (how many rows for each of its experts)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            to_rank = send.view(self.world, -1).sum(1).tolist()
            from_rank = recv.view(self.world, -1).sum(1).tolist()
            # 2. Dispatch: every row to the rank of its expert
            rows = AllToAll.apply(rows, from_rank, to_rank)
        # 3. Compute: what arrived is ordered by source rank, then by our expert. Group the rows
        # by expert (stable: source rank 0's first), run each expert once, undo the grouping
        which = torch.arange(self.local, device=x.device).repeat(self.world).repeat_interleave(recv)
        order = which.argsort(stable=True)
        sizes = recv.view(self.world, self.local).sum(0).tolist()
        out = torch.cat([self.experts[str(self.first + j)](chunk)
                         for j, chunk in enumerate(rows[order].split(sizes))])[order.argsort()]
        if self.world > 1:
            # 4. Combine: every result back to the rank its row came from, in the order it was sent
            out = AllToAll.apply(out, to_rank, from_rank)
        # 5. Weight by the router and add up per token. A dropped assignment adds nothing: the
        # block's residual connection carries its token on unchanged
        y = torch.zeros_like(x.reshape(B * S, D)).index_add(0, token, out * weight[:, None])
        return y.view(B, S, D)


def moe_model(setup: Setup, rank: int = 0, world: int = 1) -> nn.Module:
    """Lesson 13's transformer (same seed, same attention and embeddings) with each block's MLP
    replaced by an MoE layer holding this rank's experts, in setup.dtype (float64 by default:
    see the doc, a routing decision is a cliff that float32's rounding can push a token over)."""
    model = T.make_model(setup.seed)
    for i, block in enumerate(model.blocks):
        block.mlp = MoE(setup, i, rank, world)
    return model.to(setup.torch_dtype)


def aux_loss(model) -> torch.Tensor:
    return sum(block.mlp.aux for block in model.blocks)


def counts(model) -> torch.Tensor:
    """(blocks, 2, E): tokens kept per expert and assignments dropped, for the last forward."""
    return torch.stack([block.mlp.counts for block in model.blocks])


def evaluate(model, batches, reduce=lambda t: t) -> tuple[float, float]:
    """Held-out loss and next-token accuracy over `batches` [(x, y)], summed by `reduce`."""
    total = torch.zeros(2)
    with torch.no_grad():
        for x, y in batches:
            logits = model(x)
            total += torch.stack([T.loss_fn(logits, y), (logits.argmax(-1) == y).float().mean()])
    total = reduce(total) / len(batches)
    return total[0].item(), total[1].item()


def gather_state(model, world: int) -> dict:
    """The whole model's weights under the one-process names: the shared ones are the same on
    every rank; the experts come from the ranks that hold them."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    every: list = [None] * world
    dist.all_gather_object(every, {k: v for k, v in state.items() if ".experts." in k})
    for part in every:
        state.update(part)
    return state


def _train(setup: Setup, steps: int) -> dict:
    seed = setup.seed
    model = moe_model(setup)
    optimizer = T.make_optimizer(model)
    losses, seen = [], []
    for step in range(steps):
        x, y = T.batch(step, seed)
        loss = T.loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        (loss + AUX_COEF * aux_loss(model)).backward()
        optimizer.step()
        losses.append(loss.item())
        seen.append(counts(model))
    held_out, accuracy = evaluate(model, [T.batch(steps + i, seed) for i in range(8)])
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": torch.tensor(losses, dtype=torch.float64), "counts": torch.stack(seen),
            "held_out": torch.tensor([held_out, accuracy], dtype=torch.float64)}


def reference_path(setup: Setup, steps: int) -> Path:
    """Where train_single caches its answer: keyed by the arguments and the sources."""
    source = hashlib.sha256(Path(__file__).read_bytes() + Path(T.__file__).read_bytes()).hexdigest()[:12]
    s = setup
    return ROOT / "runs" / "reference-22" / (f"seed{s.seed}-steps{steps}-E{s.experts}-k{s.top_k}-"
                                             f"C{s.factor:g}-{s.dtype}-{source}.pt")


def train_single(setup: Setup, steps: int) -> dict:
    """The same MoE model trained in one process, every expert local: {"state", "losses",
    "counts" (steps, blocks, 2, E), "held_out" (loss, accuracy)}. Computed once on one CPU
    thread and cached at reference_path(...), written atomically, as T.train_reference caches
    lesson 13's."""
    path = reference_path(setup, steps)
    if path.exists():
        try:
            return torch.load(path, weights_only=True)
        except Exception:  # a damaged cache file: compute it again
            pass
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _train(setup, steps)
    finally:
        torch.set_num_threads(threads)
    T.keep_cached(path, result, path.name[-16:])  # answers of older sources go; a read-only checkout keeps none
    return result


def train_baselines(args) -> tuple[dict, list]:
    """({Setup: train_single's answer}, [the Setups trained now]) for this run's flags and the
    capacity factors 1.0 and 2.0 (Step 11): those not cached yet are computed at once, one
    process each (the lessons' spawn, without a process group), so that two cores do two runs;
    the others are read from the cache."""
    from common.distributed import spawn

    setups = [dataclasses.replace(Setup.of(args), factor=f) for f in sorted({1.0, 2.0, args.capacity_factor})]
    todo = [s for s in setups if not reference_path(s, args.steps).exists()]
    if todo:
        spawn(_baseline, (todo, args.steps), len(todo))
    return {s: train_single(s, args.steps) for s in setups}, todo


def _baseline(i: int, todo: list, steps: int) -> None:
    train_single(todo[i], steps)


def add_flags(parser) -> None:
    from common.cli import positive_float, positive_int

    parser.add_argument("--experts", type=positive_int, default=4,
                        help="experts per block (E); each rank holds E / world size of them")
    parser.add_argument("--top-k", type=positive_int, default=1,
                        help="experts per token (k): 1 as in the Switch Transformer (the weight is "
                             "the router's probability); 2 or more as in GShard and Mixtral (the k "
                             "weights renormalized to sum to 1)")
    parser.add_argument("--capacity-factor", type=positive_float, default=1.0,
                        help="slots per expert and row = factor x k x tokens per row / E, rounded up")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="float32 lets rounding send a token to another expert now and then "
                             "(docs/22_expert_parallel.md, Going further)")


EXPERTS_MEMORY = 2 << 30  # bytes: what --experts may ask of a laptop in Step 1's one process


def check_flags(args):
    """One line and exit 2, before any process starts: k at most E, and the world size splits
    the batch's rows and the experts evenly (Part 2's one rule, common/transformer.py)."""
    # Step 1 trains every expert in one process: each expert's weights (T.MLP and its router
    # column), their gradients and AdamW's two states, in --dtype, in every block. Bounded
    # here, not by the allocator (--experts 100000000 died asking for 25.6 GB).
    itemsize = 8 if args.dtype == "float64" else 4
    per_expert = T.N_BLOCKS * (2 * T.DIM * T.MLP_DIM + T.MLP_DIM + T.DIM + T.DIM) * 4 * itemsize
    most = EXPERTS_MEMORY // per_expert
    if args.experts > most:
        fail(f"--experts {args.experts} would need {args.experts * per_expert / 2**30:,.1f} GiB in "
             f"one process (Step 1 trains every expert there: weights, gradients and AdamW's state, "
             f"{args.dtype}); this lesson takes up to {most:,} ({EXPERTS_MEMORY / 2**30:g} GiB), e.g. --experts 8")
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} is more than the {args.experts} experts: a token picks k "
             f"different experts; use 1 to {args.experts}")
    T.check_world_size(args.world_size, "--world-size", divides={f"{args.experts} experts": args.experts})
    return args
