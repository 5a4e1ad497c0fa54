"""Lesson 12: pitfalls and hangs, each one reproduced in seconds and then fixed.

New since lesson 05: no new API, but the bugs everyone hits once. The default run walks
through every pitfall in its *fixed* form and prints the evidence that the fix works.
`--break NAME` runs one pitfall in its *broken* form: you see the symptom (a wrong number,
an error, or a hang that a short timeout ends), then one paragraph with the symptom, the
cause and the fix. Errors exit non-zero; the silent bugs exit 0 and print the wrong
numbers next to the right ones. Every broken mode ends on its own, within the --timeout
(10 s here, so that hangs end quickly) plus start-up.

Run:
    make lesson-12                                   # every pitfall, fixed
    make lesson-12 ARGS="--break set-epoch"          # one pitfall, broken
    .venv/bin/python lessons/12_pitfalls.py --break collective-order --debug-detail
    .venv/bin/python lessons/12_pitfalls.py --world-size 3 --break eval-padding

The --break names, in the order of the steps:
    busy-port           start the job on a port that another process holds
    rank-crash          one rank raises while the others wait in a collective
    set-epoch           forget sampler.set_epoch(epoch): every epoch has the same order
    same-seed           seed the augmentation with the same seed on every rank
    collective-missing  a collective called on rank 0 only: a hang, ended by the timeout
    collective-order    collectives in a different order on different ranks
    unused-params       a parameter without a gradient, and no find_unused_parameters=True
    batchnorm           BatchNorm statistics computed per rank, not over the global batch
    eval-padding        evaluation with DistributedSampler, which pads with duplicates
    save-every-rank     every rank writes the same checkpoint file
    no-barrier          rank 1 loads the checkpoint before rank 0 has written it

Doc: docs/12_pitfalls.md
"""
import contextlib
import datetime
import io
import json
import os
import re
import socket
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run
from common.distributed import choose_port, spawn, teardown
from common.results import atomic_write, out_dir, shown
from common.ui import UI, Timer, share_terminal_with_children

# --break NAME -> the step that shows it. Silent bugs give wrong numbers and exit 0.
BREAKS = {
    "busy-port": 1, "rank-crash": 2, "set-epoch": 3, "same-seed": 4,
    "collective-missing": 5, "collective-order": 5, "unused-params": 6, "batchnorm": 7,
    "eval-padding": 8, "save-every-rank": 9, "no-barrier": 9,
}
SILENT = {"set-epoch", "same-seed", "batchnorm", "eval-padding"}
N_VAL = 101      # a validation set that 2, 3 and 4 ranks cannot split evenly
MAX_WORLD = 4    # every demo needs 2 ranks at least; more only shares 2 cores thinner


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.set_defaults(timeout=10.0)  # short, so that the hang demos end in seconds
    parser.add_argument("--break", dest="brk", choices=list(BREAKS), default=None,
                        help="run one pitfall in its broken form; each name is explained at the top of "
                             "this file and in docs/12_pitfalls.md")
    parser.add_argument("--debug-detail", action="store_true",
                        help="set TORCH_DISTRIBUTED_DEBUG=DETAIL for the ranks (checks every "
                             "collective's type and shapes across ranks before running it)")
    parser.add_argument("--seed", type=nonnegative_int, default=recipe.SEED,
                        help="seed for the initial weights and the sample order")
    parser.add_argument("--epochs", type=positive_int, default=recipe.EPOCHS,
                        help="epochs of sample orders to show in the set_epoch step")
    args = parser.parse_args()
    if not 2 <= args.world_size <= MAX_WORLD:
        fail(f"--world-size {args.world_size}: every pitfall here needs 2 to {MAX_WORLD} ranks")
    if args.device == "cuda":
        fail("lesson 12 reproduces every pitfall on the CPU with gloo, so that each one "
             "behaves the same on every machine; run it with --device cpu (or auto)")
    if args.debug_detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read by every rank at init
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    if detail and args.brk in (None, "unused-params"):
        # Measured on torch 2.14.1 with gloo: DDP's constructor dies with SIGSEGV in
        # DistributedDataParallel.__init__ (logger.set_construction_data_and_log) under DETAIL.
        fail("TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP's constructor (SIGSEGV) on torch "
             f"{torch.__version__} with gloo, and this run builds a DDP model; use DETAIL "
             "with --break collective-missing or collective-order, or use INFO")
    return args


def main() -> None:
    args = parse_args()
    ui = UI(step_mode=args.step)
    mode = f"--break {args.brk}" if args.brk else "every pitfall, fixed"
    ui.title(f"Lesson 12: pitfalls and hangs ({mode}) on {args.world_size} CPU ranks")

    # Step 1: Start the ranks on a free port
    # Rank 0 hosts the rendezvous store on MASTER_PORT; if another program already listens
    # there, the store cannot open it. choose_port() checks *before* any rank starts and
    # says so in one line; without it the job fails inside the ranks (--break busy-port).
    ui.step(1, "Start the ranks on a free port")
    blocker = None
    if args.brk == "busy-port":
        blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            blocker.bind(("127.0.0.1", args.master_port or 0))
            blocker.listen()  # now the port is busy, like a job that is still running
            port = blocker.getsockname()[1]
            ui.print(f"this process now listens on 127.0.0.1:{port}, standing in for another job")
        except OSError:  # --master-port names a port that is busy already: even better
            blocker.close()
            blocker, port = None, args.master_port
            ui.print(f"127.0.0.1:{port} is busy already (another program listens there)")
        said = io.StringIO()
        with contextlib.redirect_stderr(said):  # fail() writes its one line to stderr
            try:
                choose_port(port)
            except SystemExit:
                pass
        ui.print(f"with the check, before any rank starts: {escape(said.getvalue().strip())}")
        ui.print("without the check: the ranks start on that port anyway ...")
    else:
        port = choose_port(args.master_port)
        ui.print(f"MASTER_PORT={port}: choose_port() made sure nothing listens there")
    debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
    ui.print(f"mp.spawn(worker, nprocs={args.world_size}); collectives time out after "
             f"{args.timeout:g}s; TORCH_DISTRIBUTED_DEBUG={debug}")
    share_terminal_with_children()  # --step: rank 0 asks on this terminal
    ui.pause(next_step=(2, "Join the process group with a short timeout"))

    timer = Timer()
    try:
        spawn(worker, (args.world_size, args, port), args.world_size)
    except SystemExit:  # spawn() has printed the one-line error; now say what it means
        explain(ui, args.brk, timer.seconds)
        raise
    finally:
        if blocker is not None:
            blocker.close()
    if args.brk:
        explain(ui, args.brk, timer.seconds)
    else:
        ui.print(f"\nevery pitfall ran in its fixed form in {timer.seconds:.1f}s; now break one, "
                 f"e.g. make lesson-12 ARGS=\"--break set-epoch\"")


def explain(ui: UI, name: str | None, seconds: float) -> None:
    if name is None:
        return
    ui.print(f"\n[bold]What went wrong (--break {name}; the job ended after {seconds:.1f}s)[/bold]")
    # under DETAIL the mismatched collectives fail at once instead of hanging: say that
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    text = EXPLAIN_DETAIL.get(name, EXPLAIN[name]) if detail else EXPLAIN[name]
    ui.print(textwrap.fill(text, width=92), markup=False)


def worker(rank: int, world_size: int, args, port: int) -> None:
    """What every rank runs: join, then the pitfalls (all of them, or the one to break)."""
    ui = UI(rank, world_size, step_mode=args.step)
    torch.set_num_threads(1)  # 2 cores, 2+ ranks: one thread each, no fighting
    brk = args.brk

    # Step 2: Join the process group with a short timeout
    # We create the store ourselves (init_method="env://" did it for us in lesson 05) to use
    # it below as a referee that works even when collectives are stuck. The timeout bounds
    # the rendezvous *and* every collective: a rank that never answers becomes an error
    # after --timeout seconds instead of a frozen terminal. A rank that *crashes* ends the
    # job sooner: mp.spawn sees the dead process and stops the others (--break rank-crash).
    ui.step(2, "Join the process group with a short timeout")
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
    except Exception as exc:  # --break busy-port: the port is taken
        ui.say_all(f"dist.TCPStore(port={port}) failed: {escape(first_line(exc))}")
        leave(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    ones = torch.ones(1)
    if brk == "rank-crash" and rank == 1:
        time.sleep(0.5)  # let the others get into their all_reduce first
        raise RuntimeError("rank 1 crashed on purpose (--break rank-crash) while the others wait")
    if brk == "rank-crash":
        ui.say_all("waiting in all_reduce for rank 1 ...")
    collective(ui, "all_reduce(ones)", lambda: dist.all_reduce(ones),
               wait_if_peer_died=args.timeout if brk == "rank-crash" else 0.0)
    ui.print(f"all_reduce(ones) = {ones.item():g} on every rank: all {world_size} ranks are here")

    data = recipe.load_data()
    evidence: dict = {"world_size": world_size, "break": brk, "timeout_s": args.timeout}
    pitfalls = [pitfall_set_epoch, pitfall_augmentation_seed, pitfall_collectives,
                pitfall_unused_parameters, pitfall_batchnorm, pitfall_evaluation, pitfall_saving]
    for number, pitfall in enumerate(pitfalls, start=3):
        if brk is None or BREAKS[brk] == number:
            pitfall(ui, rank, world_size, args, data, store, evidence)
    leave_group(ui, rank, args, evidence)


def pitfall_set_epoch(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 3: Call set_epoch every epoch
    # DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch only
    # changes when you call set_epoch(). Forget it and every epoch replays epoch 0's order:
    # each rank sees the same 1/N of the data, in the same order, every epoch.
    ui.step(3, "Call set_epoch every epoch")
    broken = args.brk == "set-epoch"
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    orders = []
    for epoch in range(args.epochs):
        if not broken:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
        if not broken:  # the order lesson 01 uses, dealt out rank, rank+N, rank+2N, ...
            assert orders[-1] == recipe.epoch_order(len(data.train), args.seed, epoch)[rank::world_size]
    label = "broken: no set_epoch()" if broken else "fixed: set_epoch(epoch) before each epoch"
    ui.print(f"{label}; the first 6 sample indices of rank 0, epoch by epoch:")
    for epoch, order in enumerate(orders):
        ui.print(f"  epoch {epoch}: {order[:6]}")
    seen = len(set().union(*orders))
    same = all(order == orders[0] for order in orders)
    ui.print(f"every epoch the same order: {'YES' if same else 'no'}; rank 0 saw {seen} distinct "
             f"samples of {len(data.train)} in {args.epochs} epochs")
    evidence["set_epoch"] = {"first_indices": [o[:6] for o in orders], "same_every_epoch": same,
                             "distinct_seen_by_rank_0": seen}


def pitfall_augmentation_seed(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 4: Give each rank its own augmentation seed
    # Same seed everywhere is right for the initial weights (every copy must start equal)
    # and wrong for augmentation: ranks seeded alike draw the *same* noise, so a global batch
    # of 96 gets only 96/N different augmentations. Per-rank randomness comes from a private
    # generator seeded with (seed, rank); the global RNG stays the same on every rank.
    ui.step(4, "Give each rank its own augmentation seed")
    broken = args.brk == "same-seed"
    per_rank = recipe.GLOBAL_BATCH // world_size
    order = recipe.epoch_order(len(data.train), args.seed, 0)[:recipe.GLOBAL_BATCH]
    x = data.train.tensors[0][order[rank::world_size]]  # this rank's share of one batch
    if broken:
        torch.manual_seed(args.seed)  # the same seed on every rank
        noise = torch.randn(x.shape)
    else:
        g = torch.Generator().manual_seed(args.seed * 2**32 + rank)  # distinct per (seed, rank)
        noise = torch.randn(x.shape, generator=g)
    augmented = x + 0.1 * noise  # "jitter": the simplest augmentation there is
    noises = [torch.empty_like(noise) for _ in range(world_size)]
    dist.all_gather(noises, noise)
    label = "broken: torch.manual_seed(seed) on every rank" if broken else \
        "fixed: torch.Generator().manual_seed(seed * 2**32 + rank)"
    ui.print(f"{label}; x + 0.1 * noise on each rank's {tuple(augmented.shape)} batch; "
             f"its first noise vector:")
    for r, n in enumerate(noises):
        ui.print(f"  rank {r}: {fmt(n[0, :4])} ...")
    distinct = torch.unique(torch.cat(noises), dim=0).shape[0]
    ui.print(f"distinct noise vectors in the global batch of {recipe.GLOBAL_BATCH}: {distinct}"
             f"{'  <- every rank drew the same ones' if distinct == per_rank else ''}")
    evidence["same_seed"] = {"distinct_noise_vectors": distinct, "global_batch": recipe.GLOBAL_BATCH}


def pitfall_collectives(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 5: Call every collective on every rank, in the same order
    # A collective is a meeting: it completes only when every rank calls it, and ranks match
    # calls by their *order*, not by name. A call on some ranks only (inside `if rank == 0:`)
    # waits for partners who never come; calls in different orders pair up wrongly: they
    # hang, or worse, silently swap values when the shapes agree.
    ui.step(5, "Call every collective on every rank, in the same order")
    model = recipe.make_model(args.seed)
    order = recipe.epoch_order(len(data.train), args.seed, 0)[:recipe.GLOBAL_BATCH]
    x, y = data.train[order[rank::world_size]]
    with torch.no_grad():
        loss_sum = F.cross_entropy(model(x), y, reduction="sum").view(1)
        one_process = F.cross_entropy(model(data.train[order][0]), data.train[order][1]).item()
    count = torch.tensor([float(len(y))])
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    ui.print(f"TORCH_DISTRIBUTED_DEBUG={'DETAIL' if detail else 'OFF'}; each rank holds the loss "
             f"sum and the count of its {len(y)} samples")

    if args.brk == "collective-missing":
        ui.print("broken: all_reduce(loss_sum) inside `if rank == 0:`; the others go on to barrier()")
        if rank == 0:
            collective(ui, "all_reduce(loss_sum) (only rank 0 calls it)",
                       lambda: dist.all_reduce(loss_sum))
        collective(ui, "barrier()", dist.barrier)
        return  # not reached: a timeout (or DETAIL) ends both ranks above

    if args.brk == "collective-order":
        # (a) Two all_reduces of the same shape, swapped on the other ranks: they pair up
        # rank 0's loss_sum with rank 1's count. No error, no warning, even under DETAIL.
        a, b = loss_sum.clone(), count.clone()
        first, second = (a, b) if rank == 0 else (b, a)
        collective(ui, "all_reduce (first)", lambda: dist.all_reduce(first))
        collective(ui, "all_reduce (second)", lambda: dist.all_reduce(second))
        rows = gather([a.item(), b.item()])
        ui.print("broken (a): rank 0 all_reduces loss_sum then count, the others count then loss_sum")
        for r, (s, n) in enumerate(rows):
            ui.print(f"  rank {r}: loss_sum {s:9.4f}  count {n:7.2f}  mean loss {s / n:8.4f}")
        ui.print(f"  right:  loss_sum {one_process * recipe.GLOBAL_BATCH:9.4f}  count "
                 f"{recipe.GLOBAL_BATCH:7.2f}  mean loss {one_process:8.4f}   (no error was raised)")
        # (b) Two different collectives in a different order: they cannot pair up at all.
        ui.print("broken (b): rank 0 calls all_reduce(loss_sum) then broadcast(weights), "
                 "the others broadcast first")
        weights = model.head.weight.detach().clone()
        if rank == 0:
            collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
            collective(ui, "broadcast(weights)", lambda: dist.broadcast(weights, src=0))
        else:
            collective(ui, "broadcast(weights)", lambda: dist.broadcast(weights, src=0))
            collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
        return  # not reached

    timer = Timer()
    collective(ui, "all_reduce(loss_sum)", lambda: dist.all_reduce(loss_sum))
    collective(ui, "all_reduce(count)", lambda: dist.all_reduce(count))
    collective(ui, "barrier()", dist.barrier)
    mean = loss_sum.item() / count.item()
    ui.print(f"fixed: every rank calls all_reduce(loss_sum), all_reduce(count), barrier() in this "
             f"order; done in {timer.seconds * 1000:.0f} ms")
    ui.print(f"mean loss over the global batch of {count.item():g}: {mean:.6f}; one process: "
             f"{one_process:.6f} (|difference| {abs(mean - one_process):.1e})")
    evidence["collectives"] = {"mean_loss": mean, "one_process_loss": one_process,
                               "count": count.item()}


class AuxNet(nn.Module):
    """A body, a main head, and an auxiliary head that only some steps use."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(recipe.FEATURES, recipe.HIDDEN)
        self.head = nn.Linear(recipe.HIDDEN, recipe.CLASSES)
        self.aux = nn.Linear(recipe.HIDDEN, recipe.CLASSES)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = F.relu(self.body(x))
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def pitfall_unused_parameters(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 6: Tell DDP about parameters it will not use
    # DDP all-reduces gradients bucket by bucket, as autograd hooks report them ready. A
    # parameter that got no gradient never reports, so its bucket never finishes, and DDP
    # notices at the *next* forward. find_unused_parameters=True makes DDP walk the graph
    # after every forward to find such parameters: correct, and slower (measured below).
    ui.step(6, "Tell DDP about parameters it will not use")
    broken = args.brk == "unused-params"
    order = recipe.epoch_order(len(data.train), args.seed, 0)
    per_rank = recipe.GLOBAL_BATCH // world_size
    torch.manual_seed(args.seed)
    model = DDP(AuxNet(), find_unused_parameters=not broken)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.LR)
    ui.print(f"{'broken: DDP(model)' if broken else 'fixed: DDP(model, find_unused_parameters=True)'}"
             f"; the aux head is used on odd steps only")
    for step in range(4):
        batch = order[step * recipe.GLOBAL_BATCH:(step + 1) * recipe.GLOBAL_BATCH][rank::world_size]
        x, y = data.train[batch]
        try:
            loss = F.cross_entropy(model(x, use_aux=step % 2 == 1), y)
        except RuntimeError as exc:  # DDP's check at the start of the forward after a bad step
            message = str(exc)
            names = [n for n, _ in model.module.named_parameters()]
            found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
            which = [names[int(i)] for i in found.group(1).split()] if found else []
            sentences = ". ".join(message.split(". ")[:2])  # the first two of many sentences
            ui.say_all(f"step {step}: DDP raised RuntimeError: {escape(sentences)} ...")
            ui.say_all(f"  ... and, further down: {escape(found.group(0) if found else '?')} "
                       f"(index -> name: {', '.join(which)})")
            leave(1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        got = model.module.aux.weight.grad is not None
        ui.print(f"  step {step}: aux head used: {'yes' if step % 2 else 'no '}; loss {loss.item():.4f}; "
                 f"aux.weight.grad is {'set' if got else 'None (DDP left it alone)'}")
    del model, optimizer

    # The cost: the same model, every parameter used, with and without the flag. The two
    # take turns step by step, so that whatever else the machine does slows both alike.
    # (With the flag on and nothing unused, torch itself warns about this cost on stderr.)
    x, y = data.train[order[:recipe.GLOBAL_BATCH][rank::world_size]]
    models = {}
    for find in (False, True):
        torch.manual_seed(args.seed)
        models[find] = DDP(AuxNet(), find_unused_parameters=find)
    times: dict = {False: [], True: []}
    for i in range(60):
        for find, timed in models.items():
            t0 = time.perf_counter()
            timed.zero_grad(set_to_none=True)
            F.cross_entropy(timed(x, use_aux=True), y).backward()
            times[find].append(time.perf_counter() - t0)
    ms = {find: 1000 * sorted(t[10:])[len(t[10:]) // 2] for find, t in times.items()}  # medians
    del models, timed
    ui.print(f"cost of the flag (every parameter used; forward + backward, median of 50 on "
             f"rank 0): {ms[False]:.2f} ms without, {ms[True]:.2f} ms with "
             f"({100 * (ms[True] / ms[False] - 1):+.0f}%)")
    evidence["unused_params"] = {"ms_per_step_without": ms[False], "ms_per_step_with": ms[True],
                                 "per_rank_batch": per_rank}


def pitfall_batchnorm(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 7: Synchronise BatchNorm statistics
    # BatchNorm normalises with the mean and variance of *its* batch: on N ranks that is the
    # per-rank batch (96/N samples), not the global one, and each rank's running statistics
    # drift apart. (That is why the shared recipe has no BatchNorm.) nn.SyncBatchNorm
    # all-gathers the statistics so every rank uses the global batch's; it runs on GPUs only,
    # so on the CPU we do what it does by hand: all-reduce sums, sums of squares and counts.
    ui.step(7, "Synchronise BatchNorm statistics")
    broken = args.brk == "batchnorm"
    torch.manual_seed(args.seed)
    layer, bn = nn.Linear(recipe.FEATURES, 8), nn.BatchNorm1d(8)  # a tiny model of our own
    reference = nn.BatchNorm1d(8)  # one process, the whole global batch: the right answer
    if not broken:
        try:  # what nn.SyncBatchNorm says about CPU tensors
            sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(8)))
            sync(torch.randn(4, 8))
        except ValueError as exc:
            ui.print(f"nn.SyncBatchNorm on the CPU: ValueError: {escape(str(exc))}; so we sync by hand")
    order = recipe.epoch_order(len(data.train), args.seed, 0)
    used_means = []
    for step in range(3):  # three training-mode forwards, as in three training steps
        batch = order[step * recipe.GLOBAL_BATCH:(step + 1) * recipe.GLOBAL_BATCH]
        with torch.no_grad():
            h_all = layer(data.train.tensors[0][batch])
            reference(h_all)
            h = h_all[rank::world_size]  # this rank's share of the global batch
            if broken:
                bn(h)
                used_means.append(h.mean(0))
            else:
                used_means.append(synced_batch_norm(bn, h)[1])
    rows = gather([bn.running_mean[:3].tolist(), bn.running_var[:3].tolist()])
    ui.print(f"{'broken: plain BatchNorm1d on each rank' if broken else 'fixed: statistics all-reduced over every rank'}"
             f"; running_mean[:3] and running_var[:3] after 3 steps:")
    for r, (m, v) in enumerate(rows):
        ui.print(f"  rank {r}:       mean {fmt(m)}  var {fmt(v)}")
    ui.print(f"  one process:  mean {fmt(reference.running_mean[:3])}  var {fmt(reference.running_var[:3])}")
    diff = max((bn.running_mean - reference.running_mean).abs().max().item(),
               (bn.running_var - reference.running_var).abs().max().item())
    batch_gap = (used_means[-1] - h_all.mean(0)).abs().max().item()
    diffs = gather([diff, batch_gap])
    for r, (d, g) in enumerate(diffs):
        ui.print(f"  rank {r}: max |running stats - one process| = {d:.1e}; "
                 f"max |mean it normalised with - global batch mean| = {g:.1e}")
    evidence["batchnorm"] = {"max_diff_running_stats": max(d for d, _ in diffs),
                             "max_diff_batch_mean": max(g for _, g in diffs),
                             "ranks_agree": all(row == rows[0] for row in rows)}


def synced_batch_norm(bn: nn.BatchNorm1d, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm with the global batch's statistics (forward only).

    nn.SyncBatchNorm does this on GPUs (it all-gathers each rank's mean, invstd and count,
    and also syncs in backward). Sums and counts add up across ranks, so one all_reduce of
    [sum, sum of squares, count] gives the global mean and variance exactly.
    """
    c = h.shape[1]
    stats = torch.cat([h.sum(0), (h * h).sum(0), torch.tensor([float(len(h))])]).double()
    dist.all_reduce(stats)  # SUM over ranks
    n = stats[-1]
    mean = stats[:c] / n
    var = stats[c:2 * c] / n - mean * mean  # biased: what BatchNorm normalises with
    m = bn.momentum
    bn.running_mean.mul_(1 - m).add_(m * mean.float())
    bn.running_var.mul_(1 - m).add_(m * (var * n / (n - 1)).float())  # unbiased, as BatchNorm
    bn.num_batches_tracked += 1
    out = (h - mean.float()) / torch.sqrt(var.float() + bn.eps) * bn.weight + bn.bias
    return out, mean.float()


def pitfall_evaluation(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 8: Evaluate every sample exactly once
    # DistributedSampler gives every rank the same number of samples; when N does not divide
    # the data set it *pads* by repeating the first samples (drop_last=False). Those repeats
    # are counted twice, and averaging per-rank accuracies adds its own skew. The fix: split
    # without padding (rank, rank+N, ...) and all-reduce the *sums*: correct and count.
    ui.step(8, "Evaluate every sample exactly once")
    broken = args.brk == "eval-padding"
    model = recipe.make_model(args.seed)
    model.load_state_dict(recipe.train_reference(args.seed, epochs=1, data=data))  # 1 epoch
    model.eval()
    x_val, y_val = data.test.tensors[0][:N_VAL], data.test.tensors[1][:N_VAL]
    with torch.no_grad():
        right = model(x_val).argmax(1) == y_val  # the single-process answer, per sample
    truth = right.sum().item() / N_VAL
    if broken:
        mine = list(DistributedSampler(x_val, num_replicas=world_size, rank=rank, shuffle=False))
    else:
        mine = list(range(rank, N_VAL, world_size))  # no padding: some ranks get one less
    with torch.no_grad():
        correct = (model(x_val[mine]).argmax(1) == y_val[mine]).sum().item()
    rows = gather([correct, len(mine)])
    for r, (c, n) in enumerate(rows):
        ui.print(f"  rank {r}: {c}/{n} correct = {c / n:.2%}")
    if broken:
        seen = sum(n for _, n in rows)
        measured = sum(c / n for c, n in rows) / world_size
        ui.print(f"broken: DistributedSampler(val, shuffle=False) evaluated {seen} predictions for "
                 f"{N_VAL} samples (samples {list(range(seen - N_VAL))} twice)")
        ui.print(f"  mean of the per-rank accuracies: {measured:.2%}   one process: {truth:.2%}"
                 f"   <- wrong by {100 * (measured - truth):+.2f} points")
    else:
        totals = torch.tensor([correct, len(mine)])  # int64: counts add up exactly
        dist.all_reduce(totals)  # SUM of correct answers and of counts over ranks
        measured = totals[0].item() / totals[1].item()
        ui.print(f"fixed: all_reduce(\\[correct, count]) = {totals.tolist()} -> "
                 f"{measured:.2%}; one process: {truth:.2%} (equal: {'yes' if measured == truth else 'NO'})")
    evidence["eval"] = {"distributed_accuracy": measured, "one_process_accuracy": truth,
                        "predictions": sum(n for _, n in rows), "samples": N_VAL}


def pitfall_saving(ui, rank, world_size, args, data, store, evidence) -> None:
    # Step 9: Save on rank 0, then barrier, then load
    # Under DDP every rank holds the same weights, so one writer is enough: rank 0. Every rank
    # writing the same path is N times the I/O and a race on one file. And a rank that reads
    # the checkpoint must wait until it is complete: that is the barrier's job. We write to a
    # temporary file and rename it (common.results.atomic_write): readers never see half.
    ui.step(9, "Save on rank 0, then barrier, then load")
    folder = out_dir("12", args.out)
    path = folder / "checkpoint.pt"
    weights = recipe.make_model(args.seed).state_dict()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # no stale file from an earlier run
    dist.barrier()

    if args.brk == "save-every-rank":
        # Every rank calls torch.save(weights, path). To make the race happen every time (in
        # real jobs: now and then), rank 1 is held halfway through its write while rank 0,
        # done with its own save, reads the file back. The store is the referee here.
        blob = io.BytesIO()
        torch.save(weights, blob)
        blob = blob.getvalue()
        if rank not in (0, 1):
            torch.save(weights, path)
        dist.barrier()
        if rank == 0:
            torch.save(weights, path)
            store.set("rank0-saved", "1")
            store.wait(["rank1-half-written"])
            try:
                torch.load(path, weights_only=True)
                ui.say_all("loaded the checkpoint: this time the race was won")
                code = 0
            except Exception as exc:
                ui.say_all(f"torch.load({shown(path)}) while rank 1 is still writing it: "
                           f"{type(exc).__name__}: {escape(str(exc))}")
                code = 1
            store.set("rank0-loaded", "1")
            store.wait(["rank1-done"])  # rank 0 hosts the store: stay until rank 1 is done
            leave(code)
        if rank == 1:
            store.wait(["rank0-saved"])
            with open(path, "wb") as f:  # what torch.save(weights, path) does: truncate, write
                f.write(blob[:len(blob) // 2])
                f.flush()
                ui.say_all(f"torch.save halfway: {len(blob) // 2} of {len(blob)} bytes written")
                store.set("rank1-half-written", "1")
                store.wait(["rank0-loaded"])
                f.write(blob[len(blob) // 2:])
            ui.say_all("finished writing: the file is whole again, but rank 0 already failed")
            store.set("rank1-done", "1")
        leave(0)

    if args.brk == "no-barrier":
        # Rank 0 saves, the others load at once: no barrier between. To lose the race every
        # time (in real jobs: only sometimes, which is worse), rank 0 is slow on purpose: it
        # waits, through the store, until every other rank has looked for the file.
        others = range(1, world_size)
        if rank == 0:
            store.wait([f"rank{r}-looked" for r in others])
            atomic_write(path, lambda f: torch.save(weights, f))
            ui.say_all(f"wrote {shown(path)}, after the others had looked for it")
            store.set("rank0-wrote", "1")
            store.wait([f"rank{r}-done" for r in others])  # rank 0 hosts the store: stay
            leave(0)
        try:
            torch.load(path, weights_only=True)
            ui.say_all("loaded the checkpoint: this time the race was won")
            code = 0
        except FileNotFoundError as exc:
            ui.say_all(f"torch.load right away, no barrier: FileNotFoundError: {escape(str(exc))}")
            code = 1
        store.set(f"rank{rank}-looked", "1")
        store.wait(["rank0-wrote"])
        torch.load(path, weights_only=True)
        ui.say_all("loaded it fine once rank 0 had written it: a barrier would have waited for that")
        store.set(f"rank{rank}-done", "1")
        leave(code)

    timer = Timer()
    if rank == 0:
        atomic_write(path, lambda f: torch.save(weights, f))
    writes = gather(rank == 0)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    loaded = torch.load(path, weights_only=True)
    diff = max((loaded[k] - weights[k]).abs().max().item() for k in weights)
    diffs = gather(diff)
    ui.print(f"fixed: rank 0 wrote {shown(path)} ({sum(writes)} write in all), barrier(), then "
             f"every rank loaded it in {timer.seconds * 1000:.0f} ms")
    ui.print(f"max |loaded - own weights| per rank: {[f'{d:.1e}' for d in diffs]}")
    evidence["saving"] = {"writes": sum(writes), "max_diff_after_load": max(diffs)}


def leave_group(ui, rank, args, evidence) -> None:
    # Step 10: Leave the process group
    # The clean exit, for runs where nothing failed: free what holds the group (the DDP
    # models are gone with their steps), gc.collect(), destroy (common.distributed.teardown).
    # After a *failed* collective we never get here: see leave() below.
    ui.step(10, "Leave the process group")
    dist.barrier()
    if rank == 0:
        folder = out_dir("12", args.out)
        text = json.dumps(evidence, indent=2) + "\n"
        atomic_write(folder / "metrics.json", lambda f: f.write(text.encode()))
        ui.print(f"wrote the numbers above to {shown(folder / 'metrics.json')}")
    teardown()
    ui.print("done: every rank left the process group cleanly")


def collective(ui: UI, what: str, call, wait_if_peer_died: float = 0.0) -> None:
    """Run one collective; if it fails (timeout, mismatch, dead peer), say which, and leave."""
    timer = Timer()
    try:
        call()
    except RuntimeError as exc:
        message = re.sub(r"TensorDeviceTypes=TensorOptions\(.*?memory_format=\(nullopt\)\)",
                         "TensorDeviceTypes=...", str(exc))
        ui.say_all(f"{what} gave up after {timer.seconds:.1f}s: {escape(message.strip())}")
        if wait_if_peer_died:
            # A peer is gone: this rank is not the culprit. Wait to be stopped, so that
            # mp.spawn reports the rank that really failed, not this one.
            time.sleep(wait_if_peer_died)
        leave(1)


def leave(code: int) -> None:
    """Leave this rank *now*, without destroying the process group.

    After a failure the group is in an unknown state and peers may be gone: we do not call
    destroy_process_group() (it can deadlock, NCCL above all), and a normal Python exit
    would run gloo's destructors, which sometimes abort ("terminate called without an
    active exception": measured here after a timeout). os._exit skips all that; mp.spawn
    sees the exit code and stops the other ranks.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (so rank 0 can print them all)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def fmt(values) -> str:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return "[" + ", ".join(f"{v:+.4f}" for v in values) + "]"


# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "busy-port": (
        "Symptom: rank 0 fails at once with DistNetworkError ... EADDRINUSE, address already in "
        "use, while the other ranks, connected to whatever holds the port, wait for an answer "
        "that never comes (their store timeout does not end that wait: mp.spawn stops them "
        "when rank 0 exits). Cause: rank 0 hosts the rendezvous store on MASTER_PORT, and "
        "another process (often an earlier run that has not exited) already listens there. "
        "Fix: leave --master-port out (common.distributed.choose_port asks the OS for a free "
        "port), or check the port before starting any rank, as choose_port() does with a "
        "port you give."),
    "rank-crash": (
        "Symptom: one rank raised an exception; the other ranks were waiting for it in a "
        "collective, and the job ended at once with the crashed rank's error. Cause: a rank "
        "died, so its partners can never complete the collective. Fix: read the first "
        "failure (the crashed rank's traceback), not the errors of the ranks that lost a "
        "peer; let the launcher (mp.spawn here, torchrun later) stop the others, and never "
        "call destroy_process_group() in a finally block after a peer failed: it can block."),
    "set-epoch": (
        "Symptom: every epoch shows the same sample order on every rank, and each rank sees the "
        "same 1/N of the data forever; nothing fails, the model just trains on a less shuffled "
        "stream. Cause: DistributedSampler seeds its shuffle with seed + epoch, and the epoch "
        "only changes when you call sampler.set_epoch(epoch). Fix: call "
        "sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader."),
    "same-seed": (
        "Symptom: every rank drew exactly the same random augmentation, so a global batch has "
        "only 1/N as many different augmentations as samples; nothing fails. Cause: "
        "torch.manual_seed(seed) on every rank makes the global random stream identical "
        "everywhere (DataLoader workers inherit their seeds from it too). Fix: keep the same "
        "seed for the initial weights, and draw per-rank randomness from a private "
        "torch.Generator seeded with (seed, rank)."),
    "collective-missing": (
        "Symptom: the job froze until the process-group timeout, then each rank failed in a "
        "different collective (gloo: Timed out waiting ... for recv). Cause: all_reduce was "
        "called inside `if rank == 0:`, so rank 0 waited for partners who had gone on to a "
        "barrier, which in turn waited for rank 0. Fix: call every collective on every rank; "
        "if only rank 0 needs the result, let every rank compute it and only rank 0 print it. "
        "Set a timeout so that a hang becomes an error, and use TORCH_DISTRIBUTED_DEBUG=DETAIL "
        "(--debug-detail) to have the mismatch named at once."),
    "collective-order": (
        "Symptom: two all_reduces of the same shape in a different order returned wrong sums "
        "with no error at all; then an all_reduce on one rank met a broadcast on the other and "
        "both hung until the timeout. Cause: ranks pair collectives by their position in the "
        "sequence, not by their name or variable; gloo cannot tell two same-shaped all_reduces "
        "apart. Fix: make every rank issue the same collectives in the same order (no "
        "rank-dependent branches or dict orders around them); TORCH_DISTRIBUTED_DEBUG=DETAIL "
        "catches mismatched types and shapes at once, but not two swapped calls that look alike."),
    "unused-params": (
        "Symptom: RuntimeError 'Expected to have finished reduction in the prior iteration "
        "before starting a new one', at the forward *after* the step that skipped a "
        "parameter. Cause: DDP waits for a gradient from every parameter; one that took no "
        "part in the loss never reports, so its bucket's all-reduce never runs. Fix: if a "
        "parameter is never used, delete it or set requires_grad=False; if it is used only "
        "sometimes, pass find_unused_parameters=True, which costs a graph walk every forward "
        "(measured in the default run)."),
    "batchnorm": (
        "Symptom: each rank normalised with its own small batch's statistics, and the ranks' "
        "running mean and variance disagree with each other and with one process on the whole "
        "batch; nothing fails, and the saved model (rank 0's) carries statistics of 1/N of "
        "the data. Cause: BatchNorm computes statistics over the batch it sees, which under "
        "DDP is the per-rank batch. Fix: nn.SyncBatchNorm.convert_sync_batchnorm(model) before "
        "DDP on GPUs (it all-gathers the statistics), or use GroupNorm/LayerNorm, which need "
        "no batch statistics."),
    "eval-padding": (
        "Symptom: the distributed accuracy differs from the single-process accuracy of the "
        "same model on the same data, and the prediction count exceeds the data set. Cause: "
        "DistributedSampler pads every rank to the same length by repeating the first samples "
        "(drop_last=False), and a mean of per-rank accuracies weighs ranks, not samples. Fix: "
        "split without padding and all-reduce the sums, correct and count, then divide once."),
    "save-every-rank": (
        "Symptom: loading the checkpoint failed (a truncated file) while another rank was still "
        "writing the same path; in real jobs this happens only sometimes. Cause: every rank "
        "called torch.save on one path, and a write truncates the file first. Fix: save on rank "
        "0 only (the weights are the same everywhere), to a temporary file that you rename "
        "into place, and make the others wait at a barrier before they load."),
    "no-barrier": (
        "Symptom: FileNotFoundError (or, worse, a stale checkpoint from an earlier run) on the "
        "ranks that load right after rank 0 was asked to save. Cause: nothing made them wait "
        "for rank 0 to finish writing. Fix: dist.barrier() between rank 0's save and the other "
        "ranks' load, and write atomically (temporary file, then rename)."),
}

# The same two modes under TORCH_DISTRIBUTED_DEBUG=DETAIL (--debug-detail), where the
# mismatched collectives fail at once ("gave up after 0.0s") instead of hanging.
EXPLAIN_DETAIL = {
    "collective-missing": (
        "Symptom: both ranks failed at once with 'Detected mismatch between collectives on "
        "ranks': TORCH_DISTRIBUTED_DEBUG=DETAIL compares every collective's type, shapes and "
        "sequence number across ranks before running it, and rank 0's all_reduce met the "
        "others' barrier. Without DETAIL the job freezes until the process-group timeout "
        "instead (run it without --debug-detail to see). Cause: all_reduce was called inside "
        "`if rank == 0:`, so rank 0 and the others reached different collectives. Fix: call "
        "every collective on every rank; if only rank 0 needs the result, let every rank "
        "compute it and only rank 0 print it."),
    "collective-order": (
        "Symptom: two all_reduces of the same shape in a different order returned wrong sums "
        "with no error at all, even under TORCH_DISTRIBUTED_DEBUG=DETAIL; then an all_reduce "
        "on one rank met a broadcast on the other, and DETAIL, which compares every "
        "collective's type and shapes across ranks before running it, failed both at once "
        "('Detected mismatch between collectives on ranks'). Without DETAIL those two hang "
        "until the timeout. Cause: ranks pair collectives by their position in the sequence, "
        "not by their name or variable. Fix: make every rank issue the same collectives in "
        "the same order (no rank-dependent branches or dict orders around them)."),
}


if __name__ == "__main__":
    run(main)
