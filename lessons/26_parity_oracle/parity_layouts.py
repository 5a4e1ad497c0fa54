"""Lesson 26's layouts: lesson 13's model split four ways, as lessons 14, 15, 17 and 21 split
it, each with the bugs learners really make written beside the right line.

    run = build(layout, model, rank, world, bug)   # a Layout: how this rank trains `model`
    loss = train_step(run, optimizer, x, y, recorder, step)   # lesson 13's step, on our share

    ddp   torch's DistributedDataParallel (lesson 14): rank r trains rows [r B/N, (r+1) B/N)
    fsdp  fully_shard on every block and the root (lesson 15): the same rows, sharded weights
    tp    Megatron's tensor + sequence parallel by hand (lesson 17's f and g): every rank reads
          every row; heads and MLP units split, norms on 1/N of the tokens
    cp    ring attention (lesson 21, contiguous chunks): every rank holds 1/N of every sequence

BUGS: name -> the layouts it applies to, and what the mistake is. A bug may name where it is
(Bug.where: one layer, one norm, one rank); without it, it is everywhere it can be.
"""
from __future__ import annotations

import functools
import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ring_attention  # lesson 21's ring (lessons/21_context_parallel/)
import tensor_parallel  # lesson 17's collectives (lessons/17_tensor_parallel/)
from common import transformer as T

LAYOUTS = ("ddp", "fsdp", "tp", "cp")
BUGS = {
    "grad-sum": (("ddp", "cp"), "gradients summed over the ranks, not averaged"),
    "data-shift": (("ddp", "fsdp", "cp"), "the last rank reads its rows one row on (an off-by-one)"),
    "tp-bias": (("tp",), "a row-parallel layer adds its bias on every rank, before the sum"),
    "sp-norm": (("tp",), "the sequence-parallel LayerNorms' gradients are not summed over the ranks"),
    "cp-positions": (("cp",), "every rank numbers its tokens' positions from 0"),
}
TOKENS = {"tp": T.SEQ, "cp": T.SEQ // 2}  # what the world size must divide besides the heads / rows


@dataclass(frozen=True)
class Bug:
    name: str | None = None   # a key of BUGS, or None: no bug
    where: str | None = None  # one layer ("blocks.1.mlp.proj"), norm ("blocks.0.norm2") or rank ("1")

    def at(self, name: str, place: str) -> bool:
        """Is this the bug `name`, and is it at `place` (or everywhere)?"""
        return self.name == name and self.where in (None, place)


@dataclass
class Layout:
    """How this rank trains lesson 13's model under one layout."""
    name: str
    model: torch.nn.Module                # lesson 13's module tree (split): hooked, stepped, saved
    forward: Callable                     # this rank's input -> this rank's logits
    rows: Callable = lambda x, y: (x, y)  # a global batch -> this rank's share of it
    after_backward: Callable = lambda: None  # the gradient sync the layout does by hand
    about: str = ""
    extra: dict = field(default_factory=dict)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """T.loss_fn without its .float() (kept there for bf16 autocast): in the float64 twin, a
    cast to float32 would round like float32 and hide part of the twin's own rounding."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(run: Layout, optimizer, x, y, recorder=None, step: int | None = None) -> float:
    """Lesson 13's step on this rank's share of the batch (x, y); with a recorder, this step's
    forward outputs and synced gradients are recorded as `step`."""
    x, y = run.rows(x, y)
    with recorder.forward(step) if recorder is not None else nullcontext():
        logits = run.forward(x)
    loss = loss_fn(logits, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.after_backward()
    if recorder is not None:
        recorder.gradients(step)
    optimizer.step()
    return loss.item()


def chunked_step(model, optimizer, x, y, chunks: int, recorder=None, step: int | None = None) -> float:
    """Lesson 13's step with the batch summed in `chunks` pieces in one process, as
    T.train_reference(chunks=N) does (the floor lessons 14-24 print for weights); with a
    recorder, each chunk's outputs are recorded (parity_oracle.join_chunks joins them)."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for r in range(chunks):
        with recorder.forward(step) if recorder is not None else nullcontext():
            logits = model(T.shard(x, r, chunks))
        part = loss_fn(logits, T.shard(y, r, chunks)) / chunks
        part.backward()
        total += part.item()
    if recorder is not None:
        recorder.gradients(step)
    optimizer.step()
    return total


def one_process(model) -> Layout:
    """Lesson 13 itself: the whole batch, the whole model, nothing to sync."""
    return Layout("one process", model, model, about="one process, the whole batch")


# --- data parallel: ddp and fsdp ------------------------------------------------------------

def shifted(bug: Bug, rank: int, world: int) -> bool:
    """Does this rank read the batch one row on (data-shift: the last rank, or bug.where)?"""
    return bug.name == "data-shift" and rank == (world - 1 if bug.where is None else int(bug.where))


def data_rows(rank: int, world: int, bug: Bug) -> Callable:
    """Rank r's rows of each global batch; with data-shift, one rank reads one row on."""
    off_by_one = shifted(bug, rank, world)

    def rows(x, y):
        if off_by_one:  # the mistake: it starts at rank * n + 1; its last row is the next rank's first
            x, y = x.roll(-1, 0), y.roll(-1, 0)
        return T.shard(x, rank, world), T.shard(y, rank, world)
    return rows


def allreduce_without_mean(state, bucket):
    """A DDP comm hook that sums: torch's allreduce_hook divides the bucket by the world size
    first, and register_comm_hook's docstring warns that the hook must do it itself."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def ddp(model, rank, world, bug, device) -> Layout:
    wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if bug.name == "grad-sum":
        wrapped.register_comm_hook(None, allreduce_without_mean)  # right: dist's default hook
    return Layout("ddp", model, wrapped, data_rows(rank, world, bug),
                  about=f"torch DDP: each rank {T.GLOBAL_BATCH // world} of the {T.GLOBAL_BATCH} rows, gradients averaged in backward",
                  extra={"wrapped": wrapped})


def fsdp(model, rank, world, bug, device) -> Layout:
    mesh = dist.init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Layout("fsdp", model, model, data_rows(rank, world, bug),
                  about=f"FSDP2: each rank {T.GLOBAL_BATCH // world} of the rows and 1/{world} of every weight (DTensor Shard(0))")


# --- tensor + sequence parallel, by hand (lesson 17) -----------------------------------------

class Comm(torch.autograd.Function):
    """Lesson 17's: y = fwd(x) in forward, and grad_x = bwd(grad_y) in backward."""
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad.contiguous()), None, None


ENTER = (tensor_parallel.all_gather, tensor_parallel.reduce_scatter)  # f: our tokens -> all of them
LEAVE = (tensor_parallel.reduce_scatter, tensor_parallel.all_gather)  # g: partial sums -> our tokens' sum


def row_parallel(lin, bias_on_every_rank: bool, h):
    """A row-parallel Linear: our columns of the weight times our units, summed over the ranks
    (to our tokens); then the bias, once."""
    if bias_on_every_rank:  # the mistake: N ranks add it, the sum holds it N times
        return Comm.apply(h @ lin.weight.T + lin.bias, *LEAVE)
    return Comm.apply(h @ lin.weight.T, *LEAVE) + lin.bias


def tp(model, rank, world, bug, device) -> Layout:
    keep = lambda lin, name, dim: setattr(  # noqa: E731  our chunk of lin.<name> becomes the parameter
        lin, name, torch.nn.Parameter(getattr(lin, name).detach().chunk(world, dim)[rank].clone()))
    summed = []  # whole on every rank, but each rank's gradient comes from its own tokens
    for i, block in enumerate(model.blocks):
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):  # column-parallel
            keep(lin, "weight", 0)
            keep(lin, "bias", 0)
        for name, lin in (("attn.proj", block.attn.proj), ("mlp.proj", block.mlp.proj)):  # row-parallel
            keep(lin, "weight", 1)
            lin.forward = functools.partial(row_parallel, lin, bug.at("tp-bias", f"blocks.{i}.{name}"))
            summed.append(lin.bias)
        for norm in (block.norm1, block.norm2):  # f: the split layers read every token
            norm.register_forward_hook(lambda m, args, out: Comm.apply(out, *ENTER))
    model.blocks[0].register_forward_pre_hook(  # the blocks work on our slice of the sequence
        lambda m, args: Comm.apply(args[0], tensor_parallel.split, tensor_parallel.all_gather))
    model.norm.register_forward_hook(  # the head reads all of it
        lambda m, args, out: Comm.apply(out, tensor_parallel.all_gather, tensor_parallel.split))
    for name, norm in model.named_modules():
        if isinstance(norm, torch.nn.LayerNorm) and not bug.at("sp-norm", name):
            summed += list(norm.parameters())  # the mistake leaves a norm out of this list

    def after_backward():
        for p in summed:
            dist.all_reduce(p.grad)
    return Layout("tp", model, model, after_backward=after_backward,
                  about=f"tensor + sequence parallel by hand: 1/{world} of the heads and MLP units, norms on 1/{world} of the tokens")


# --- context parallel: ring attention (lesson 21) --------------------------------------------

def ring_attention_forward(attn, ring, x):
    """Lesson 13's Attention.forward on our tokens, with lesson 21's ring where SDPA was."""
    B, L, _ = x.shape
    q, k, v = (lin(x).view(B, L, -1, T.HEAD_DIM).transpose(1, 2) for lin in (attn.q, attn.k, attn.v))
    y = ring_attention.RingAttention.apply(q, k, v, ring)
    return attn.proj(y.transpose(1, 2).reshape(B, L, -1))


def cp(model, rank, world, bug, device) -> Layout:
    ring = ring_attention.Ring("contiguous", rank, world, T.SEQ)
    for block in model.blocks:
        block.attn.forward = functools.partial(ring_attention_forward, block.attn, ring)
    positions = ring.mine.to(device)  # our tokens' places in the whole sequence
    if bug.at("cp-positions", str(rank)):
        positions = torch.arange(len(ring.mine), device=device)  # the mistake: 0, 1, ... on every rank

    def forward(x):
        h = model.tok_emb(x) + model.pos_emb(positions)
        for block in model.blocks:
            h = block(h)
        return model.head(model.norm(h))

    off_by_one = shifted(bug, rank, world)

    def rows(x, y):
        if off_by_one:  # the mistake, as in data_rows: this rank's rows are the next ones
            x, y = x.roll(-1, 0), y.roll(-1, 0)
        return x[:, ring.mine], y[:, ring.mine]

    def after_backward():  # lesson 21's average_gradients; grad-sum: the same without the mean
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if bug.name == "grad-sum" else dist.ReduceOp.AVG)
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))
    return Layout("cp", model, forward, rows, after_backward,
                  about=f"context parallel, ring attention: each rank {T.SEQ // world} of the {T.SEQ} tokens of every row")


BUILD = {"ddp": ddp, "fsdp": fsdp, "tp": tp, "cp": cp}
DIVIDES = {"tp": {f"{T.N_HEADS} attention heads": T.N_HEADS, f"{T.SEQ} tokens": T.SEQ},  # as lessons 17
           "cp": {f"{T.SEQ // 2} tokens of half a sequence": T.SEQ // 2}}              # and 21


def check_flags(parser, args):
    """--layout and --bug agree, a bug has ranks to get wrong, the world size fits the layout
    (Part 2's one rule: T.check_world_size); one line and exit 2 otherwise."""
    fits = BUGS[args.bug][0] if args.bug else LAYOUTS
    if args.layout is None:
        args.layout = fits[0]
    if args.layout not in fits:
        parser.error(f"--bug {args.bug} is a mistake of the {' and '.join(fits)} layout"
                     f"{'s' if len(fits) > 1 else ''}, not of {args.layout}: pass --layout {fits[0]}")
    if args.bug and args.world_size < 2:
        parser.error("--bug needs --world-size 2 or more: one rank splits nothing, so nothing can go wrong")
    if args.record_steps > args.steps:
        parser.error(f"--record-steps {args.record_steps} is more than --steps {args.steps}")
    T.check_world_size(args.world_size, "--world-size", divides=DIVIDES.get(args.layout),
                       splits_batch=args.layout in ("ddp", "fsdp"))
    return args


def build(layout: str, model, rank: int, world: int, bug: Bug, device) -> Layout:
    """`model` (lesson 13's, built with the same seed on every rank) split by `layout`."""
    return BUILD[layout](model, rank, world, bug, device)


# --- the hidden bug of exercise 26 -----------------------------------------------------------

HIDDEN = ([("tp", Bug("tp-bias", f"blocks.{i}.{name}")) for i in range(T.N_BLOCKS) for name in ("attn.proj", "mlp.proj")]
          + [("tp", Bug("sp-norm", name)) for name in ("blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm")]
          + [("ddp", Bug("grad-sum")), ("fsdp", Bug("data-shift", "1")), ("cp", Bug("cp-positions", "1")),
             ("cp", Bug("grad-sum")), ("fsdp", Bug("data-shift", "0"))])


def hidden_bug(seed: int) -> tuple[str, Bug]:
    """(layout, bug) for exercise 26's SEED: one of HIDDEN, chosen by a hash of the seed."""
    digest = hashlib.sha256(f"lesson 26 exercise {seed}".encode()).digest()
    return HIDDEN[int.from_bytes(digest[:4], "little") % len(HIDDEN)]


# --- the oracle's run, for exercise 26, its check and the tests --------------------------------

def record_pair(rank: int, world: int, layout: str, bug: Bug, seed: int = T.SEED, steps: int = 1,
                device: str = "cpu") -> tuple[dict, dict] | None:
    """Lesson 26's Steps 2 and 3 without the printing: `steps` steps of lesson 13's recipe in
    one process (on rank 0) and under `layout` (on every rank), each beside its float64 twin,
    recorded. Returns (reference, parallel) with their rounding measured on rank 0, None on
    the others. Call it on every rank of a process group (common.distributed.run_ranks)."""
    from parity_oracle import Recorder, measure_rounding, whole_shapes

    device = torch.device(device)
    with torch.device("meta"):
        shapes = whole_shapes(T.Transformer(), torch.zeros(T.GLOBAL_BATCH, T.SEQ, dtype=torch.long))
    runs = {}
    for dtype in (torch.float32, torch.float64):
        run = build(layout, T.make_model(seed).to(device, dtype), rank, world, bug, device)
        runs["parallel", dtype] = (run, T.make_optimizer(run.model), Recorder(run.model, shapes, run.about))
        if rank == 0:
            one = one_process(T.make_model(seed).to(device, dtype))
            runs["reference", dtype] = (one, T.make_optimizer(one.model), Recorder(one.model, {}, one.about))
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in T.batch(step - 1, seed))
        for run, optimizer, recorder in runs.values():
            train_step(run, optimizer, x, y, recorder, step)
            recorder.collect()
    if rank != 0:
        return None
    found = []
    for side in ("reference", "parallel"):
        recording, twin = (runs[side, dtype][2].recording for dtype in (torch.float32, torch.float64))
        measure_rounding(recording, twin)
        found.append(recording)
    return found[0], found[1]


def record_hidden(seed: int, folder, world: int = 2) -> str:
    """Exercise 26's step 1: record_pair for hidden_bug(seed) on `world` ranks (one step), the
    two recordings saved as folder/reference.pt and folder/parallel.pt. Returns the layout's
    name; nothing says which bug."""
    from pathlib import Path

    from common.distributed import run_ranks
    from parity_oracle import save

    layout, bug = hidden_bug(seed)
    reference, parallel = run_ranks(record_pair, world, (layout, bug, T.SEED, 1), timeout_s=300)[0]
    for name, recording in (("reference.pt", reference), ("parallel.pt", parallel)):
        save(recording, Path(folder) / name)
    return layout
