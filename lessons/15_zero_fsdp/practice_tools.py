"""Lesson 15 in practice, the apparatus: its flags, FSDP2 models built and trained one way or
another, and the instruments (Recorder: collectives and peaks; the formulas; the comparison with
lesson 13). in_practice.py runs the steps; practice_report.py prints what each one measured."""
import contextlib
import math

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from apparatus.comm import CommLog
from apparatus import sharding
import sharded
from common import transformer as T
from common.cli import fail, lesson_parser, positive_int, seed_number
from apparatus.results import max_abs_diff


def parse_args(doc: str):
    """The script's flags (doc: its docstring, for --help), checked: one line and exit 2."""
    parser = lesson_parser(doc, recipe=False, distributed=True, world_size=4)
    next(a for a in parser._actions if a.dest == "out").help = (  # not a lesson's runs/lesson-NN
        "folder for final.pt and metrics.json (default: runs/lesson-15-in-practice)")
    parser.add_argument("--steps", type=positive_int, default=2,
                        help="optimizer steps in each section (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--accum-steps", type=positive_int, default=2,
                        help="Step 4: micro-batches per optimizer step")
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")
    if args.world_size < 4 or args.world_size % 2:  # Step 6's mesh: 2 replicas of N/2 shards
        ok = [n for n in range(4, 9, 2) if T.GLOBAL_BATCH % n == 0]
        fail(f"--world-size {args.world_size}: HSDP (Step 6) needs 2 replicas of at least 2 ranks; "
             f"use one of {', '.join(map(str, ok))}")
    rows = T.GLOBAL_BATCH // args.world_size
    if rows % args.accum_steps:
        fail(f"--accum-steps {args.accum_steps} does not cut each rank's {rows} rows into equal "
             f"micro-batches; use one of {', '.join(str(d) for d in range(1, rows + 1) if rows % d == 0)}")
    return args


def shard_model(args, device, mesh, **policy):
    """Lesson 15's Step 3: one FSDP group per block, then the root; `policy`: fully_shard's knobs."""
    model = T.make_model(args.seed).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def rows(step: int, args, device):
    """This rank's rows of the global batch of `step` (every rank is a data-parallel rank,
    also under HSDP, where replicas and shards both split the batch)."""
    x, y = T.batch(step, args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    return T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)


class Recorder:
    """with Recorder(model, optimizer) as rec: one training step  ->  rec.log (CommLog: every
    collective), rec.story (FSDP2's hooks, sharded.FSDPStory), rec.peak() (FSDPMemTracker)."""

    def __init__(self, model, optimizer):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        self.log, self.story = CommLog(), sharded.FSDPStory()
        self.tracker = FSDPMemTracker(model, optimizer)
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> "Recorder":
        for context in (self.log.recording(), self.story, self.tracker):
            self.stack.enter_context(context)
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def peaks(self) -> dict[str, int]:
        """{device: bytes at its peak in the recorded step} (CPU and GPU apart: Step 7)."""
        snapshot = self.tracker.get_tracker_snapshot("peak")
        return {str(device): kinds["Total"] for device, kinds in snapshot.items()}

    def peak(self) -> int:
        return sum(self.peaks().values())

    def bytes_of(self, kind: str, group: str | None = None) -> tuple[int, int, float]:
        """(calls, data bytes S, bytes this rank sent) of one kind of collective, on one group."""
        calls = [c for c in self.log.calls if c.kind.startswith(kind) and group in (None, c.group)]
        return len(calls), sum(c.data_bytes for c in calls), sum(c.sent_bytes for c in calls)


def train(model, optimizer, args, device):
    """Lesson 15's loop for args.steps steps, the last one recorded: (losses, its Recorder)."""
    losses = []
    for step in range(args.steps):
        last = step == args.steps - 1
        with Recorder(model, optimizer) if last else contextlib.nullcontext() as recorder:
            x, y = rows(step, args, device)
            loss = T.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return losses, recorder


def story_rows(recorder) -> list[list[str]]:
    """sharded.FSDPStory's rows for the recorded step, a forward prefetch named as lesson 15
    names a backward one: under the module whose hook issued it."""
    out = []
    for hook, module, issued in recorder.story.rows(recorder.log.calls, 0):
        if hook == "forward_prefetch":
            hook = f"  prefetch in {out[-1][1]}'s" if out else "prefetch"
        out.append([hook, module, issued])
    return out


def full_state(model) -> dict:
    """The full state dict, gathered to rank 0's CPU (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def group_elements(shard: int) -> dict[str, int]:
    """Elements of each FSDP group (root, blocks.0, ...) once gathered, each parameter padded
    to a multiple of `shard` rows as FSDP2 pads it (apparatus/sharding.py, fsdp_local_rows)."""
    groups: dict[str, int] = {}
    for name, shape in sharding.recipe_shapes().items():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        padded_rows = shard * sharding.fsdp_local_rows(shape[0], shard, 0)[1]
        groups[group] = groups.get(group, 0) + padded_rows * math.prod(shape[1:])
    return groups


def gathered_formula(shard: int, element: int) -> int:
    """Bytes all-gathered per step: every block twice (forward, and again in backward: it was
    resharded after forward), the root once (FSDP2 keeps the root gathered for backward)."""
    return sum(n * element * (1 if g == "root" else 2) for g, n in group_elements(shard).items())


def reduced_formula(shard: int) -> int:
    """Bytes reduce-scattered per step: every group once, fp32 (also under Step 3's policy)."""
    return 4 * sum(group_elements(shard).values())


def compare(ui, what: str, state: dict, reference: dict, allowed: float | None = 1e-3,
            against: str = "w_13") -> float:
    """Print and return max |w - reference|, against `allowed` (None: no verdict, a fact)."""
    diff = max_abs_diff(state, reference)
    verdict = "" if allowed is None else f" {'within' if diff <= allowed else 'BEYOND'} {allowed:g}"
    ui.print(f"{what}: max |w - {against}| = [bold]{diff:.1e}[/bold]{verdict}")
    return diff


def everyone(value) -> list:
    """Every rank's `value`, on every rank, by rank."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
