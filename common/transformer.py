"""The Part 2 recipe: a small decoder-only transformer, its data, and its reference.

Lesson 13 trains it on one device; lessons 14-20 train it in parallel and must end with
lesson 13's weights (within 1e-3, printed beside the floor that float rounding alone sets).

    from common import transformer as T
    model = T.make_model(seed)                 # Transformer, same weights for the same seed
    optimizer = T.make_optimizer(model)        # AdamW(lr=1e-2, eps=1e-5)
    x, y = T.batch(step, seed)                 # (GLOBAL_BATCH, SEQ) int64 tokens and targets
    x, y = T.shard(x, rank, world), T.shard(y, rank, world)   # rank r's contiguous rows
    loss = T.loss_fn(model(x), y)              # mean cross-entropy over every token
    T.floor_gap(loss)                          # "+0.0374 from the floor 0.7809 ..." to print
    T.train_reference(seed, steps, chunks=N)   # {"state": final weights, "losses": tensor}

and what every Part 2 lesson measures against lesson 13, written once (lesson 13 shows each
inline first):

    held_out, accuracy = T.evaluate(model, steps, seed, device)   # lesson 13's Step 5
    compared = T.compare_with_lesson_13(state, seed, steps, chunks=N)  # the two metrics keys
    T.weights_gap(compared)                    # "max |w - w_13| = 3.1e-06 (floor ...)" to print
    T.mean_over_ranks(losses)                  # the global batch's loss from the ranks' means

Parameter names let tensor parallelism split by name: tok_emb, pos_emb, blocks.<i>.{norm1,
attn.{q, k, v, proj}, norm2, mlp.{fc, proj}}, norm, head (q, k, v are separate, so a column
split gives each rank whole heads). model.blocks is an nn.ModuleList: FSDP2 wraps each block,
a pipeline stage keeps a slice, and forward skips tok_emb/pos_emb and head when a stage has
set them to None. The data is an order-2 Markov chain over VOCAB tokens with a fixed table;
loss_floor() is the best expected loss any model can reach on our batches. A step's batch
depends on (step, seed) only; its 48 rows divide by 1, 2, 3 and 4, so equal shards make the
mean of the ranks' mean losses the global mean.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import ROOT, fail, max_abs_diff

SEED = 0              # initial weights and the batches
STEPS = 120           # optimizer steps
GLOBAL_BATCH = 48     # sequences per optimizer step, summed over all ranks
SEQ = 32              # tokens of context per sequence (divides by 1, 2 and 4)
LR = 1e-2             # AdamW learning rate (weight_decay is AdamW's default, 0.01)
EPS = 1e-5            # AdamW epsilon: see make_optimizer
VOCAB = 8             # distinct tokens
DIM = 64              # model width
N_HEADS = 4           # attention heads (divides by 1, 2 and 4)
HEAD_DIM = DIM // N_HEADS
N_BLOCKS = 2          # transformer blocks
MLP_DIM = 4 * DIM     # hidden width of each block's MLP
TABLE_SEED = 1234     # fixed: the Markov chain never changes, only --seed does
SHARPNESS = 3.0       # larger: more predictable next tokens, a lower floor


# --- the model -----------------------------------------------------------------------

class Attention(nn.Module):
    """Causal multi-head self-attention, from plain Linear layers (easy to split by head)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds N_HEADS / tp of them
        q, k, v = (lin(x).view(B, T, -1, HEAD_DIM).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, HEAD_DIM)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(DIM, MLP_DIM), nn.Linear(MLP_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token + position embeddings, N_BLOCKS blocks, a final LayerNorm, the LM head.

    No dropout (it would draw different masks per rank). The head does NOT share the
    embedding's weight (no weight tying): pipeline parallelism (lesson 18) puts the
    embedding on the first stage and the head on the last, which a shared tensor forbids.
    """

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # a later pipeline stage receives activations instead
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


# FSDP2 warns when a wrapped module returns a view (torch 2.14.1): an in-place change of that
# view would skip its pre-backward hook. Transformer's logits are one (nn.Linear on a 3-D input
# returns a view), and no lesson changes them in place, so that one warning is silenced here,
# in every process that imports the model: each rank, however it was started.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def make_model(seed: int = SEED) -> Transformer:
    """The same seed gives the same initial weights in every process."""
    torch.manual_seed(seed)
    return Transformer()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with eps=1e-5 (as LLaMA trained), not torch's 1e-8. Adam divides each step by
    sqrt(exp_avg_sq) + eps; where a gradient is tiny, eps=1e-8 turns float rounding into
    large steps. Measured on this recipe: the same batch summed in 2 or 4 chunks ended
    3e-3 to 1e-2 away from the full batch with eps=1e-8, and about 1e-5 away with 1e-5."""
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch (or of a rank's equal shard)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --- the data --------------------------------------------------------------------------

def transition_table() -> torch.Tensor:
    """P[a, b, c] = probability that token c follows the pair (a, b); float64, fixed."""
    g = torch.Generator().manual_seed(TABLE_SEED)
    logits = torch.randn(VOCAB, VOCAB, VOCAB, generator=g, dtype=torch.float64) * SHARPNESS
    return logits.softmax(-1)


def stationary_pairs(P: torch.Tensor) -> torch.Tensor:
    """pi[a, b]: how often the pair (a, b) occurs in a long sequence (pi M = pi, sum 1)."""
    V = P.shape[0]
    M = torch.zeros(V * V, V * V, dtype=torch.float64)  # pair (a, b) -> pair (b, c)
    a, b, c = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    M[(a * V + b).flatten(), (b * V + c).flatten()] = P.flatten()
    A = M.T - torch.eye(V * V, dtype=torch.float64)
    A[-1] = 1.0  # replace one (redundant) equation by "the probabilities sum to 1"
    rhs = torch.zeros(V * V, dtype=torch.float64)
    rhs[-1] = 1.0
    return torch.linalg.solve(A, rhs).view(V, V)


def entropy_rate(P: torch.Tensor | None = None) -> float:
    """H(next | previous two) under the stationary pairs, in nats per token."""
    P = transition_table() if P is None else P
    pi = stationary_pairs(P)
    return float(-(pi * (P * P.log()).sum(-1)).sum())


def loss_floor() -> float:
    """The best expected loss_fn on our batches: each row starts from a stationary pair, so
    target 1 has one token of context (H(X1 | X0)) and targets 2..SEQ have two (the rate)."""
    P = transition_table()
    pi = stationary_pairs(P)
    p0 = pi.sum(1)  # marginal of one token
    h1 = float(-(pi * pi.log()).sum() + (p0 * p0.log()).sum())  # H(X0, X1) - H(X0)
    return (h1 + (SEQ - 1) * entropy_rate(P)) / SEQ


_CDF: dict[str, torch.Tensor] = {}


def batch(step: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: (inputs, targets), each (GLOBAL_BATCH, SEQ) int64 on the CPU.

    A function of (step, seed) only, so every rank can draw it and keep its shard.
    """
    if not _CDF:
        P = transition_table()
        _CDF["pair"] = stationary_pairs(P).flatten().cumsum(0)
        _CDF["next"] = P.cumsum(-1)
    # torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so seed * 2**32
    # + step would repeat across seeds: hash (seed, step) into 32 bits instead
    key = hashlib.sha256(f"transformer-batch {seed} {step}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))
    u = torch.rand(SEQ, GLOBAL_BATCH, 1, generator=g, dtype=torch.float64)  # one draw per token
    pair = torch.searchsorted(_CDF["pair"], u[0]).clamp(max=VOCAB * VOCAB - 1)[:, 0]
    tokens = [pair // VOCAB, pair % VOCAB]
    for t in range(2, SEQ + 1):
        cdf = _CDF["next"][tokens[-2], tokens[-1]]  # (B, VOCAB)
        tokens.append(torch.searchsorted(cdf, u[t - 1]).clamp(max=VOCAB - 1)[:, 0])
    seq = torch.stack(tokens, 1)  # (B, SEQ + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def shard(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a global batch: rows [rank*n, (rank+1)*n), n = B/world."""
    n = rows.shape[0] // world
    assert n * world == rows.shape[0], f"{rows.shape[0]} rows do not split into {world}"
    return rows[rank * n:(rank + 1) * n]


def check_world_size(n: int, named: str, most: int = 8, divides: dict[str, int] | None = None,
                     splits_batch: bool = True) -> None:
    """The one world-size rule of Part 2: at most `most` ranks on one machine, and n splits
    what the ranks share out: the GLOBAL_BATCH rows (data parallel; splits_batch=False where
    every rank sees every row, as in tensor, pipeline and context parallel) and whatever
    `divides` names, e.g. {"4 attention heads": N_HEADS}. One line and exit 2 otherwise."""
    needs = {**({f"global batch of {GLOBAL_BATCH} rows": GLOBAL_BATCH} if splits_batch else {}),
             **(divides or {})}
    if n < 1 or n > most or any(size % n for size in needs.values()):
        ok = [str(d) for d in range(1, most + 1) if all(size % d == 0 for size in needs.values())]
        fail(f"{named} must divide the {' and the '.join(needs)} and be at most {most} "
             f"on one machine: use one of {', '.join(ok)}")


# --- the single-process reference ------------------------------------------------------

def _train(seed: int, steps: int, chunks: int) -> dict[str, torch.Tensor]:
    model = make_model(seed)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = batch(step, seed)
        optimizer.zero_grad(set_to_none=True)
        if chunks == 1:  # op for op lesson 13's loop
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
        else:  # the same batch, summed in `chunks` pieces: what N ranks compute, in one process
            total = 0.0
            for r in range(chunks):
                part = loss_fn(model(shard(x, r, chunks)), shard(y, r, chunks)) / chunks
                part.backward()
                total += part.item()
            losses.append(total)
        optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "losses": torch.tensor(losses, dtype=torch.float64)}


def train_reference(seed: int = SEED, steps: int = STEPS, chunks: int = 1) -> dict:
    """The single-process answer: {"state": final weights, "losses": per-step losses}.

    chunks=1 is lesson 13's run exactly (tests/test_lesson_13.py checks it bit for bit).
    chunks=N sums the same batches in N pieces, as N ranks do: float rounding alone moves its
    weights a little from chunks=1 (AdamW magnifies rounding: see make_optimizer), so a run on
    N ranks is compared within 1e-3 and prints this floor beside its own difference.
    Computed on the CPU with one thread, once: cached in runs/reference-13/ (keyed by the
    arguments and this file's source), written atomically, read with weights_only=True.
    """
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    path = ROOT / "runs" / "reference-13" / f"seed{seed}-steps{steps}-chunks{chunks}-{source}.pt"
    if path.exists():
        try:
            return torch.load(path, weights_only=True)
        except Exception:  # a damaged cache file: compute it again
            pass
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise reproducible, and fast when other processes share the cores
    try:
        result = _train(seed, steps, chunks)
    finally:
        torch.set_num_threads(threads)
    keep_cached(path, result, f"-{source}.pt")  # references of an older recipe go
    return result


def keep_cached(path: Path, result: dict, current: str) -> None:
    """Write `result` to the cache file `path` atomically (a parallel reader sees no file or
    the whole file) and delete the folder's .pt files not ending in `current` (of an older
    source: never read again). Where the repository cannot be written (a read-only checkout,
    a classroom's shared copy) nothing is kept: the run goes on, and computes it again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, tmp)
        os.replace(tmp, path)
        for old in path.parent.glob("*.pt"):
            if not old.name.endswith(current):
                old.unlink(missing_ok=True)
    except (OSError, RuntimeError):  # (torch.save reports a full disk as a RuntimeError)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def floor_gap(loss: float) -> str:
    """'+0.0123 from the floor 0.7809 nats/token (entropy rate 0.7551)', for a loss."""
    floor = loss_floor()
    return f"{loss - floor:+.4f} from the floor {floor:.4f} nats/token (entropy rate {entropy_rate():.4f})"


# --- what every Part 2 lesson measures against lesson 13 ----------------------------------

HELD_OUT_BATCHES = 8  # the batches right after the training ones: no step trained on them


def evaluate(forward, steps: int, seed: int, device, positions=None) -> tuple[float, float]:
    """Lesson 13's Step 5, as every Part 2 lesson runs it: the mean loss_fn and next-token
    accuracy of forward(x) (a model, or any callable giving logits) over the HELD_OUT_BATCHES
    batches after the `steps` training ones. positions: the token positions this rank holds
    (context parallel, lesson 21), None for whole rows. This rank's numbers: where ranks see
    different tokens, mean_over_ranks gives the whole batch's."""
    held_out, accuracy = 0.0, 0.0
    with torch.no_grad():
        for i in range(HELD_OUT_BATCHES):
            x, y = batch(steps + i, seed)
            if positions is not None:
                x, y = x[:, positions], y[:, positions]
            y = y.to(device)
            logits = forward(x.to(device))
            held_out += loss_fn(logits, y).item() / HELD_OUT_BATCHES
            accuracy += (logits.argmax(-1) == y).float().mean().item() / HELD_OUT_BATCHES
    return held_out, accuracy


def mean_over_ranks(values: list[float]) -> list[float]:
    """Each rank's loss is the mean over its equal share of the batch, so the batch's loss is
    the mean of the ranks' (summed in float64, in rank order by the all-reduce)."""
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def compare_with_lesson_13(state: dict, seed: int, steps: int, chunks: int) -> dict:
    """How far a parallel run's final weights are from lesson 13's, and the floor for it:
    lesson 13's run with each batch summed in `chunks` pieces, as the ranks (or micro-batches)
    sum it, where float rounding alone moves the weights (train_reference). The two keys
    every Part 2 lesson's metrics.json carries."""
    reference = train_reference(seed, steps)["state"]
    floor = max_abs_diff(train_reference(seed, steps, chunks=chunks)["state"], reference)
    return {"max_abs_diff_vs_single_device": max_abs_diff(state, reference),
            "max_abs_diff_floor": floor, "floor_chunks": chunks}


def weights_gap(compared: dict) -> str:
    """'max |w - w_13| = 3.1e-06 (floor 2.9e-06: lesson 13 summing each batch in 2 chunks;
    allowed 1e-3)', from compare_with_lesson_13, to print."""
    return (f"max |w - w_13| = {compared['max_abs_diff_vs_single_device']:.1e} (floor "
            f"{compared['max_abs_diff_floor']:.1e}: lesson 13 summing each batch in "
            f"{compared['floor_chunks']} chunks; allowed 1e-3)")
