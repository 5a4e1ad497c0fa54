"""Check a learner's exercise: `make check-NN [FILE=path]`.

Every check runs the learner's code for real and prints either "ok: ..." (exit 0) or what
is still wrong and a hint (exit 1). The checks of lessons 05-12 live in this file, one
function per exercise, registered in CHECKS; from lesson 13 on, each check is a file of its
own, tools/checks/check_NN.py, that defines STARTER (the exercise's path) and check(path),
and shares this file's harness (NotYet, load, run_world). The starters are in exercises/.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.cli import fail  # noqa: E402

if __name__ == "__main__":  # so that `from check_exercise import NotYet` finds this very module
    sys.modules.setdefault("check_exercise", sys.modules[__name__])


class NotYet(Exception):
    """The learner's answer is not right yet; the message says why."""


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise NotYet(f"{path} does not run: {type(exc).__name__}: {exc}")
    return module


def check_05(path: Path) -> str:
    """Orders differ between epochs, and the ranks still split every epoch exactly."""
    module = load(path)
    size, world, epochs = 96, 3, 3
    per_rank = [module.epoch_orders(size, world, r, epochs) for r in range(world)]
    for epoch in range(epochs):
        together = sorted(i for r in range(world) for i in per_rank[r][epoch])
        if together != list(range(size)):
            raise NotYet(f"in epoch {epoch} the {world} ranks together do not read every sample "
                         f"exactly once; each epoch must still be split between the ranks")
    for r in range(world):
        if per_rank[r][0] == per_rank[r][1] or per_rank[r][1] == per_rank[r][2]:
            raise NotYet(f"rank {r} reads the same order in two epochs: "
                         f"{per_rank[r][0][:6]}... both times. Where does the epoch enter the sampler?")
    if module.epoch_orders(size, world, 0, 2) != module.epoch_orders(size, world, 0, 2):
        raise NotYet("two calls with the same seed give different orders; keep it deterministic")
    return f"every epoch has a new order on each of {world} ranks, and every epoch is split exactly"


def check_06(path: Path) -> str:
    """Run the file under two simulated torchrun nodes and compare with the real layout."""
    proc = subprocess.run([sys.executable, "tools/nodes.py", "--nnodes", "2",
                           "--nproc-per-node", "2", "--rdzv-timeout", "30", "--", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise NotYet(f"the file did not run under torchrun: {proc.stderr.strip().splitlines()[-1:]}")
    # workers share one stdout: find every {...} report, even if two landed on one line
    reports = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
    if len(reports) != 4:
        raise NotYet(f"expected 4 workers to report one JSON line each, got {len(reports)}")
    got = sorted((r["rank"], r["local_rank"], r["world_size"], r["node"]) for r in reports)
    want = [(0, 0, 4, 0), (1, 1, 4, 0), (2, 0, 4, 1), (3, 1, 4, 1)]
    if got != want:
        raise NotYet(f"the 4 workers answered (rank, local_rank, world_size, node) = {got}; "
                     f"torchrun had started {want}. Which variables does torchrun set?")
    alone = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    found = re.findall(r"\{[^{}]*\}", alone.stdout)
    if alone.returncode != 0 or not found:
        raise NotYet(f"under plain python the file failed: {alone.stderr.strip().splitlines()[-1:]}")
    answer = json.loads(found[-1])
    if (answer["rank"], answer["local_rank"], answer["world_size"], answer["node"]) != (0, 0, 1, 0):
        raise NotYet(f"under plain python it answered {answer}; expected a world of one")
    return "all 4 workers on 2 nodes know who they are, and plain python is a world of one"


# ---------------------------------------------------------------------------------------
# Running a learner's code on several ranks. Each rank is a fresh process that joins a
# gloo group on a free port, with a timeout on the group and on the whole run; it sends
# back what the rank function returns, or why it failed. A rank that fails makes the
# others stop at once: they may be waiting for it.
# ---------------------------------------------------------------------------------------

GROUP_TIMEOUT_S = 20   # every collective and point-to-point message gives up after this
WORLD_TIMEOUT_S = 120  # a whole run of ranks, start-up included (torch imports take a while)


def _where(exc: BaseException, learner: str) -> str:
    """' (your_file.py, line 12)' for the deepest frame of the learner's file, if any."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == learner]
    return f" ({Path(learner).name}, line {frames[-1].lineno})" if frames else ""


def _rank_main(rank: int, world: int, port: int, target, args: tuple, learner: str,
               results) -> None:
    """One rank: join the group, run target(rank, world, *args), report, leave."""
    import datetime
    import gc
    import io
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share few cores: one thread each

    def report(kind: str, payload) -> None:
        results.put((rank, kind, payload))
        results.close()
        results.join_thread()  # the message is in the pipe before this process may end

    try:
        import os

        from common.distributed import env_store  # a store on 127.0.0.1 only

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", store=env_store(rank, world, GROUP_TIMEOUT_S), rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        value = target(rank, world, *args)
    except NotYet as exc:
        report("not yet", str(exc))
        os._exit(1)  # no destroy_process_group after a failure: the others may be stuck
    except BaseException as exc:  # noqa: BLE001 - the learner's error, in one line
        text = " ".join(str(exc).split())
        text = text if len(text) < 300 else text[:300] + " ..."
        if "Timed out" in text:  # gloo: "Timed out waiting 20000ms for recv operation ..."
            report("error", f"waited {GROUP_TIMEOUT_S}s for a message that never came"
                            f"{_where(exc, learner)}: do all ranks make the same calls, and "
                            f"does every receive have a matching send?")
        else:
            report("error", f"raised {type(exc).__name__}: {text}{_where(exc, learner)}")
        os._exit(1)
    buffer = io.BytesIO()
    torch.save(value, buffer)  # tensors, numbers, strings, lists, dicts: weights_only-safe
    report("ok", buffer.getvalue())
    del value
    gc.collect()  # free anything (a DDP reducer) that still holds the group, then leave
    dist.destroy_process_group()


def run_world(world: int, target, args: tuple, learner: Path) -> list:
    """target(rank, world, *args) on `world` new processes in a gloo group: the results by rank.

    Raises NotYet with the first rank's error, or when the ranks do not finish in time.
    """
    import io
    import multiprocessing
    import queue
    import time

    import torch

    from common.distributed import free_port

    if "forkserver" in multiprocessing.get_all_start_methods():
        # A server process imports torch once; every rank is then forked from it, fresh and
        # single-threaded, without importing torch again (the slow part of starting a rank).
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "common.recipe"])
    else:
        ctx = multiprocessing.get_context("spawn")  # as mp.spawn does
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, target, args, str(learner), results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    quiet_since = None
    try:
        while len(got) < world:
            try:
                rank, kind, payload = results.get(timeout=0.5)
                quiet_since = None
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise NotYet(f"the {world} ranks did not finish within {WORLD_TIMEOUT_S}s: "
                                 f"does a rank wait for a message that never comes?")
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead:  # give a message still in the pipe a moment to arrive
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 3:
                        raise NotYet(f"with {world} ranks, rank {dead[0]} died (exit code "
                                     f"{procs[dead[0]].exitcode}) without an error message")
                continue
            if kind != "ok":
                raise NotYet(f"with {world} ranks, rank {rank} {payload}" if kind == "error"
                             else payload)
            got[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        finished = len(got) == world
        for p in procs:
            p.join(timeout=15 if finished else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def _listed(values, limit: int = 6) -> str:
    values = list(values)
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


# ---------------------------------------------------------------------------------------
# Lesson 07: resume mid-epoch
# ---------------------------------------------------------------------------------------

def check_07(path: Path) -> str:
    """Resuming after a snapshot trains exactly the rest of the epoch, in the sampler's order."""
    from collections import Counter

    from torch.utils.data import DistributedSampler

    module = load(path)
    # (global step of the snapshot, world size on resume, seed, data set size, global batch)
    cases = [(40, 2, 0, 3072, 96), (40, 3, 0, 3072, 96), (32, 4, 0, 3072, 96),
             (5, 1, 0, 3072, 96), (77, 6, 7, 3072, 96), (27, 2, 3, 960, 48)]
    for step, world, seed, size, batch in cases:
        per_epoch = size // batch
        epoch, done = divmod(step, per_epoch)
        where = (f"resuming after global step {step} (epoch {epoch + 1}, {done} of its "
                 f"{per_epoch} steps done; global batch {batch}, {size} samples, seed {seed}) "
                 f"on {world} rank(s)")
        truth, answers = [], []
        for rank in range(world):
            sampler = DistributedSampler(range(size), num_replicas=world, rank=rank,
                                         shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            truth.append(list(sampler)[done * (batch // world):])
            try:
                answers.append([int(i) for i in module.still_to_do(
                    step, world, rank, seed=seed, dataset_size=size, global_batch=batch)])
            except Exception as exc:
                raise NotYet(f"{where}: still_to_do(..., rank={rank}) raised "
                             f"{type(exc).__name__}: {exc}{_where(exc, str(path))}")
        sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        trained = set(list(sampler)[:done * batch])  # the epoch's first `done` global batches
        count = Counter(i for answer in answers for i in answer)
        again = [i for i in count if i in trained]
        if again:
            raise NotYet(f"{where}: the ranks would train {len(again)} samples again that the "
                         f"snapshot's {done} steps of this epoch already trained (ids "
                         f"{_listed(again)}). How many of this epoch's samples does the "
                         f"snapshot hold, and how many of them were this rank's?")
        twice = [i for i, c in count.items() if c > 1]
        if twice:
            raise NotYet(f"{where}: {len(twice)} samples would be trained twice by the ranks "
                         f"together (ids {_listed(twice)}); each rank must keep to its own share")
        missing = sorted(set(range(size)) - trained - set(count))
        if missing:
            raise NotYet(f"{where}: {len(missing)} samples of the epoch would be skipped: no "
                         f"step has trained them yet, and no rank would train them now (ids "
                         f"{_listed(missing)})")
        strange = sorted(set(count) - set(range(size)))
        if strange:
            raise NotYet(f"{where}: ids outside the data set: {_listed(strange)}")
        for rank in range(world):
            if answers[rank] != truth[rank]:
                at = next((k for k, (a, b) in enumerate(zip(answers[rank], truth[rank])) if a != b),
                          min(len(answers[rank]), len(truth[rank])))
                raise NotYet(f"{where}: rank {rank} gets the right samples, but not in the order "
                             f"the uninterrupted run would train them (from position {at} on), so "
                             f"the resumed batches, and the weights, would differ. Keep "
                             f"DistributedSampler's order for the epoch")
    return (f"{len(cases)} resumes (mid-epoch, at an epoch boundary, with another world size) "
            f"train the rest of the epoch exactly once, in the sampler's order")


# ---------------------------------------------------------------------------------------
# Lesson 08: accumulation with no_sync
# ---------------------------------------------------------------------------------------

SEED = 0


def _counting_hook(state: dict, bucket):
    """A DDP comm hook: count every bucket and every full sync, then all-reduce as DDP would."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state["calls"] += 1
    state["syncs"] += int(bucket.is_last())
    return allreduce_hook(None, bucket)


def _rank_08(rank: int, world: int, path: str, accums: tuple, steps: int) -> list:
    """Build lesson 08's DDP model with a counting hook and let the learner's loop train it,
    once for each number of micro-batches per step in `accums`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common import recipe

    module = load(Path(path))
    x_all, y_all = recipe.synthetic_data()[0].tensors
    order = torch.tensor(recipe.epoch_order(len(y_all), SEED, 0))
    per_rank = recipe.GLOBAL_BATCH // world
    runs = []
    for accum in accums:
        micro = per_rank // accum
        batches = []
        for k in range(steps):  # rank r's share of global batch k, as DistributedSampler deals it
            mine = order[k * recipe.GLOBAL_BATCH + rank:(k + 1) * recipe.GLOBAL_BATCH:world]
            batches += [(x_all[mine[m * micro:(m + 1) * micro]],
                         y_all[mine[m * micro:(m + 1) * micro]]) for m in range(accum)]
        model = recipe.make_model(SEED)
        ddp_model = DDP(model)
        counter = {"calls": 0, "syncs": 0}
        ddp_model.register_comm_hook(counter, _counting_hook)
        optimizer = recipe.make_optimizer(ddp_model)
        stepped = [0]
        optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
        module.accumulate(ddp_model, optimizer, batches, accum)
        del ddp_model, optimizer
        runs.append({"calls": counter["calls"], "syncs": counter["syncs"], "steps": stepped[0],
                     "micro_batches": len(batches),
                     "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return runs


def _reference_steps(steps: int) -> dict:
    """One process, no accumulation: one optimizer step per global batch of 96."""
    import torch
    import torch.nn.functional as F

    from common import recipe

    torch.set_num_threads(1)
    x_all, y_all = recipe.synthetic_data()[0].tensors
    order = torch.tensor(recipe.epoch_order(len(y_all), SEED, 0))
    model = recipe.make_model(SEED)
    optimizer = recipe.make_optimizer(model)
    for k in range(steps):
        idx = order[k * recipe.GLOBAL_BATCH:(k + 1) * recipe.GLOBAL_BATCH]
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def check_08(path: Path) -> str:
    """One all-reduce per optimizer step, and the weights of training without accumulation."""
    load(path)  # a file that does not even import fails here, before any rank starts
    world, steps, accums = 2, 6, (4, 2)
    reference = _reference_steps(steps)
    ranks = run_world(world, _rank_08, (str(path), accums, steps), path)
    for i, accum in enumerate(accums):
        runs = [r[i] for r in ranks]
        setup = (f"{world} ranks, {steps} global batches of 96, {accum} micro-batches of "
                 f"{96 // world // accum} per rank and step")
        r0 = runs[0]
        if r0["steps"] != steps:
            raise NotYet(f"{setup}: the optimizer stepped {r0['steps']} times for "
                         f"{r0['micro_batches']} micro-batches; it should step once every "
                         f"{accum} of them, {steps} times in all")
        spread = max(_max_diff(r["weights"], r0["weights"]) for r in runs)
        if spread > 0:
            raise NotYet(f"{setup}: the ranks' weights differ by up to {spread:.1e}: some step "
                         f"used a gradient that was never all-reduced")
        if r0["syncs"] != steps:
            raise NotYet(f"{setup}: DDP all-reduced the gradients {r0['syncs']} times "
                         f"({r0['calls']} bucket calls) for {steps} optimizer steps; it should be "
                         f"once per step. Which backward passes should sync, and where does "
                         f"DDP decide that? (lesson 08, Steps 6 and 7)")
        diff = _max_diff(r0["weights"], reference)
        if diff > 1e-5:
            raise NotYet(f"{setup}: one all-reduce per step, but the weights are {diff:.1e} away "
                         f"from one process training on each global batch of 96 at once (allowed: "
                         f"1e-5). Compare the accumulated gradient with the big batch's: what "
                         f"does each micro-batch's loss average over? (lesson 08, Step 7)")
    return (f"{world} ranks, 4 and 2 micro-batches per step: one all-reduce per optimizer step, "
            f"and the weights of training without accumulation (max diff {diff:.1e})")


# ---------------------------------------------------------------------------------------
# Lesson 09: the module. prefix
# ---------------------------------------------------------------------------------------

def _rank_09(rank: int, world: int, path: str) -> dict:
    """Save a DDP model whose parts are called `module` and `submodule`, strip the keys with
    the learner's function, and load them strictly into the plain model."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Lesson 09's own model (Step 8): keys stem.submodule.*, block.module.*, head.*
    from apparatus.checkpoint_keys import TinyNet

    module = load(Path(path))
    torch.manual_seed(0)
    trained = TinyNet()
    ddp_model = DDP(trained)
    saved = ddp_model.state_dict()  # the file a DDP job writes: module.stem.submodule.weight, ...
    stripped = module.strip_prefix(saved, "module.")
    if stripped is None:
        raise NotYet("strip_prefix returned None; return the new state_dict")
    torch.manual_seed(1)
    plain = TinyNet()  # other initial weights: loading must overwrite every one of them
    result = {"saved": list(saved), "stripped": [str(k) for k in stripped],
              "wanted": list(plain.state_dict())}
    try:
        plain.load_state_dict(stripped, strict=True)
        result["error"] = ""
        result["max_diff"] = max((plain.state_dict()[k] - v).abs().max().item()
                                 for k, v in trained.state_dict().items())
    except RuntimeError as exc:
        result["error"] = " ".join(str(exc).split()).rstrip(".")
    del ddp_model
    return result


def check_09(path: Path) -> str:
    """Only the prefix is stripped: a real DDP checkpoint loads strictly into the plain model."""
    import torch

    module = load(path)
    [ddp] = run_world(1, _rank_09, (str(path),), path)
    if ddp["error"]:
        wrong = [f"{a} -> {b}" for a, b in zip(ddp["saved"], ddp["stripped"])
                 if b not in ddp["wanted"]]
        missing = [k for k in ddp["wanted"] if k not in ddp["stripped"]]
        raise NotYet(f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load strictly "
                     f"into a plain TinyNet: your function turned {_listed(wrong, 2)}, and the "
                     f"model misses {_listed(missing, 4)}. Which part of each key belongs to "
                     f"the wrapper? (lesson 09, Step 5)" if wrong or missing else
                     f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load into a "
                     f"plain TinyNet: {ddp['error'][:300]}")
    if ddp["max_diff"] != 0:
        raise NotYet(f"the stripped state_dict loads, but the weights differ from the saved "
                     f"model's by {ddp['max_diff']:.1e}: keep every tensor with its own key")
    w = [torch.full((2,), float(i)) for i in range(4)]
    cases = [
        ("an already plain checkpoint (nothing to strip)", "module.",
         {"stem.submodule.weight": w[0], "block.module.bias": w[1]},
         {"stem.submodule.weight": w[0], "block.module.bias": w[1]}),
        ("torch.compile's prefix", "_orig_mod.",
         {"_orig_mod.block.module.weight": w[0], "_orig_mod.head._orig_mod_x": w[1]},
         {"block.module.weight": w[0], "head._orig_mod_x": w[1]}),
        ("a model with parts called `decoder` and `module`", "module.",
         {"module.decoder.weight": w[0], "module.module.bias": w[1]},
         {"decoder.weight": w[0], "module.bias": w[1]}),
        ("DDP around torch.compile, one layer at a time", "module.",
         {"module._orig_mod.fc1.weight": w[2], "module._orig_mod.module.bias": w[3]},
         {"_orig_mod.fc1.weight": w[2], "_orig_mod.module.bias": w[3]}),
    ]
    for what, prefix, given, wanted in cases:
        before = dict(given)
        try:
            got = module.strip_prefix(given, prefix)
        except Exception as exc:
            raise NotYet(f"strip_prefix on {what} raised {type(exc).__name__}: "
                         f"{exc}{_where(exc, str(path))}")
        if got is None:
            raise NotYet("strip_prefix returned None; return the new state_dict")
        if list(got) != list(wanted):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: keys {list(before)} became "
                         f"{list(got)}; expected {list(wanted)}")
        if any(got[k] is not v and not torch.equal(got[k], v) for k, v in wanted.items()):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: the keys are right but some "
                         f"tensors changed; keep every tensor with its key")
    return (f"a DDP checkpoint with `module` and `submodule` parts loads strictly after "
            f"stripping; plain keys stay as they are, and compile's prefix works too")


# ---------------------------------------------------------------------------------------
# Lesson 10: a ring all-reduce
# ---------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "broadcast", "all_to_all",
               "all_to_all_single", "gather", "scatter")


def _rank_10(rank: int, world: int, path: str) -> list:
    """The learner's ring on tensors of several sizes, each compared with dist.all_reduce;
    every point-to-point send is counted (elements and destination) on the way."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    all_reduce = dist.all_reduce
    sent = {"elements": 0, "to": set()}

    def counted(send):
        def wrapper(tensor, *args, **kwargs):
            peer = kwargs.get("dst", args[0] if args else None)
            sent["to"].add(kwargs.get("group_dst") if peer is None else peer)
            sent["elements"] += tensor.numel()
            return send(tensor, *args, **kwargs)
        return wrapper

    def forbidden(name):
        def refuse(*args, **kwargs):
            raise NotYet(f"ring_all_reduce called dist.{name}: build it from point-to-point "
                         f"messages (dist.isend / dist.irecv) only, as the lesson does")
        return refuse

    # before the learner's file is loaded, so `from torch.distributed import isend` counts too
    for name in ("isend", "send"):
        wrapped = counted(getattr(dist, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)  # batch_isend_irecv's P2POp checks against these
    for name in COLLECTIVES:
        setattr(dist, name, forbidden(name))
    module = load(Path(path))
    sizes = sorted({1, world - 1, world, world + 1, 10, 1001} - {0})
    out = []
    for size in sizes:
        g = torch.Generator().manual_seed(1000 * size + rank)  # every rank its own numbers
        x = torch.randn(size, generator=g)
        expected = x.clone()
        all_reduce(expected)
        got = x.clone()
        before = sent["elements"]
        module.ring_all_reduce(got)
        wrong = ~torch.isclose(got, expected, rtol=1.3e-6, atol=1e-5)  # assert_close's float32
        try:
            torch.testing.assert_close(got, expected)
            ok = True
        except AssertionError:
            ok = False
        out.append({"size": size, "ok": ok, "sent": sent["elements"] - before,
                    "max_diff": (got - expected).abs().max().item(),
                    "first_wrong": int(wrong.nonzero()[0, 0]) if wrong.any() else -1})
    return [out, sorted(int(t) for t in sent["to"] if t is not None)]


def check_10(path: Path) -> str:
    """The ring matches dist.all_reduce for 2, 3 and 4 ranks and sizes N does not divide."""
    load(path)
    for world in (2, 3, 4):
        ranks = run_world(world, _rank_10, (str(path), ), path)
        for rank, (results, peers) in enumerate(ranks):
            for r in results:
                if not r["ok"]:
                    before = "; with 2 ranks every size was right" if world > 2 else ""
                    raise NotYet(f"with {world} ranks and a tensor of {r['size']} floats, rank "
                                 f"{rank}'s result differs from dist.all_reduce's (from element "
                                 f"{r['first_wrong']} on; max |difference| {r['max_diff']:.3g})"
                                 f"{before}. At step k of each phase, which chunk does rank r "
                                 f"send, and which one arrives? (lesson 10, Step 3 draws it)")
        for rank, (results, peers) in enumerate(ranks):
            neighbours = {(rank + 1) % world, (rank - 1) % world}
            if len(peers) > 1 or not set(peers) <= neighbours:
                raise NotYet(f"with {world} ranks, rank {rank} sent to ranks {peers}: in a ring "
                             f"every rank sends to one neighbour only")
            for r in results:
                most = 2 * (r["size"] - r["size"] // world)
                if r["sent"] > most:
                    raise NotYet(f"with {world} ranks and a tensor of {r['size']} floats, rank "
                                 f"{rank} sent {r['sent']} floats: the right sums, but a ring "
                                 f"sends at most 2(N-1)/N of the tensor ({most} here). Does "
                                 f"something send more than one chunk per step?")
    return ("the ring matches dist.all_reduce on 2, 3 and 4 ranks for every size tried, and "
            "each rank sends at most 2(N-1)/N of the tensor, to one neighbour")


# ---------------------------------------------------------------------------------------
# Lesson 11: a synchronous step
# ---------------------------------------------------------------------------------------

def _rank_11(rank: int, world: int, path: str, steps: int, slow_rank: int, delay: float) -> dict:
    """Train on this rank's share of each global batch and let the learner's step combine
    them; the slow rank sleeps before every step, and each rank times its step."""
    import time

    import torch
    import torch.nn.functional as F

    from common import recipe

    module = load(Path(path))
    x_all, y_all = recipe.synthetic_data()[0].tensors
    order = torch.tensor(recipe.epoch_order(len(y_all), SEED, 0))
    model = recipe.make_model(SEED)  # same seed on every rank: the same start
    optimizer = recipe.make_optimizer(model)
    waited = 0.0
    for k in range(steps):
        idx = order[k * recipe.GLOBAL_BATCH + rank:(k + 1) * recipe.GLOBAL_BATCH:world]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        if rank == slow_rank:
            time.sleep(delay)  # a slower device, or a bigger share of the work
        start = time.perf_counter()
        module.synchronous_step(model, optimizer)
        waited += time.perf_counter() - start
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "seconds_in_step": waited}


def check_11(path: Path) -> str:
    """Every worker takes the global batch's step: copies identical, equal to one process."""
    load(path)
    world, steps, slow, delay = 3, 6, 2, 0.15
    reference = _reference_steps(steps)
    ranks = run_world(world, _rank_11, (str(path), steps, slow, delay), path)
    setup = f"{world} workers, {steps} steps of 96 samples ({96 // world} per worker)"
    spread = max(_max_diff(r["weights"], ranks[0]["weights"]) for r in ranks)
    if spread > 1e-6:
        raise NotYet(f"{setup}: the copies of the model differ by up to {spread:.1e} at the end: "
                     f"each worker stepped with a gradient of its own. What must every worker "
                     f"have in .grad before optimizer.step()? (lesson 11, Step 2)")
    diff = _max_diff(ranks[0]["weights"], reference)
    if diff > 1e-5:
        raise NotYet(f"{setup}: the copies agree, but they are {diff:.1e} away from one process "
                     f"training on each global batch of 96 (allowed: 1e-5). Is the gradient "
                     f"they step with the mean over all 96 samples? (lesson 11, Step 2)")
    fast = [r for rank, r in enumerate(ranks) if rank != slow]
    least = min(r["seconds_in_step"] for r in fast)
    if least < 0.25 * steps * delay:  # lenient: busy shared cores delay the fast ones too
        raise NotYet(f"{setup}: the right weights, yet a fast worker spent only {least:.2f}s in "
                     f"synchronous_step while worker {slow} was {steps * delay:.1f}s late in "
                     f"all: where did its gradient come from?")
    return (f"{world} workers stay identical and equal to one process (max diff {diff:.1e}); "
            f"the fast ones spent {least:.2f}s or more in the step, waiting for worker {slow} "
            f"({steps * delay:.1f}s late in all), as a synchronous step must")


# ---------------------------------------------------------------------------------------
# Lesson 12: distributed evaluation
# ---------------------------------------------------------------------------------------

N_VAL = 101  # validation samples: neither 2 nor 3 ranks can split them evenly


def _rank_12(rank: int, world: int, path: str, weights: dict) -> dict:
    """The learner's evaluation on this rank; a hook on the model counts which validation
    samples this rank actually ran through it."""
    import torch
    from torch.utils.data import TensorDataset

    from common import recipe

    module = load(Path(path))
    model = recipe.make_model(SEED)
    model.load_state_dict(weights)
    model.eval()
    x, y = (t[:N_VAL] for t in recipe.synthetic_data()[1].tensors)
    row_of = {x[i].numpy().tobytes(): i for i in range(N_VAL)}  # every row is different
    seen = torch.zeros(N_VAL, dtype=torch.int64)

    def count(_module, inputs):
        for row in inputs[0].detach().reshape(len(inputs[0]), -1):
            i = row_of.get(row.contiguous().numpy().tobytes())
            if i is not None:
                seen[i] += 1
    model.register_forward_pre_hook(count)
    accuracy = module.distributed_accuracy(model, TensorDataset(x, y))
    return {"accuracy": float(accuracy), "seen": seen}


def check_12(path: Path) -> str:
    """Distributed accuracy equals one process's, with each sample evaluated on one rank."""
    import torch

    from common import recipe

    load(path)
    weights = _reference_steps(4)  # a model part-way through training: neither 0% nor 100%
    model = recipe.make_model(SEED)
    model.load_state_dict(weights)
    x, y = (t[:N_VAL] for t in recipe.synthetic_data()[1].tensors)
    with torch.no_grad():
        right = int((model(x).argmax(1) == y).sum())
    truth = right / N_VAL
    for world in (2, 3):
        ranks = run_world(world, _rank_12, (str(path), weights), path)
        got = [r["accuracy"] for r in ranks]
        setup = f"{N_VAL} samples on {world} ranks"
        if max(got) - min(got) > 1e-12:
            raise NotYet(f"{setup}: the ranks returned different accuracies {got}; every rank "
                         f"should return the accuracy on the whole set")
        seen = torch.stack([r["seen"] for r in ranks])
        total = seen.sum(0)
        if abs(got[0] - truth) > 1e-6:
            twice = (total > 1).nonzero().flatten().tolist()
            never = (total == 0).nonzero().flatten().tolist()
            evidence = f"the ranks ran {int(total.sum())} predictions for {N_VAL} samples"
            if twice:
                evidence += f"; sample(s) {_listed(twice)} more than once"
            if never:
                evidence += f"; sample(s) {_listed(never)} never"
            raise NotYet(f"{setup}: every rank returned {got[0]:.4%}, one process measures "
                         f"{truth:.4%} ({right}/{N_VAL}); {evidence}. Which predictions should "
                         f"count, and how do per-rank numbers add up to one accuracy? "
                         f"(lesson 12, Step 8)")
        busiest = int(seen.sum(1).max())
        if busiest > -(-N_VAL // world) or (total == 0).any():
            raise NotYet(f"{setup}: the right accuracy, but one rank evaluated {busiest} of the "
                         f"{N_VAL} samples: split the work, so that each rank evaluates about "
                         f"1/{world} of them")
    return (f"{N_VAL} samples on 2 and on 3 ranks: every rank returns {truth:.4%}, exactly the "
            f"single-process accuracy, each rank evaluating its own share")


CHECKS = {
    "05": ("exercises/05_set_epoch.py", check_05),
    "06": ("exercises/06_who_am_i.py", check_06),
    "07": ("exercises/07_resume_mid_epoch.py", check_07),
    "08": ("exercises/08_accumulate.py", check_08),
    "09": ("exercises/09_strip_prefix.py", check_09),
    "10": ("exercises/10_ring_all_reduce.py", check_10),
    "11": ("exercises/11_sync_step.py", check_11),
    "12": ("exercises/12_eval_accuracy.py", check_12),
}

CHECKS_DIR = Path(__file__).resolve().parent / "checks"
sys.path.insert(0, str(CHECKS_DIR))


def all_checks() -> dict:
    """CHECKS plus one entry per tools/checks/check_NN.py. Found on first use, not at import,
    so that a check file may itself import this harness at its top."""
    for file in sorted(CHECKS_DIR.glob("check_[0-9][0-9].py")):
        if file.stem[-2:] not in CHECKS:
            module = importlib.import_module(file.stem)
            CHECKS[file.stem[-2:]] = (module.STARTER, module.check)
    return CHECKS


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("Checked exercises (make check-NN [FILE=path]):")
        for n, (starter, fn) in sorted(all_checks().items()):
            print(f"  make check-{n}   {starter}: {(fn.__doc__ or '(no description)').strip().splitlines()[0]}")
        return
    number = argv[0].zfill(2)
    if number not in all_checks():
        fail(f"lesson {number} has no checked exercise; these do: {' '.join(sorted(CHECKS))}")
    starter, check = CHECKS[number]
    path = Path(argv[1]) if len(argv) > 1 and argv[1] else ROOT / starter
    if not path.exists():
        fail(f"{path} not found; give the learner's file as FILE=path")
    try:
        message = check(path.resolve())
    except NotYet as exc:
        print(f"not yet: {exc}")
        raise SystemExit(1)
    except subprocess.TimeoutExpired:
        print("not yet: the exercise did not finish in time (does something wait forever?)")
        raise SystemExit(1)
    print(f"ok: {message}")


if __name__ == "__main__":
    main(sys.argv[1:])
