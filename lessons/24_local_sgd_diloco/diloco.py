"""Lesson 24's parts beside the idea: the flags and their checks, the two optimizers (inner and
outer, with the outer settings the --sweep compares), the one-process simulation every
distributed run must match, and torch's own DDP (the baseline of Steps 5 and 7) and LocalSGD
(PostLocalSGDOptimizer + PeriodicModelAverager, Step 6).

    plan = Plan.of(args)                      # world, steps, H, inner, outer, seed, drop-out
    optimizer = make_inner(model, plan.inner)  # AdamW (lesson 13's) or plain SGD, per replica
    outer, outer_optimizer = make_outer(model, plan)  # a copy of the weights, SGD on it
    simulate(plan)                            # the N replicas in one process, one after another

The outer step itself (average the pseudo-gradients, step the outer optimizer) is in the lesson
file, where the learner reads it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from common import fail, transformer as T

SGD_LR = 0.1  # the inner SGD's learning rate (AdamW keeps lesson 13's 1e-2)
# The outer optimizers. LocalSGD: the new weights are the replicas' average (SGD, lr 1, no
# momentum). DiLoCo (Douillard et al. 2023, arXiv 2311.08105): Nesterov momentum, lr 0.7, 0.9
OUTER = {"sgd": dict(lr=1.0), "nesterov": dict(lr=0.7, momentum=0.9, nesterov=True)}
METHOD = {"sgd": "localsgd", "nesterov": "diloco"}  # what metrics.json calls each
SWEEP = (1, 4, 16, 64)  # the --sweep's H values
# The --sweep's outer settings, all at H = SETTINGS_H: (lr, Nesterov momentum; 0: plain SGD).
# (1.0, 0.0) is LocalSGD's plain average, (0.7, 0.9) the paper's DiLoCo.
SETTINGS_H = 16
SETTINGS = ((0.7, 0.0), (0.7, 0.5), (0.7, 0.9), (1.0, 0.0), (1.0, 0.5), (1.0, 0.9))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run: N replicas, `steps` inner steps each, an outer step every H of them."""
    world: int
    steps: int
    H: int
    inner: str = "adamw"
    outer: str = "nesterov"
    seed: int = T.SEED
    drop_rank: int | None = None  # this replica misses outer step drop_at (numbered from 1)
    drop_at: int | None = None
    outer_lr: float | None = None  # None: OUTER[outer]'s (the --sweep's SETTINGS set both)
    outer_momentum: float | None = None

    @classmethod
    def of(cls, args) -> "Plan":
        return cls(args.world_size, args.steps, args.sync_every, args.inner, args.outer, args.seed,
                   args.drop_rank, args.drop_at)

    def outer_settings(self) -> dict:
        """torch.optim.SGD's arguments for the outer optimizer: OUTER[outer], with this plan's
        lr and momentum where it sets them (Nesterov whenever there is a momentum)."""
        settings = dict(OUTER[self.outer])
        if self.outer_lr is not None:
            settings["lr"] = self.outer_lr
        if self.outer_momentum is not None:
            settings.update(momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
        return settings

    def away(self, rank: int, step: int) -> bool:
        """Is replica `rank` gone during inner step `step` (it left after the outer step before)?"""
        return rank == self.drop_rank and step // self.H + 1 == self.drop_at

    def samples(self) -> int:
        """Rows trained on, every replica's: a replica that is away trains on nothing."""
        rows = T.GLOBAL_BATCH // self.world
        return sum(rows for s in range(self.steps) for r in range(self.world) if not self.away(r, s))


def make_inner(model, kind: str) -> torch.optim.Optimizer:
    return T.make_optimizer(model) if kind == "adamw" else torch.optim.SGD(model.parameters(), lr=SGD_LR)


def make_outer(model, plan: Plan):
    """The outer weights (a copy: where every round starts, theta_start) and their optimizer."""
    outer = [p.detach().clone() for p in model.parameters()]
    return outer, torch.optim.SGD(outer, **plan.outer_settings())


def apply_outer(model, outer, outer_optimizer, pseudo_gradient: torch.Tensor) -> None:
    """Give the outer weights the averaged pseudo-gradient as their .grad, step, and copy the
    result into the model: every replica starts the next round from the same weights."""
    for o, g in zip(outer, pseudo_gradient.split([o.numel() for o in outer])):
        o.grad = g.view_as(o).clone()
    outer_optimizer.step()
    with torch.no_grad():
        for p, o in zip(model.parameters(), outer):
            p.copy_(o)


def outer_state(outer, outer_optimizer) -> list[torch.Tensor]:
    """What a returning replica needs from a peer: the outer weights, and the momentum (Nesterov)."""
    state = [outer_optimizer.state[o].get("momentum_buffer") for o in outer]
    return list(outer) + [b if b is not None else torch.zeros_like(o) for b, o in zip(state, outer)
                          if "momentum" in outer_optimizer.defaults and outer_optimizer.defaults["momentum"]]


def load_outer_state(flat: torch.Tensor, model, outer, outer_optimizer) -> None:
    parts = flat.split([o.numel() for o in outer] * (len(flat) // sum(o.numel() for o in outer)))
    with torch.no_grad():
        for o, p, w in zip(outer, model.parameters(), parts):
            o.copy_(w.view_as(o))
            p.copy_(o)
    for o, b in zip(outer, parts[len(outer):]):  # the momentum, when the outer optimizer has one
        outer_optimizer.state[o]["momentum_buffer"] = b.view_as(o).clone()


def come_back(plan: Plan, rank: int, model, outer, outer_optimizer) -> bool:
    """After the outer step a replica missed: the lowest rank present sends it the outer weights
    (and momentum) in one message; True on the replica that came back (it needs a new inner
    optimizer: a restarted process has no AdamW moments)."""
    peer = min(set(range(plan.world)) - {plan.drop_rank})
    flat = torch.cat([t.flatten() for t in outer_state(outer, outer_optimizer)])
    if rank == peer:
        dist.send(flat, dst=plan.drop_rank)
    elif rank == plan.drop_rank:
        dist.recv(flat, src=peer)
        load_outer_state(flat, model, outer, outer_optimizer)
        return True
    return False


# --- the one-process simulation ------------------------------------------------------------

def simulate(plan: Plan) -> dict:
    """The same run with the N replicas in one process, one after another: the same shards,
    the same inner optimizers, the pseudo-gradients summed in rank order and divided by the
    replicas present. On one CPU thread, as the ranks run. {"state", "losses", "held_out"}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [T.make_model(plan.seed) for _ in range(plan.world)]
        inner = [make_inner(m, plan.inner) for m in models]
        outer, outer_optimizer = make_outer(models[0], plan)
        losses = []
        for step in range(plan.steps):
            x, y = T.batch(step, plan.seed)
            here = [r for r in range(plan.world) if not plan.away(r, step)]
            mean = 0.0
            for r in here:
                loss = T.loss_fn(models[r](T.shard(x, r, plan.world)), T.shard(y, r, plan.world))
                inner[r].zero_grad(set_to_none=True)
                loss.backward()
                inner[r].step()
                mean += loss.item()
            losses.append(mean / len(here))
            if (step + 1) % plan.H == 0:
                flat = sum(torch.cat([(o - p.detach()).flatten() for o, p in zip(outer, models[r].parameters())])
                           for r in here) / len(here)
                apply_outer(models[0], outer, outer_optimizer, flat)
                for r in range(1, plan.world):
                    with torch.no_grad():
                        for p, o in zip(models[r].parameters(), outer):
                            p.copy_(o)
                for r in set(range(plan.world)) - set(here):  # back, with a fresh inner optimizer
                    inner[r] = make_inner(models[r], plan.inner)
        held_out, _ = T.evaluate(models[0], plan.steps, plan.seed, "cpu")
    finally:
        torch.set_num_threads(threads)
    return {"state": {k: v.detach().clone() for k, v in models[0].state_dict().items()},
            "losses": losses, "held_out": held_out}


# --- torch's own, for Steps 5-7 -------------------------------------------------------------

def torch_run(how: str, plan: Plan, rank: int, device, log=None) -> dict:
    """Train a fresh model with torch's own machinery, on this rank's shards (the sweep's
    DDP row too): {"model", "losses" (this rank's), "sent" (bytes, with a CommLog)}.
    how="ddp": DistributedDataParallel, the inner optimizer stepping on the averaged gradients;
    how="periodic": PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=H)): LocalSGD.
    PeriodicModelAverager averages when (step - warmup_steps) % period == 0 counting its calls
    from 0, so after the 1st, (H+1)th, ... step; warmup_steps=H-1 moves that to the Hth, 2Hth."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = T.make_model(plan.seed).to(device)
    wrapped = DDP(model) if how == "ddp" else model
    optimizer = make_inner(model, plan.inner)
    if how == "periodic":
        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=plan.H, warmup_steps=plan.H - 1))
    losses = torch.zeros(plan.steps, dtype=torch.float64)
    for step in range(plan.steps):
        x, y = (T.shard(t, rank, plan.world).to(device) for t in T.batch(step, plan.seed))
        loss = T.loss_fn(wrapped(x), y)
        optimizer.zero_grad(set_to_none=True)
        if log is not None:
            with log.recording():
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
        losses[step] = loss.item()
    del wrapped, optimizer  # a DDP reducer holds the process group: free it before the next one
    return {"model": model, "losses": losses, "sent": sum(c.sent_bytes for c in log.calls) if log else 0.0}


# --- flags ---------------------------------------------------------------------------------

def add_flags(parser) -> None:
    from common.cli import nonnegative_int, positive_int

    parser.add_argument("--sync-every", type=positive_int, default=8,
                        help="H: inner steps between two outer steps (1: talk every step, as DDP)")
    parser.add_argument("--inner", choices=["adamw", "sgd"], default="adamw",
                        help=f"each replica's own optimizer: AdamW (lr {T.LR}) or SGD (lr {SGD_LR})")
    parser.add_argument("--outer", choices=["nesterov", "sgd"], default="nesterov",
                        help="nesterov: DiLoCo (lr 0.7, momentum 0.9); sgd: LocalSGD (lr 1: the average)")
    parser.add_argument("--sweep", action="store_true",
                        help=f"also train H = {', '.join(map(str, SWEEP))} for --steps each: bytes and loss, "
                             "a table and sweep.png in --out")
    parser.add_argument("--drop-rank", type=nonnegative_int, default=None,
                        help="this replica drops out for one round, then comes back (needs --drop-at)")
    parser.add_argument("--drop-at", type=positive_int, default=None,
                        help="the outer step it misses, counted from 1")


def listed_fits(values: list[int]) -> str:
    """The first few and the last of the values a flag may take."""
    return ", ".join(map(str, values)) if len(values) <= 6 else \
        ", ".join(map(str, values[:5])) + f", ... {values[-1]}"


def check_flags(args):
    """One line and exit 2, before any process starts."""
    T.check_world_size(args.world_size, "--world-size")  # every replica takes as many rows
    H, steps = args.sync_every, args.steps
    if H > steps:  # (suggesting --steps H would offer a run of H steps: 1e9 of them, once)
        fits = [d for d in range(1, steps + 1) if steps % d == 0 and steps // d >= (args.drop_at or 1)]
        fail(f"--sync-every {H} is more than --steps {steps}: the run would end before its first outer "
             f"step; use a --sync-every that divides --steps: {listed_fits(fits)}")
    if steps % H:
        fail(f"--steps {steps} is not a multiple of --sync-every {H}: a run ends on an outer step; "
             f"use --steps {max(H, steps - steps % H)} or {steps - steps % H + H}")
    if args.sweep and steps % max(SWEEP):
        fail(f"--sweep trains H = {', '.join(map(str, SWEEP))} for --steps each, so --steps must be a "
             f"multiple of {max(SWEEP)}; use --steps {steps - steps % 64 + 64}")
    if (args.drop_rank is None) != (args.drop_at is None):
        fail("--drop-rank and --drop-at go together: which replica drops out, and which outer step it "
             "misses (e.g. --drop-rank 1 --drop-at 2)")
    if args.drop_rank is not None:
        if args.world_size < 2 or args.drop_rank >= args.world_size:
            fail(f"--drop-rank {args.drop_rank} is not a replica that has a peer to come back from: "
                 f"use --world-size 2 or more and a rank from 0 to {max(1, args.world_size) - 1}")
        if args.drop_at > steps // H:
            fail(f"--drop-at {args.drop_at}: the run has {steps // H} outer steps (--steps {steps} / "
                 f"--sync-every {H}); use 1 to {steps // H}")
    return args


def present_group(plan: Plan, world: int):
    """The replicas still there when one drops out (every rank must create it, members or not)."""
    if plan.drop_rank is None:
        return None
    return dist.new_group([r for r in range(world) if r != plan.drop_rank])
