"""What every rank of the benchmark runs. bench/run.py starts the ranks and reads the results.

One start (common/distributed.py's run_ranks, the package's one way to start N ranks) brings up
all CPU ranks once (starting a process that imports torch costs seconds, so the suite does it
once, not once per benchmark). Each benchmark then runs
on a *subgroup* of the first n ranks; the other ranks wait at a barrier, which sleeps in
the kernel and costs no CPU time, so it does not disturb the ranks that measure.

Timing rule, everywhere: synchronise, meet at a barrier, start the clock, run a window of
work, synchronise, stop the clock. A window of a multi-rank benchmark takes as long as its
slowest rank, so every rank's time goes through an all-reduce with MAX.

Methods that the page compares with each other (no_sync against naive accumulation, the
bucket sizes, overlap on and off) are timed *in turn* (Ctx.timed_in_turn): one repetition of
each per round, the order reversed every other round (A B, B A, A B, ...), so a machine that
slows down or speeds up during the run (another program, the CPU's clock) touches every
method alike. Timed one after the other, the method measured second takes all of a slowdown
that comes late (timed that way, the page once showed no_sync 28% *slower* than naive
accumulation on the wide model, beyond the spread).

Every collective is counted by apparatus/comm.py's CommLog, the package's one counter: DDP's
all-reduce calls and bytes, and the sends and receives of lesson 10's hand-written all-reduces.
deferred_hook below is not a counter but a different schedule.
"""
from __future__ import annotations

import datetime
import gc
import itertools
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from apparatus.comm import CommLog, counted_ddp
from apparatus.ui import UI
from common import lesson_module, recipe
from common.distributed import env_store  # gpu_worker's group (MASTER_*: set by run_ranks)

FLOAT_BYTES = 4
MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # DDP's default bucket_cap_mb (torch/nn/parallel/distributed.py)
LOBBY_TIMEOUT_S = 1800      # waiting ranks: long, since others may measure for minutes


# ---------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------

def sig(x: float, digits: int = 6) -> float:
    """Round to `digits` significant digits: JSON stays readable, nothing real is lost."""
    return float(f"{x:.{digits}g}")


def summary(values: list[float]) -> dict:
    """Every repetition's value, and their median, min and max."""
    vals = [float(v) for v in values]
    return {"values": [sig(v) for v in vals], "median": sig(statistics.median(vals)),
            "min": sig(min(vals)), "max": sig(max(vals))}


# ---------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------

def recipe_mlp(hidden: int, seed: int = recipe.SEED) -> nn.Module:
    """The recipe's MLP (common/recipe.py), only wider: same code, more arithmetic."""
    torch.manual_seed(seed)
    return recipe.MLP(recipe.FEATURES, hidden, recipe.CLASSES)


def deep_mlp(hidden: int, layers: int, seed: int = recipe.SEED) -> nn.Module:
    """The recipe's MLP with `layers` hidden layers instead of one.

    The recipe's MLP has 6 parameter tensors, too few for buckets to differ much; a deeper
    stack gives DDP many gradients that become ready one layer at a time during backward.
    """
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(recipe.FEATURES, hidden), nn.ReLU()]
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, recipe.CLASSES))
    return nn.Sequential(*mods)


def rank_batches(global_batch: int, n: int, rank: int, device: torch.device,
                 count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of `count` global batches of the recipe's synthetic data.

    Sliced once, before any clock starts, so data loading is not what we time. Rank r
    takes positions r, r+n, r+2n, ... of each global batch, as DistributedSampler does.
    """
    x_all, y_all = recipe.synthetic_data()[0].tensors
    batches = []
    for b in range(count):
        idx = (torch.arange(global_batch) + b * global_batch) % len(y_all)
        mine = idx[rank::n]
        batches.append((x_all[mine].to(device), y_all[mine].to(device)))
    return batches


def param_bytes(model: nn.Module) -> list[int]:
    return [p.numel() * p.element_size() for p in model.parameters()]


# ---------------------------------------------------------------------------------------
# A DDP communication hook that holds every bucket until backward ends (no overlap)
# ---------------------------------------------------------------------------------------

class HookState:
    """deferred_hook's state: the group, and the buckets it holds until the last one."""

    def __init__(self, group):
        self.group = group
        self.held: list[torch.Tensor] = []


def deferred_hook(state, bucket):  # no annotations: DDP checks them, and ours are strings
    """Same buckets and calls, but *no overlap*: every bucket waits for the last one.

    DDP hands buckets over in order, the last one when the final gradient of backward is
    ready. Until then we only keep a reference and return an already-finished future whose
    value is the bucket itself; DDP reads those values only when backward has finished
    (Reducer::finalize_backward), after the last call has all-reduced every kept bucket in
    place. So the communication starts after the computation, never beside it.

    The held buckets are all-reduced the way the overlapping case does it: every one
    launched asynchronously (gloo may run several at once), then all waited for. A loop
    of blocking all-reduces would be slower for that reason alone, and the comparison
    would measure the launch style instead of the timing relative to backward. Each goes
    through dist.all_reduce, so CommLog counts them as it counts allreduce_hook's.
    """
    buf = bucket.buffer()
    state.held.append(buf)
    if bucket.is_last():
        size = dist.get_world_size(state.group)
        works = []
        for held in state.held:
            held.div_(size)  # DDP averages: divide first, then sum, as allreduce_hook does
            works.append(dist.all_reduce(held, group=state.group, async_op=True))
        for work in works:
            work.wait()
        state.held.clear()
    done = torch.futures.Future()
    done.set_result(buf)
    return done


def wrap_ddp(model: nn.Module, group, device: torch.device, cap_mb: float | None = None,
             hook=None, state: HookState | None = None) -> DDP:
    """DDP on `group`: torch's own C++ path, or with `hook` (deferred_hook)."""
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=group, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)  # must come before the first backward
    return ddp


def wrap_counted(model: nn.Module, group, cap_mb: float | None = None) -> DDP:
    """DDP on `group` with every bucket through PyTorch's allreduce_hook, exactly what DDP
    does without a hook, where CommLog counts it (apparatus/comm.py's counted_ddp)."""
    return counted_ddp(model, process_group=group,
                       **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))


def expected_buckets(model: nn.Module, cap_mb: float | None) -> int:
    """How many buckets DDP builds after its first backward, by DDP's own rule.

    DDP starts with one bucket, records the order in which gradients become ready during
    the first backward (for an MLP: last layer first), and rebuilds its buckets from that
    order with size limits [first bucket, every later bucket]: 1 MiB then 25 MiB by
    default, bucket_cap_mb for both when you pass it.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MIB)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap
    ready_order = list(model.parameters())[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(ready_order, [first, cap])
    return len(buckets)


def ddp_bucket_sizes(ddp: DDP) -> list[int] | None:
    """The bucket sizes DDP reports about itself (private API, so optional)."""
    try:
        text = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
        return [int(s) for s in str(text).split(",") if s.strip()]
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------

class Ctx:
    """One rank's view of the job: its rank, device, groups and the plan."""

    def __init__(self, rank: int, world: int, plan: dict, device: torch.device):
        self.rank, self.world, self.plan, self.device = rank, world, plan, device
        self.ui = UI(rank, world)
        self.work: dict[int, object] = {}   # n -> group of ranks 0..n-1 (the benchmark's)
        self.ctl: dict[int, object] = {}    # n -> gloo group for barriers and timings
        self.last_cpu_busy: list[float] = []  # see timed()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, values: list[float], n: int) -> list[float]:
        """Per repetition, the largest value over the n ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl[n])
        return t.tolist()

    def clock(self, window, n: int) -> tuple[float, float]:
        """One timed window on this rank: (seconds, CPU seconds used per second)."""
        self.sync()
        dist.barrier(group=self.ctl[n])  # everyone starts together
        t0, c0 = time.perf_counter(), time.process_time()
        window()
        self.sync()
        seconds = time.perf_counter() - t0
        return seconds, (time.process_time() - c0) / seconds

    def timed(self, window, n: int, warmup: int | None = None) -> list[float]:
        """Warm-up windows, then `reps` timed windows; seconds of the slowest rank each."""
        for _ in range(self.plan["warmup"] if warmup is None else warmup):
            window()
        times, busy = [], []
        for _ in range(self.plan["reps"]):
            seconds, cpu = self.clock(window, n)
            times.append(seconds)
            busy.append(cpu)
        # CPU seconds this process used per second of the window, for the least busy rank:
        # near 1 (one thread per rank) when it computed all the time; far below 1 when it
        # waited, for the others' gradients or for a core that another program held
        t = torch.tensor(busy, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctl[n])
        self.last_cpu_busy = t.tolist()
        return self.slowest(times, n)

    def timed_in_turn(self, windows: dict, n: int) -> tuple[dict[str, list[float]], dict]:
        """`reps` timed windows of each of `windows` (name -> window, warmed up already),
        taken in turn (see in_turn): {name: seconds of the slowest rank, one per round}, and
        {name: the place of each of its windows in the order they ran}."""
        got = in_turn(windows, self.plan["reps"], lambda w: self.clock(w, n)[0])
        return {name: self.slowest(t, n) for name, t in got.times.items()}, got.places


class InTurn:
    """What in_turn() measured: times[name][r] is round r's seconds, places[name][r] its place
    in the order the windows ran (0, 1, 2, ...: the JSON shows the interleaving)."""

    def __init__(self, names):
        self.times = {name: [] for name in names}
        self.places = {name: [] for name in names}


def in_turn(windows: dict, reps: int, clock) -> InTurn:
    """`reps` rounds; in each, clock(window) once for every window, the order reversed every
    other round (A B, B A, A B, ...): a drift during the run touches every method alike, and
    no method always goes first (right after a warm-up) or last."""
    names = list(windows)
    got, place = InTurn(names), 0
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            got.times[name].append(clock(windows[name]))
            got.places[name].append(place)
            place += 1
    return got


def train_step(net: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = F.cross_entropy(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def rank_spread(model: nn.Module, group) -> float:
    """Largest |w_rank - w_rank0| over all weights: 0.0 when DDP kept the ranks in step."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


# ---------------------------------------------------------------------------------------
# The benchmarks
# ---------------------------------------------------------------------------------------

def scaling(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    """DDP samples/s on n ranks, same global batch for every n (strong scaling)."""
    group, rank, device = ctx.work[n], ctx.rank, ctx.device
    steps, global_batch = cfg["steps"], cfg["global_batch"]
    batches = rank_batches(global_batch, n, rank, device)
    rows = []
    threads = torch.get_num_threads()
    # on one rank: DDP, the plain model, and (CPU only) the plain model with as many
    # threads as the larger worlds use cores in all, so N ranks also meet one process
    # that has the same cores, not only one that has 1/N of them
    variants = [("ddp", threads)]
    if n == 1:
        variants.append(("no_ddp", threads))
        if device.type == "cpu":
            variants += [("no_ddp", threads * k) for k in cfg["worlds"] if k > 1]
    for variant, want_threads in variants:
        torch.set_num_threads(want_threads)
        model = recipe_mlp(cfg["hidden"]).to(device)
        net = wrap_ddp(model, group, device) if variant == "ddp" else model
        times = ctx.timed(training_window(net, batches, steps), n)
        torch.set_num_threads(threads)
        rows.append({
            "variant": variant, "world_size": n, "threads_per_rank": want_threads,
            "device": device.type, "global_batch": global_batch, "per_rank_batch": global_batch // n,
            "steps_per_rep": steps,
            "samples_per_s": summary([steps * global_batch / t for t in times]),
            "step_ms": summary([t / steps * 1e3 for t in times]),
            # per thread: 100% when every thread computed all the time
            "cpu_busy": summary([b / want_threads for b in ctx.last_cpu_busy]),
            "rank_spread": rank_spread(model, ctx.ctl[n]) if variant == "ddp" else 0.0,
        })
        del net, model  # DDP's reducer holds the group: free it now (the window went with timed())
        gc.collect()
    return rows


def bucketing(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    """DDP throughput and all-reduce calls for several bucket_cap_mb, overlap on and off; every
    setting on its own model, all of them timed in turn (Ctx.timed_in_turn)."""
    group, rank, device = ctx.work[n], ctx.rank, ctx.device
    steps, global_batch = cfg["steps"], cfg["global_batch"]
    batches = rank_batches(global_batch, n, rank, device)
    runs = [(cap, True) for cap in cfg["caps"]] + [(cap, False) for cap in cfg["deferred_caps"]]
    nets, windows, counted = {}, {}, {}
    for cap, overlap in runs:
        model = deep_mlp(cfg["hidden"], cfg["layers"]).to(device)
        ddp = (wrap_counted(model, group, cap) if overlap else
               wrap_ddp(model, group, device, cap, deferred_hook, HookState(group)))
        nets[cap, overlap] = (model, ddp)
        windows[cap, overlap] = window = training_window(ddp, batches, steps)
        # DDP's first backward uses one bucket for everything, then it rebuilds them: at
        # least one warm-up window, and count only after it, in one more untimed window
        # (counting costs a little, so the timed windows do not count)
        for _ in range(max(1, ctx.plan["warmup"])):
            window()
        log = CommLog()
        with log.recording():
            window()
        counted[cap, overlap] = log.summary(steps, kinds=("all_reduce",))  # per backward
    times, places = ctx.timed_in_turn(windows, n)
    rows = []
    for (cap, overlap), (model, ddp) in nets.items():
        t = times[cap, overlap]
        rows.append({
            "bucket_cap_mb": cap, "overlap": overlap, "world_size": n,
            "buckets_expected": expected_buckets(model, cap),
            "bucket_sizes_bytes": ddp_bucket_sizes(ddp),
            "calls_per_backward": counted[cap, overlap]["calls_per_step"],
            "bytes_per_backward": counted[cap, overlap]["data_bytes_per_step"],
            "samples_per_s": summary([steps * global_batch / x for x in t]),
            "step_ms": summary([x / steps * 1e3 for x in t]),
            "timed_in_turn": places[cap, overlap],
            "rank_spread": rank_spread(model, ctx.ctl[n]),
        })
    del nets, windows, window, model, ddp  # DDP's reducer holds the group: free it now
    gc.collect()
    return rows


def training_window(net: nn.Module, batches: list, steps: int):
    """`steps` training steps of `net` on `batches` in turn, with its own optimizer."""
    optimizer = recipe.make_optimizer(net)
    feed = itertools.cycle(batches)

    def window():
        for _ in range(steps):
            x, y = next(feed)
            train_step(net, optimizer, x, y)

    return window


def no_sync(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    """Time per optimizer step of gradient accumulation: naive vs inside ddp.no_sync(), the
    two timed in turn (Ctx.timed_in_turn), each on its own model."""
    group, rank, device = ctx.work[n], ctx.rank, ctx.device
    accum = cfg["accum"]
    rows = []
    for setup in cfg["configs"]:
        steps, global_batch = setup["steps"], setup["global_batch"]
        # each optimizer step: `accum` micro-batches per rank, one global batch in all
        micro_batches = [list(zip(x.chunk(accum), y.chunk(accum)))
                         for x, y in rank_batches(global_batch, n, rank, device)]
        models, windows, counted = {}, {}, {}
        for method in ("naive", "no_sync"):
            model = recipe_mlp(setup["hidden"]).to(device)
            models[method] = model
            windows[method] = accumulation_window(wrap_counted(model, group), micro_batches,
                                                  accum, steps, method == "no_sync")
            for _ in range(max(1, ctx.plan["warmup"])):  # see bucketing()
                windows[method]()
            log = CommLog()
            with log.recording():  # one more untimed window, counted
                windows[method]()
            counted[method] = log.summary(steps, kinds=("all_reduce",))  # per optimizer step
        times, places = ctx.timed_in_turn(windows, n)
        for method, model in models.items():
            rows.append({
                "config": setup["name"], "method": method, "world_size": n, "accum": accum,
                "hidden": setup["hidden"], "global_batch": global_batch,
                "micro_batch": global_batch // (n * accum), "steps_per_rep": steps,
                "step_ms": summary([t / steps * 1e3 for t in times[method]]),
                "timed_in_turn": places[method],  # the place of each repetition in the order run
                "calls_per_step": counted[method]["calls_per_step"],
                "bytes_per_step": counted[method]["data_bytes_per_step"],
                "rank_spread": rank_spread(model, ctx.ctl[n]),
            })
        del models, windows, model
        gc.collect()
    return rows


def accumulation_window(ddp: DDP, micro_batches: list, accum: int, steps: int, quiet: bool):
    """`steps` optimizer steps of `accum` micro-batches each: naive, every backward all-reduces;
    quiet (no_sync), only the last one does."""
    optimizer = recipe.make_optimizer(ddp)
    feed = itertools.cycle(micro_batches)

    def window():
        for _ in range(steps):
            micro = next(feed)
            for i, (x, y) in enumerate(micro):
                last = i == len(micro) - 1
                with ddp.no_sync() if quiet and not last else nullcontext():
                    (F.cross_entropy(ddp(x), y) / accum).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return window


def load_lesson_10():
    """Lesson 10's hand-written algorithms, imported (not copied) from the lesson file.

    Its name starts with a digit, so `import` cannot name it; importlib loads it by path.
    """
    try:
        module = lesson_module("10")
    except ImportError as exc:
        raise RuntimeError(f"{exc}: the all-reduce benchmark imports its ring and "
                           f"parameter-server algorithms") from None
    missing = [name for name in ("Wire", "ring_all_reduce", "server_all_reduce",
                                 "ring_bytes", "server_bytes") if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"lessons/10_allreduce_algorithms.py no longer defines {', '.join(missing)}, which the "
                           f"all-reduce benchmark imports; update bench/measure.py")
    return module


def allreduce(ctx: Ctx, n: int, cfg: dict, lesson) -> list[dict]:
    """Lesson 10's server and ring beside dist.all_reduce: time, bandwidth, bytes per rank."""
    group = ctx.work[n]
    me = dist.get_rank(group)
    rows = []
    for size in cfg["sizes"]:
        g = torch.Generator().manual_seed(7_000 + me)  # per-rank data, private generator
        x = torch.randn(size, generator=g)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        buf = torch.empty_like(x)
        for name in ("server", "ring", "dist.all_reduce"):
            def call():
                buf.copy_(x)  # every algorithm works in place: start from our own numbers
                if name == "dist.all_reduce":
                    dist.all_reduce(buf, group=group)
                else:  # lesson 10's algorithms, on its Wire (dist.isend / dist.irecv)
                    algo = lesson.server_all_reduce if name == "server" else lesson.ring_all_reduce
                    algo(buf, lesson.Wire(group))

            # one call counted by apparatus/comm.py: every send and receive with its bytes
            # (gloo's own all-reduce talks inside C++, where no counter sees its messages)
            log = CommLog()
            with log.recording():
                call()

            # warm-up call: also the correctness check, and it sizes the repetition
            dist.barrier(group=ctx.ctl[n])
            t0 = time.perf_counter()
            call()
            first = ctx.slowest([time.perf_counter() - t0], n)[0]
            torch.testing.assert_close(buf, expected)
            diff = (buf - expected).abs().max().item()
            # a call of a few microseconds is below the clock's resolution and noise: time
            # `inner` calls per repetition (the same number on every rank) and divide
            inner = max(1, min(cfg["max_inner"], round(cfg["rep_seconds"] / max(first, 1e-6))))

            def window():
                for _ in range(inner):
                    call()

            times = [t / inner for t in ctx.timed(window, n, warmup=0)]
            nbytes = size * FLOAT_BYTES
            median = statistics.median(times)
            row = {"world_size": n, "size": size, "bytes": nbytes, "algorithm": name,
                   "time_ms": summary([t * 1e3 for t in times]), "calls_per_rep": inner,
                   # algbw: bytes of the tensor / time; busbw: NCCL-tests' convention for
                   # all-reduce, algbw * 2(N-1)/N, the rate each rank's link actually needs
                   "algbw_GBps": sig(nbytes / median / 1e9),
                   "busbw_GBps": sig(nbytes / median / 1e9 * 2 * (n - 1) / n),
                   "max_abs_diff": diff, "per_rank": None, "busiest_sent": None}
            formula = lesson.server_bytes if name == "server" else lesson.ring_bytes
            # gloo's own all-reduce is a ring as well: its formula, not a measurement
            row["formula_busiest_sent"] = max(formula(size, n, r)[0] for r in range(n))
            if name != "dist.all_reduce":
                mine = (int(sum(c.sent_bytes for c in log.calls if c.kind == "send")),
                        sum(c.data_bytes for c in log.calls if c.kind == "recv"))
                counts = [None] * n
                dist.all_gather_object(counts, mine, group=group)
                per_rank = []
                for r, (sent, received) in enumerate(counts):
                    f_sent, f_received = formula(size, n, r)
                    per_rank.append({"rank": r, "sent": sent, "received": received,
                                     "formula_sent": f_sent, "formula_received": f_received})
                row["per_rank"] = per_rank
                row["busiest_sent"] = max(p["sent"] for p in per_rank)
                row["matches_formula"] = all(p["sent"] == p["formula_sent"] and
                                             p["received"] == p["formula_received"]
                                             for p in per_rank)
            rows.append(row)
    return rows


def dataparallel(ctx: Ctx, cfg: dict, gpus: int) -> dict:
    """nn.DataParallel over `gpus` GPUs in this one process, same global batch as DDP."""
    cuda = ctx.device.type == "cuda"
    device = torch.device("cuda", 0) if cuda else ctx.device
    steps, global_batch = cfg["steps"], cfg["global_batch"]

    def sync_all():
        for i in range(gpus if cuda else 0):
            torch.cuda.synchronize(i)

    model = recipe_mlp(cfg["hidden"]).to(device)
    net = nn.DataParallel(model, device_ids=list(range(gpus)))
    optimizer = recipe.make_optimizer(net)
    feed = itertools.cycle(rank_batches(global_batch, 1, 0, device))

    def window():
        for _ in range(steps):
            x, y = next(feed)
            train_step(net, optimizer, x, y)

    for _ in range(ctx.plan["warmup"]):
        window()
    times = []
    for _ in range(ctx.plan["reps"]):
        sync_all()
        t0 = time.perf_counter()
        window()
        sync_all()
        times.append(time.perf_counter() - t0)
    del net, optimizer, model, window
    gc.collect()
    return {"variant": "dataparallel", "world_size": gpus, "gpus": gpus, "processes": 1,
            "global_batch": global_batch, "steps_per_rep": steps,
            "samples_per_s": summary([steps * global_batch / t for t in times]),
            "step_ms": summary([t / steps * 1e3 for t in times])}


# ---------------------------------------------------------------------------------------
# The processes
# ---------------------------------------------------------------------------------------

def _groups(ctx: Ctx, sizes: set[int], backend: str, timeout: datetime.timedelta) -> None:
    """Every rank creates every group, members or not, in the same order (a rule of new_group)."""
    for n in sorted(sizes):
        ctx.ctl[n] = dist.new_group(list(range(n)), backend="gloo", timeout=timeout)
        ctx.work[n] = ctx.ctl[n] if backend == "gloo" else dist.new_group(
            list(range(n)), backend=backend, timeout=timeout)


def cpu_worker(rank: int, world: int, plan: dict) -> dict | None:
    """One CPU rank: every benchmark of the plan, in order, each on ranks 0..n-1; rank 0
    returns the rows. bench/run.py starts it in a gloo group with the plan's timeout and
    plan["threads_per_rank"] torch threads (explicit: no rank takes every core)."""
    device = torch.device("cpu")
    ctx = Ctx(rank, world, plan, device)
    timeout = datetime.timedelta(seconds=plan["timeout"])
    # Waiting ranks meet here; its timeout is long because a benchmark on the other ranks
    # may take minutes on a busy machine. The benchmarks' own groups keep --timeout.
    lobby = dist.new_group(list(range(world)), backend="gloo",
                           timeout=datetime.timedelta(seconds=LOBBY_TIMEOUT_S))
    _groups(ctx, {n for _, n in plan["phases"]}, "gloo", timeout)
    lesson = load_lesson_10() if any(k == "allreduce" for k, _ in plan["phases"]) else None
    results: dict = {"scaling": [], "bucketing": [], "no_sync": [], "allreduce": []}
    for kind, n in plan["phases"]:
        started = time.perf_counter()
        if rank < n:
            cfg = plan[kind]
            if kind == "allreduce":
                rows = allreduce(ctx, n, cfg, lesson)
            else:
                rows = {"scaling": scaling, "bucketing": bucketing, "no_sync": no_sync}[kind](ctx, n, cfg)
            if rank == 0:
                results[kind] += rows
                ctx.ui.print(progress_line(kind, n, rows, time.perf_counter() - started))
        dist.barrier(group=lobby)
    return results if rank == 0 else None


def gpu_worker(rank: int, world: int, plan: dict) -> dict | None:
    """One GPU rank (NCCL): DDP scaling, then DataParallel and NCCL's all-reduce; rank 0
    returns the rows. It joins its NCCL group itself (bench/run.py starts it without one)."""
    cfg = plan["gpu"]
    # "cpu" only to rehearse this code path on a machine without GPUs (gloo instead of NCCL)
    cuda = cfg.get("device_type", "cuda") == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    ctx = Ctx(rank, world, plan, device)
    timeout = datetime.timedelta(seconds=plan["timeout"])
    dist.init_process_group(backend, store=env_store(rank, world, plan["timeout"]), rank=rank,
                            world_size=world, timeout=timeout,
                            **({"device_id": device} if cuda else {}))
    lobby = dist.new_group(list(range(world)), backend="gloo",
                           timeout=datetime.timedelta(seconds=LOBBY_TIMEOUT_S))
    _groups(ctx, set(cfg["worlds"]) | ({2, world} if world >= 2 else set()), backend, timeout)
    results: dict = {"scaling": [], "bucketing": [], "no_sync": [], "dataparallel": [],
                     "allreduce": []}
    for n in cfg["worlds"]:
        started = time.perf_counter()
        if rank < n:
            rows = scaling(ctx, n, cfg)
            if rank == 0:
                results["scaling"] += rows
                ctx.ui.print(progress_line("gpu scaling", n, rows, time.perf_counter() - started))
        dist.barrier(group=lobby)
    if world >= 2:
        # sections 2 and 4 of the CPU suite, on 2 GPUs (NCCL)
        for kind, measure_fn in (("bucketing", bucketing), ("no_sync", no_sync)):
            started = time.perf_counter()
            if rank < 2:
                rows = measure_fn(ctx, 2, cfg[kind])
                if rank == 0:
                    results[kind] = rows
                    ctx.ui.print(progress_line(f"gpu {kind}", 2, rows,
                                               time.perf_counter() - started))
            dist.barrier(group=lobby)
        if rank == 0:
            results["dataparallel"].append(dataparallel(ctx, cfg, world))
            ctx.ui.print(f"  gpu DataParallel on {world} GPUs: "
                         f"{results['dataparallel'][0]['samples_per_s']['median']:,.0f} samples/s")
        dist.barrier(group=lobby)
        rows = nccl_allreduce(ctx, world, cfg)
        if rank == 0:
            results["allreduce"] = rows
        dist.barrier(group=lobby)
    return results if rank == 0 else None


def nccl_allreduce(ctx: Ctx, n: int, cfg: dict) -> list[dict]:
    """dist.all_reduce of GPU tensors over NCCL: time and bandwidth for several sizes."""
    rows = []
    for size in cfg["allreduce_sizes"]:
        buf = torch.zeros(size, device=ctx.device)  # zeros: sums never overflow

        def window():
            for _ in range(cfg["allreduce_inner"]):
                dist.all_reduce(buf, group=ctx.work[n])

        times = [t / cfg["allreduce_inner"] for t in ctx.timed(window, n)]
        nbytes = size * FLOAT_BYTES
        median = statistics.median(times)
        rows.append({"world_size": n, "size": size, "bytes": nbytes, "algorithm": "nccl all_reduce",
                     "time_ms": summary([t * 1e3 for t in times]),
                     "calls_per_rep": cfg["allreduce_inner"],
                     "algbw_GBps": sig(nbytes / median / 1e9),
                     "busbw_GBps": sig(nbytes / median / 1e9 * 2 * (n - 1) / n)})
    return rows


def progress_line(kind: str, n: int, rows: list[dict], seconds: float) -> str:
    """One line per finished benchmark, so a 5-minute suite shows it is alive."""
    if kind in ("scaling", "gpu scaling"):
        what = ", ".join(f"{r['variant']} {r['samples_per_s']['median']:,.0f} samples/s"
                         for r in rows)
    elif kind.endswith("bucketing"):
        what = f"{len(rows)} settings"
    elif kind.endswith("no_sync"):
        what = ", ".join(f"{r['config']} {r['method']} {r['step_ms']['median']:.1f} ms"
                         for r in rows)
    else:
        what = f"{len(rows)} cells"
    return f"  {kind} on {n} rank{'s' if n > 1 else ''}: {what} ({seconds:.0f} s)"
