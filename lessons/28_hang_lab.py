"""Lesson 28: the hang lab: hang a job on purpose, end it, and name the rank, the call and the line.

Parent: lesson 20 (lessons/20_observability.py)

New since lesson 20: lesson 20 read one skipped collective off the flight recorder. Here a
small DDP job on 3 ranks gets one of six hangs planted on one rank (--hang NAME), and every
instrument runs at once: in each rank a watchdog thread that notices a collective waiting too
long (what NCCL's watchdog does, written by hand for gloo) and a Python stack on SIGUSR1
(faulthandler); in the launcher, py-spy where it is installed; the flight recorder with each
collective's line of code; a monitored barrier in a second group after the timeout. Every hang
ends by itself within --timeout plus a bound, and the lesson reads the evidence side by side and
names the culprit: rank, operation, file:line. --hang mystery hides which hang it planted.

Run:
    make lesson-28                                  # a healthy job: every instrument, nothing wrong
    make lesson-28 ARGS="--hang skip"               # one rank skips a collective
    make lesson-28 ARGS="--hang mystery"            # the graded lab: exercises/28_hang_mystery.py
    .venv/bin/python lessons/28_hang_lab.py --hang stuck --hang-rank 0 --world-size 4

The hangs: order, skip, die, shapes, p2p, stuck (lessons/28_hang_lab/hang_faults.py says what
each stands for; each is one line of Step 3, marked with its name).

Doc: docs/28_hang_lab.md
"""
import contextlib
import datetime
import faulthandler
import io
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 28_hang_lab/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hang_evidence
import hang_faults
import hang_report
from common import recipe
from common.cli import fail, lesson_parser, nonnegative_int, positive_int, run, seed_number
from common.device import share_cpu
from common.distributed import WORLD_COLUMNS, host_store, master_address, spawn, teardown, world_rows
from apparatus.results import atomic_write, claim_out, make_metrics, out_dir, save_results, shown
from apparatus.ui import UI, Timer

MAX_WORLD = 8         # each rank is a Python with torch loaded; 8 on 2 cores is already slow
BUCKET_CAP_MB = 0.001  # lesson 20's small buckets: 3 all-reduces in every backward
SUSPECT_AT = 0.5      # a collective waiting half of --timeout: the watchdog suspects a hang
CHECK_IN_S = 3.0      # after a timeout, how long the monitored barrier waits for everyone
EXIT_S = 5.0          # then the dumps and the exit; the launcher's deadline is timeout + both
KEY = "lesson28/"     # the store's keys for the lab's own bookkeeping (not the instruments')


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=3)
    parser.add_argument("--hang", choices=[*hang_faults.HANGS, "mystery"], default=None,
                        help="plant one hang (see hang_faults.py); mystery: one chosen by --seed, for exercise 28")
    parser.add_argument("--hang-rank", type=nonnegative_int, default=1, help="the rank the hang is planted on")
    parser.add_argument("--hang-step", type=positive_int, default=3, help="the step it fires at (1 or later)")
    parser.add_argument("--steps", type=positive_int, default=8, help="training steps of lesson 01's batch of 96")
    parser.add_argument("--seed", type=seed_number, default=recipe.SEED,
                        help="seed for the weights and, with --hang mystery, for which hang")
    parser.set_defaults(timeout=6.0)  # a hang ends in seconds; production uses minutes (the doc says why)
    args = parser.parse_args()
    n = args.world_size
    recipe.check_world_size(n, f"--world-size {n}", most=MAX_WORLD, least=3)
    if args.device == "cuda":
        fail("lesson 28 plants its hangs in gloo on the CPU, where each behaves the same on every "
             "machine (NCCL's differ: see the doc); run it with --device cpu (or auto)")
    if args.hang not in (None, "mystery"):
        if args.hang_rank >= n or (args.hang == "p2p" and args.hang_rank == 0):
            fail(f"--hang-rank {args.hang_rank}: choose a rank from {int(args.hang == 'p2p')} to {n - 1}"
                 + (" (rank 0 hands out the batches: p2p plants its bug on a receiver)" if args.hang == "p2p" else ""))
        if args.hang_step >= args.steps:
            fail(f"--hang-step {args.hang_step}: choose a step before --steps {args.steps}")
    return args


def main() -> None:
    args = parse_args()
    fault = hang_faults.Fault()  # a healthy job
    if args.hang == "mystery":
        fault = hang_faults.mystery(args.seed, args.world_size, args.steps)
    elif args.hang:
        fault = hang_faults.Fault(args.hang, args.hang_rank, args.hang_step)
    ui = UI(step_mode=args.step)
    what = {None: "a healthy job", "mystery": "a mystery hang"}.get(args.hang, f"--hang {args.hang}")
    ui.title(f"Lesson 28: the hang lab ({what}) on {args.world_size} CPU ranks")

    # Step 1: Arm the recorders, start the ranks under a watch
    # Lesson 20's flight recorder, with one change: each entry keeps the Python line that
    # called it (the dump we write is the pickle form, which has them, turned into JSON).
    # The launcher hosts the store and watches it: a rank that suspects a hang says so there,
    # and the launcher then takes every rank's stack, as an engineer on the machine would.
    ui.step(1, "Arm the recorders, start the ranks under a watch")
    folder = claim_out(out_dir("28", args.out))
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # read once per process, at its first process group
    hang_evidence.clear(folder)  # an earlier run's dumps must not be read as this run's
    addr, port = master_address(args.master_port)
    store, port = host_store(addr, port, args.timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    watch = Watch(store, args.world_size, folder, args.timeout)
    ui.print(f"{args.world_size} ranks, {args.steps} steps; every collective times out after {args.timeout:g}s; "
             f"a collective waiting {args.timeout * SUSPECT_AT:g}s is a suspected hang")
    ui.pause(next_step=(2, "Join the group, a second group for check-ins, a stack on SIGUSR1"))
    said, stopped = io.StringIO(), None
    watch.start()
    try:
        with contextlib.redirect_stderr(said):  # spawn()'s one line: Step 4 shows it
            spawn(worker, (args.world_size, args, fault, folder), args.world_size)
    except SystemExit as exc:  # 1 or 2: a rank failed; 129, 130, 143: Ctrl-C and the like
        stopped = exc
    finally:
        watch.stop()
    ended = time.time()
    finished = sum(store.check([f"{KEY}finished/{r}"]) for r in range(args.world_size))
    if (stopped is not None and stopped.code not in (1, 2)) or (stopped is None and finished < args.world_size):
        sys.stderr.write(said.getvalue())  # interrupted, or q at a --step pause: nothing to read
        if stopped:
            raise stopped
        return
    read_back(ui, args, fault, folder, store, watch, said.getvalue().strip(), ended)


def worker(rank: int, world_size: int, args, fault, folder: Path) -> None:
    """What every process runs: join and arm the instruments, train; after a failed
    collective, leave the evidence (a dump, a check-in) and exit."""
    ui = UI(rank, world_size, step_mode=args.step)
    share_cpu(world_size)
    # Every rank writes its stderr to a log of its own, as on a cluster: gloo's C++ messages,
    # and what faulthandler prints if the process dies of a signal.
    log = os.open(folder / f"log_rank_{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)

    # Step 2: Join the group, a second group for check-ins, a stack on SIGUSR1
    # The timeout bounds every collective of the group: short here, so a hang ends in seconds.
    # The second group is for after a failure: the first one's connections are broken by
    # then, and the monitored barrier needs working ones to ask who is still there.
    # faulthandler writes every thread's Python stack to a file when the process gets SIGUSR1,
    # from inside its C signal handler: it answers while the main thread waits in C++ (a gloo
    # wait) or in Python alike. `kill -USR1 <pid>` is all it takes; a frozen process never answers.
    ui.step(2, "Join the group, a second group for check-ins, a stack on SIGUSR1")
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    check_ins = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CHECK_IN_S))
    stacks = open(folder / f"stack_rank_{rank}.txt", "w")  # kept open: the handler writes to it
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    store.set(f"{KEY}pid/{rank}", str(os.getpid()))  # for the launcher's signals (only now: SIGUSR1 is handled)
    ui.table("The world", WORLD_COLUMNS, world_rows(rank, "cpu", "gloo"))
    try:
        train(ui, rank, world_size, args, fault, folder, store, check_ins)
    except RuntimeError as exc:  # a collective timed out, or lost a peer (gloo: DistBackendError)
        # What NCCL's watchdog does on a timeout, by hand: tell the launcher (it takes every
        # rank's stack now if no watchdog asked before), keep our recorder, check in, leave.
        store.set(f"{KEY}failed/{rank}", json.dumps([time.time(), str(exc).splitlines()[0][:300]]))
        wait_for(store, f"{KEY}stacks-taken", EXIT_S)
        dump_flight_recorder(rank, folder, keep=True)  # unless the watchdog dumped it while it waited
        check_in(rank, folder, check_ins)
        wait_for_files(folder, ("fr_rank_", "check_in_rank_"), world_size, 2.0)  # the others' too
        os._exit(1)  # spawn() sees the exit code and stops the other ranks


def train(ui, rank, world_size, args, fault, folder, store, check_ins) -> None:
    # Step 3: Train, with one hang planted
    # Lesson 20's job, every call of a real step written out: (a) rank 0 hands every rank its
    # rows of the batch (send/recv), (b) DDP all-reduces the gradients inside backward,
    # (c) the log's loss is all-reduced, (d) the accuracy's hits all-gathered, and (e) rank 0's
    # decision to go on is broadcast. Each planted bug is marked with its --hang name.
    ui.step(3, "Train, with one hang planted")
    data = recipe.load_data()
    ddp_model = DDP(recipe.make_model(args.seed), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = recipe.make_optimizer(ddp_model)
    order = recipe.epoch_order(len(data.train), args.seed, 0)
    per_rank = recipe.GLOBAL_BATCH // world_size
    rows = torch.empty(per_rank, recipe.FEATURES + 1)  # a rank's x, and y as a last column
    losses, timer = [], Timer()
    training = threading.Event()  # the watchdog watches while it is set: training only
    training.set()
    threading.Thread(target=watchdog, args=(rank, store, args.timeout * SUSPECT_AT, folder, training),
                     daemon=True).start()
    with ui.progress(args.steps, f"training on {world_size} ranks") as bar:
        for step in range(args.steps):
            if fault.fires(rank, step):
                store.set(f"{KEY}started", repr(time.time()))  # the lab's clock: when the bug fires
            # (a) the batch: rank 0 reads it and sends each rank its rows
            if rank == 0:
                x, y = data.train[order[step * recipe.GLOBAL_BATCH:(step + 1) * recipe.GLOBAL_BATCH]]
                pieces = torch.cat([x, y.unsqueeze(1).float()], 1).chunk(world_size)
                for r in range(1, world_size):
                    dist.send(pieces[r].contiguous(), dst=r)
                rows = pieces[0]
            else:
                dist.recv(rows, src=0)
                if fault.here(rank, step, "p2p"):
                    dist.recv(torch.empty(per_rank), src=0)  # --hang p2p: per-sample weights rank 0 never sends
            x, y = rows[:, :-1], rows[:, -1].long()
            # (b) forward and backward
            if fault.here(rank, step, "stuck"):
                queue.Queue().get()  # --hang stuck: waits for a batch from a helper thread that died
            if fault.here(rank, step, "die"):
                os.kill(os.getpid(), signal.SIGSTOP)  # stopped dead: no exit, no error, sockets left open
            logits = ddp_model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's bucket all-reduces (--hang die leaves the others waiting here)
            optimizer.step()
            # (c) the loss, (d) the accuracy's hits, (e) rank 0's decision
            stats = torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)))])
            hits = (logits.argmax(1) == y).long()
            if fault.here(rank, step, "shapes"):
                hits = hits[:-1]  # an uneven last batch: one sample fewer on this rank
            go_on = torch.ones(1)
            if fault.here(rank, step, "order"):
                dist.broadcast(go_on, src=0)  # --hang order: moved before the all_reduce, on one rank only
            if not fault.here(rank, step, "skip"):
                dist.all_reduce(stats)  # --hang skip: one rank leaves this call out
            gathered = [torch.empty_like(hits) for _ in range(world_size)]
            dist.all_gather(gathered, hits)  # --hang shapes: one rank's tensor is one element short
            losses.append((stats[0] / stats[1]).item())
            if rank == 0:
                go_on.fill_(float(math.isfinite(losses[-1])))  # a NaN loss stops every rank
            if not fault.here(rank, step, "order"):
                dist.broadcast(go_on, src=0)
            bar.advance()
            ui.log(1, step + 1, args.steps, losses[-1], timer.rate((step + 1) * recipe.GLOBAL_BATCH))
            if not go_on.item():
                break
    training.clear()  # what follows (rank 0 saving while the others wait) is slow, not stuck
    accuracy = torch.cat(gathered).float().mean().item()

    # The healthy end, as lesson 20's: everyone checks in, every rank keeps its recorder,
    # rank 0 saves; then free the DDP model, collect garbage, leave the group.
    check_in(rank, folder, check_ins)
    dump_flight_recorder(rank, folder)
    if rank == 0:
        weights = {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}
        save_results(folder, weights, make_metrics(
            lesson="28", world_size=world_size, backend="gloo", device="cpu", losses=losses,
            final_accuracy=accuracy, wall_seconds=timer.seconds, samples=len(losses) * recipe.GLOBAL_BATCH,
            seed=args.seed, steps=len(losses), timeout_seconds=args.timeout, hang=None,
            ended_after_seconds=None, diagnosis=None, truth=None))
    store.set(f"{KEY}finished/{rank}", "1")
    dist.barrier()
    del ddp_model, optimizer
    teardown()


def watchdog(rank: int, store, suspect_after: float, folder: Path, training: threading.Event) -> None:
    """A thread in every rank: NCCL's watchdog, by hand for gloo. Ten times a second, while
    training, it reads this rank's own flight recorder: a collective enqueued but not completed
    for longer than suspect_after is a suspected hang, told to the launcher through the store.
    When the launcher has taken the stacks, it dumps the recorder, while the collective still waits."""
    c10d = torch._C._distributed_c10d  # private, as lesson 20 says: what the watchdog and fr_trace use
    since, told, dumped = None, False, False
    while training.is_set():
        status = json.loads(c10d._dump_fr_trace_json(False, False))["pg_status"].get("0", {})
        enqueued = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
        if enqueued <= completed:
            since = None
        elif since is None or since[0] != enqueued:
            since = (enqueued, time.monotonic())
        elif not told and time.monotonic() - since[1] > suspect_after:
            entries = json.loads(c10d._dump_fr_trace_json(True, False))["entries"]
            waiting = [e for e in entries if not e["retired"] and int(e["pg_id"]) == 0]
            what = (f"{waiting[0]['profiling_name']} #{waiting[0]['collective_seq_id']}" if waiting
                    else "a call the recorder has no entry for")
            store.set(f"{KEY}suspect/{rank}", json.dumps([time.time(), what, time.monotonic() - since[1]]))
            told = True
        if not dumped and store.check([f"{KEY}stacks-taken"]):
            dump_flight_recorder(rank, folder)
            dumped = True
        time.sleep(0.1)


def dump_flight_recorder(rank: int, folder: Path, keep: bool = False) -> None:
    """This rank's recorder, with every collective's Python frames, as JSON (keep: unless written)."""
    path = folder / f"fr_rank_{rank}.json"
    if keep and path.exists():
        return
    raw = torch._C._distributed_c10d._dump_fr_trace(True, True, False)  # collectives, their stacks, all
    text = hang_evidence.dump_as_json(raw)
    atomic_write(path, lambda f: f.write(text.encode()))  # whole or absent: we may be stopped next


def check_in(rank: int, folder: Path, group) -> None:
    """monitored_barrier on the second group: rank 0 waits for every rank and names those that
    never come (lesson 20, Step 6); each rank writes down what it was told."""
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=CHECK_IN_S), wait_all_ranks=True)
        said = {"passed": True, "error": None}
    except RuntimeError as exc:
        said = {"passed": False, "error": str(exc).splitlines()[0][:500]}
    atomic_write(folder / f"check_in_rank_{rank}.json", lambda f: f.write(json.dumps(said).encode()))


def wait_for(store, key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_files(folder: Path, prefixes: tuple[str, ...], world_size: int, seconds: float) -> None:
    """Until every rank has written <prefix><rank>.json, or `seconds` have passed (a dead rank never will)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(
            (folder / f"{prefix}{r}.json").exists() for prefix in prefixes for r in range(world_size)):
        time.sleep(0.05)


class Watch(threading.Thread):
    """The launcher's side, a thread beside spawn(): at the first alarm in the store (a
    watchdog's suspicion, or a failed collective) it sends SIGUSR1 to every rank and runs
    `py-spy dump` on each, then tells the ranks to dump their recorders. From that alarm on,
    the job has --timeout + CHECK_IN_S + EXIT_S to end; after that the watch kills every rank."""

    def __init__(self, store, world: int, folder: Path, timeout: float):
        super().__init__(daemon=True)
        self.store, self.world, self.folder, self.timeout = store, world, folder, timeout
        self.events: list[tuple[float, str]] = []  # (time.time(), what happened)
        self.pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        self.done = threading.Event()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def pids(self) -> dict[int, int]:
        return {r: int(self.store.get(f"{KEY}pid/{r}")) for r in range(self.world)
                if self.store.check([f"{KEY}pid/{r}"])}

    def run(self) -> None:
        deadline = None
        while not self.done.wait(0.1):
            alarms = [k for r in range(self.world) for k in (f"{KEY}suspect/{r}", f"{KEY}failed/{r}")
                      if self.store.check([k])]
            if alarms and deadline is None:
                deadline = time.monotonic() + self.timeout + CHECK_IN_S + EXIT_S
                self.take_stacks()
                self.store.set(f"{KEY}stacks-taken", repr(time.time()))
            if deadline is not None and time.monotonic() > deadline:
                self.events.append((time.time(), "the launcher's deadline passed: it killed every rank"))
                for pid in self.pids().values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return

    def take_stacks(self) -> None:
        pids = self.pids()
        for rank, pid in pids.items():  # faulthandler, inside each rank, writes its own stack
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        self.events.append((time.time(), f"the launcher sent SIGUSR1 to every rank (pids {', '.join(map(str, pids.values()))})"))
        if not self.pyspy:
            return
        for rank, pid in pids.items():  # py-spy reads the process from outside (needs ptrace rights)
            text = "py-spy failed: the process had ended"  # a rank that crashed (shapes): nothing to read
            try:
                if not ended(pid):
                    out = subprocess.run([self.pyspy, "dump", "--pid", str(pid)], capture_output=True,
                                         text=True, timeout=5)
                    why = [re.sub(r"^(Error|\d+):\s*", "", line.strip()) for line in out.stderr.splitlines()
                           if line.strip() and line.strip() != "Caused by:"]
                    text = out.stdout if out.returncode == 0 else f"py-spy failed: {': '.join(why[:2])}"
            except (subprocess.TimeoutExpired, OSError) as exc:
                text = f"py-spy failed: {exc}"
            atomic_write(self.folder / f"pyspy_rank_{rank}.txt", lambda f: f.write(text.encode()))
        self.events.append((time.time(), f"the launcher ran py-spy dump on every rank ({self.pyspy})"))


def ended(pid: int) -> bool:
    """Has this process ended (a zombie, or gone)? Read from Linux's /proc; elsewhere, False."""
    if not Path("/proc/self").exists():
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def read_back(ui, args, fault, folder, store, watch, launcher_line: str, ended: float) -> None:
    """What the ranks left behind, read after they are gone (hang_report.py prints it)."""
    evidence = hang_evidence.collect(folder, args.world_size)
    started = float(store.get(f"{KEY}started")) if store.check([f"{KEY}started"]) else None

    # Step 4: How the job ended
    # Every alarm and failure the store holds, on one clock from the moment the bug fired, and
    # the launcher's own line. Nothing here names the culprit yet.
    ui.step(4, "How the job ended")
    hang_report.timeline(ui, store, KEY, args.world_size, watch.events, started, ended, launcher_line)

    # Step 5: Read the flight recorders side by side
    # One row per sequence number, one column per rank: the call, its sizes, its line, and
    # WAITING where it never completed. The first row where they differ is where it broke.
    ui.step(5, "Read the flight recorders side by side")
    hang_report.recorders(ui, evidence)

    # Step 6: Read the check-ins
    # The monitored barrier after the timeout: who never answered is dead or stuck outside
    # any collective; who answered was waiting in a collective, like everybody else.
    ui.step(6, "Read the check-ins")
    hang_report.check_ins(ui, evidence, hung=args.hang is not None)

    # Step 7: Read every rank's stack
    # faulthandler's stacks (and py-spy's, where installed), taken while the job hung: where
    # each rank's main thread was, innermost call first.
    ui.step(7, "Read every rank's stack")
    suspected = any(store.check([f"{KEY}suspect/{r}"]) for r in range(args.world_size))
    hang_report.stacks(ui, evidence, watch.pyspy, taken=store.check([f"{KEY}stacks-taken"]), late=not suspected)

    # Step 8: Name the culprit
    # The verdict comes from the evidence alone (hang_evidence.diagnose); the planted fault is
    # only used afterwards, to check it. A mystery's verdict is yours to write.
    ui.step(8, "Name the culprit")
    verdict = None if args.hang == "mystery" else hang_evidence.diagnose(evidence)
    truth = hang_faults.truth(fault) if fault.kind and args.hang != "mystery" else None
    ended_after = round(ended - started, 2) if started else None
    if args.hang is None and not (folder / "final.pt").exists():
        fail("the healthy job ended without its results; see the lines above", code=1)
    if args.hang is None:
        ui.print(f"no hang: nothing to name. Plant one: make lesson-28 ARGS=\"--hang skip\" "
                 f"(or {', '.join(hang_faults.HANGS)}); wrote {shown(folder / 'metrics.json')}")
        return
    metrics = {"lesson": "28", "world_size": args.world_size, "backend": "gloo", "device": "cpu",
               "hang": args.hang, "seed": args.seed, "timeout_seconds": args.timeout,
               "bound_seconds": CHECK_IN_S + EXIT_S, "ended_after_seconds": ended_after,
               "diagnosis": verdict, "truth": truth, "right": hang_faults.matches(verdict, truth),
               "evidence": sorted(p.name for p in folder.iterdir() if p.name.startswith(hang_evidence.STATES))}
    text = json.dumps(metrics, indent=2) + "\n"
    atomic_write(folder / "metrics.json", lambda f: f.write(text.encode()))
    hang_report.verdict(ui, args, verdict, truth, metrics, folder)
    took = f"{ended_after:g}s after the hang began" if ended_after is not None else "after it hung"
    if args.hang == "mystery":
        fail(f"the job hung and ended {took}; who did it? Write RANK, OPERATION and WHERE in "
             f"exercises/28_hang_mystery.py (SEED = {args.seed}, WORLD_SIZE = {args.world_size}), then make check-28", code=1)
    if verdict is None:
        fail(f"the job hung and ended {took}; the evidence named nobody (see the steps above)", code=1)
    fail(f"hang: rank {verdict['rank']}, {verdict['operation']} at {verdict['where']} ({verdict['kind']}); "
         f"the job ended {took}", code=1)


if __name__ == "__main__":
    run(main)
