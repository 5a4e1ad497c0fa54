"""Lesson 29: torch.compile with DDP and FSDP2, measured on a laptop.

Parent: lesson 15 (lessons/15_zero_fsdp.py)

New since lesson 15: the transformer on N ranks, wrapped in DDP or FSDP2 (--wrap), is trained
twice, in turns, on the same batches: eager, and with each block compiled by torch.compile
(--compile inductor, aot_eager, or none: eager twice). Measured: the compiled weights beside the
eager ones (within 1e-5); the graphs dynamo made, its graph breaks and recompilations with their
reasons, and a new batch shape's recompile avoided with mark_dynamic; the compile's seconds (a
cold cache, or warm from an earlier run) against a step's, and the two kinds of step timed in
turns, with their spread and the machine's load. Then how each wrapper meets the compiler: DDP's
graph cut at bucket boundaries (optimize_ddp) and its bucket_cap_mb trap, FSDP2's hooks left
outside the graph. The caches stay in runs/ (lessons/29_compile/compile_setup.py), and a
machine without a C++ compiler falls back to aot_eager. Lesson 15's bytes stay in lesson 15.

Run:
    make lesson-29
    make lesson-29 ARGS="--wrap fsdp"
    make lesson-29 ARGS="--cold-cache"
    .venv/bin/python lessons/29_compile.py --compile aot_eager --steps 60
    .venv/bin/python lessons/29_compile.py --wrap fsdp --region model --world-size 4

Doc: docs/29_compile.md
"""
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works
sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson's own folder, 29_compile/

import common  # first: a Ctrl-C while torch loads is one line; torch's caches go to runs/
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters  # dynamo's own books: graphs, breaks, cache hits
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_setup  # where the caches go, and the C++ compiler inductor needs on a CPU
import compile_timing  # eager and compiled steps in turns, their spread, the machine's load
import ddp_graph_split
import fsdp_hook_breaks
import graph_census  # a backend that counts its graphs; dynamo's breaks and recompiles, named
from common import transformer as T
from common.cli import lesson_parser, positive_int, run, seed_number
from common.device import backend_for, plan_device, rank_device
from common.distributed import choose_port, init_from_env, spawn, teardown
from apparatus.results import claim_out, make_metrics, max_abs_diff, out_dir, plain_state_dict, save_results, shown
from apparatus.ui import UI

STEPS = 30  # of lesson 13's 120: enough rounds to time; compiling is the slow part
ALLOWED = 1e-5  # compiled against eager weights; float rounding in fused kernels stays far below


def parse_args():
    parser = lesson_parser(__doc__, recipe=False, distributed=True, world_size=2)
    parser.add_argument("--steps", type=positive_int, default=STEPS,
                        help="optimizer steps of each model (one global batch each)")
    parser.add_argument("--seed", type=seed_number, default=T.SEED,
                        help="seed for the initial weights and the batches")
    parser.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp",
                        help="what every rank trains: DDP (all weights) or FSDP2 (fully_shard each block)")
    parser.add_argument("--compile", choices=("inductor", "aot_eager", "none"), default="inductor",
                        help="torch.compile's backend for the compiled model (none: eager twice)")
    parser.add_argument("--region", choices=("block", "model"), default="block",
                        help="what torch.compile wraps: each block (one graph for all), or the whole wrapped model")
    parser.add_argument("--cold-cache", action="store_true",
                        help="compile into an empty cache, <out>/cold-cache (emptied first): what a first run pays")
    # a cold compile on a busy laptop takes minutes, and a rank that finished it first waits for
    # the others at the first all-reduce: 60 s was too short at load 20 (2 cores)
    parser.set_defaults(timeout=600.0)
    args = parser.parse_args()
    T.check_world_size(args.world_size, "--world-size")  # before any rank starts
    return args


def main() -> None:
    args = parse_args()
    folder = claim_out(out_dir("29", args.out))  # checked now, not after training; ours alone
    ui = UI(step_mode=args.step)
    ui.title(f"Lesson 29: torch.compile ({args.compile}) with {args.wrap} on {args.world_size} ranks")

    # Step 1: Start the ranks, find a C++ compiler, keep the caches in runs/
    # Inductor writes C++ for the CPU and builds it with the machine's compiler; its caches
    # would land in /tmp (compile_setup.py says where each goes): here they go to runs/.
    ui.step(1, "Start the ranks, find a C++ compiler, keep the caches in runs/")
    kind, note = plan_device(args.device, args.world_size)  # as lesson 05: a GPU per rank, or CPUs
    ui.print(note or f"{args.world_size} ranks, one GPU each")
    cache = compile_setup.keep_caches(folder / "cold-cache" if args.cold_cache else None)
    size, files = compile_setup.folder_size(cache)
    ui.print(f"compile cache: {shown(cache)}, " + (f"{files} files ({size / 2**20:.1f} MiB) from earlier runs"
             if files else "empty") + f"; TMPDIR for this run: {shown(cache / 'tmp')}")
    if args.compile == "inductor" and kind == "cpu":
        compiler = compile_setup.cxx_compiler()  # inductor's own search: $CXX, else g++ (clang++ on macOS)
        if compiler is None:
            ui.print("no C++ compiler found ($CXX, else g++; clang++ on macOS): inductor cannot build CPU "
                     "kernels here, so this run compiles with aot_eager (install g++ to use inductor)")
            args.compile = "aot_eager"
        else:
            ui.print(f"inductor's C++ compiler: {compiler}")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(choose_port(args.master_port)))
    spawn(worker, (args.world_size, args, kind, compile_timing.load()), args.world_size)


def wrap(model: torch.nn.Module, how: str, mesh, device) -> torch.nn.Module:
    """Lesson 15's two wrappers: DDP (every rank holds every weight, all-reduces the gradients)
    or FSDP2 (fully_shard each block, then the root)."""
    if how == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def compile_model(wrapped: torch.nn.Module, model: torch.nn.Module, backend, region: str) -> torch.nn.Module:
    """torch.compile where --region says. block: each block's __call__ in place (Module.compile),
    after DDP or fully_shard, as torchtitan compiles each TransformerBlock: both blocks run the
    same code, so they share one graph; the embeddings and the head stay eager. model: the whole
    wrapped model, one torch.compile around DDP or the FSDP2 root."""
    if region == "model":
        return torch.compile(wrapped, backend=backend)
    for block in model.blocks:
        block.compile(backend=backend)
    return wrapped


def full_state(model: torch.nn.Module, how: str) -> dict:
    """The whole weights on this rank's CPU. FSDP2: gathered from the shards, a collective every
    rank calls; rank 0 gets the weights, the others an empty dict (cpu_offload=True)."""
    if how == "fsdp":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return plain_state_dict(model)


def worker(rank: int, world: int, args, kind: str, load_before: tuple) -> None:
    ui = UI(rank, world, step_mode=args.step)
    device = rank_device(kind, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL: our GPU, no other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    init_from_env(backend_for(device), args.timeout, device)
    if device.type == "cpu":  # before compiling: inductor's CPU kernels use as many threads
        torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers per rank: 2 cores, 2 ranks
    # inductor looks for CUDA even on a CPU (torch/utils/cpp_extension.py): where nvcc is
    # installed without a GPU it warns "No CUDA runtime is found", once per rank. True, not ours.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    ui.print(f"device: [bold]{device}[/bold] (CUDA available: {torch.cuda.is_available()})")

    # Step 2: Build the model twice, wrap both, compile one
    # The same seed: the same weights. Counted is a backend that notes each graph dynamo hands
    # it, then calls the real one (inductor, aot_eager).
    ui.step(2, "Build the model twice, wrap both, compile one")
    mesh = dist.init_device_mesh(device.type, (world,)) if args.wrap == "fsdp" else None
    backend = graph_census.Counted(args.compile) if args.compile != "none" else None
    models = {}
    for name in compile_timing.NAMES:
        model = T.make_model(args.seed).to(device)
        forward = wrap(model, args.wrap, mesh, device)
        if name == "compiled" and backend is not None:
            forward = compile_model(forward, model, backend, args.region)
        models[name] = (model, forward, T.make_optimizer(model))
    what = "each block" if args.region == "block" else f"the whole {args.wrap} model"
    ui.print(f"eager: lesson 13's transformer in {args.wrap}; compiled: the same, with {what} compiled "
             f"(backend {args.compile!r}); nothing compiles until the first step" if backend else
             f"eager: lesson 13's transformer in {args.wrap}, twice (--compile none): the timing's noise floor")

    # Step 3: Train eager and compiled in turns, on the same batches
    # One step of each per batch, in turns (A B, B A, ...): a machine that slows down slows
    # both. The compiled model's first step compiles: dynamo traces each frame, the backend
    # compiles the graph (forward now, backward at the first backward).
    ui.step(3, "Train eager and compiled in turns, on the same batches")
    losses = {name: [] for name in compile_timing.NAMES}
    seconds = {name: [] for name in compile_timing.NAMES}
    log_every = max(1, args.steps // 5)
    with ui.progress(args.steps, "training") as bar:
        for step in range(args.steps):
            x, y = T.batch(step, args.seed)
            x, y = T.shard(x, rank, world).to(device), T.shard(y, rank, world).to(device)
            for name in compile_timing.turn(step):
                model, forward, optimizer = models[name]
                start = time.perf_counter()
                loss = T.loss_fn(forward(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses[name].append(loss.item())  # waits for the GPU, if any
                seconds[name].append(time.perf_counter() - start)
            bar.advance()
            if step == 0 or (step + 1) % log_every == 0:
                ui.print(f"step {step + 1:>3}/{args.steps} | loss {losses['eager'][-1]:.4f} eager, "
                         f"{losses['compiled'][-1]:.4f} compiled | {seconds['eager'][-1] * 1e3:>7,.1f} ms eager, "
                         f"{seconds['compiled'][-1] * 1e3:>9,.1f} ms compiled")
    census = {"graphs": backend.graphs if backend else [], "breaks": graph_census.named_breaks(counters),
              "recompiles": graph_census.recompile_reasons(), "cache": compile_setup.cache_hits(counters)}

    # Step 4: Count the graphs, the graph breaks and the recompiles
    # From the training above; then a new batch shape on lesson 13's plain model (rank 0 alone).
    ui.step(4, "Count the graphs, the graph breaks and the recompiles")
    if backend is None:
        ui.print("--compile none: nothing was compiled")
    for g in census["graphs"]:
        ui.print(f"dynamo handed {args.compile} a graph of {g['calls']} calls, {g['inputs']} inputs "
                 f"(the first: {g['first_input']}); it ran {args.steps} steps of {len(models['compiled'][0].blocks)} blocks")
    for b in census["breaks"]:
        ui.print(f"{b['kind']}: {graph_census.described(b)}")
    ui.print(f"graph breaks: {len(census['breaks'])}; recompiles in {args.steps} steps: {len(census['recompiles'])} "
             f"(every batch is {tuple(x.shape)} tokens: the guards held)")
    shapes = {}
    if rank == 0:  # the other ranks wait at Step 6's first collective
        tokens = T.batch(args.steps, args.seed)[0]  # a batch no step trained on
        for mark in (False, True):
            shapes["mark_dynamic" if mark else "plain"] = graph_census.new_shape(T.make_model(args.seed), tokens, (24, 16, 8), mark)
        plain, marked = shapes["plain"], shapes["mark_dynamic"]
        ui.print(f"batches of 24, 16, 8 rows: {plain['graphs']} graphs, {plain['recompiles']} recompile "
                 f"({'; '.join(plain['reasons'])}); from the second on, dimension 0 is dynamic")
        ui.print(f"torch._dynamo.mark_dynamic(x, 0) before the first call: {marked['graphs']} graph, "
                 f"{marked['recompiles']} recompiles")

    # Step 5: Compile time against step time, eager against compiled
    # The first round compiled; rounds 2 on are the steady state, timed in turns on rank 0.
    ui.step(5, "Compile time against step time, eager against compiled")
    steady = {name: compile_timing.spread(seconds[name][1:]) for name in compile_timing.NAMES}
    ratio = compile_timing.ratios(seconds["compiled"][1:], seconds["eager"][1:])
    compile_s = max(0.0, seconds["compiled"][0] - seconds["eager"][0])  # step 1 of both, minus a step
    ui.table(f"Seconds per step on rank 0, steps 2-{args.steps} in turns (ms)", ["", "median", "middle half", "min-max"],
             [[name, *compile_timing.milliseconds(steady[name])] for name in compile_timing.NAMES])
    hits = census["cache"]  # inductor's caches only: aot_eager keeps nothing on disk
    state = ("partly warm" if hits["hits"] else "cold") if hits["misses"] else ("warm" if hits["hits"] else "none")
    ui.print(f"compile: {compile_s:.1f} s = {compile_s / steady['eager']['median']:,.0f} eager steps; " + (
        f"inductor's caches: {hits['hits']} hits, {hits['misses']} misses ({state}: "
        + ("read back from an earlier run)" if state == "warm" else "compiled now, kept for the next run)")
        if args.compile == "inductor" else f"{args.compile} keeps no cache on disk: every run compiles again"))
    verdict = ("faster" if ratio["q3"] < 1 else "slower" if ratio["q1"] > 1 else "no clear difference")
    ui.print(f"compiled / eager, round by round: median {ratio['median']:.2f} (middle half {ratio['q1']:.2f}-"
             f"{ratio['q3']:.2f}): {verdict}" + ("" if verdict.startswith("no") else " in 3 rounds of 4 or more"))
    payback = compile_timing.payback(compile_s, steady["eager"]["median"], steady["compiled"]["median"])
    ui.print(f"the compile pays for itself after {payback:,.0f} steps at these speeds" if payback else
             "at these speeds the compile never pays for itself")
    load_after = compile_timing.load()
    ui.print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {load_after[1]} cores"
             + (": a busy machine, the spread above is its doing" if load_after[0] > load_after[1] else ""))

    # Step 6: DDP: the graph cut at bucket boundaries, and the bucket trap
    # DDPOptimizer (torch/_dynamo/backends/distributed.py) cuts a graph compiled inside DDP's
    # forward where a bucket fills, so each bucket's gradients are ready, and all-reduced,
    # before the rest of backward is done (ddp_graph_split.py). First by hand, then as DDP does.
    ui.step(6, "DDP: the graph cut at bucket boundaries, and the bucket trap")
    x0 = T.shard(T.batch(0, args.seed)[0], rank, world).to(device)
    pieces = []
    if rank == 0:
        pieces = ddp_graph_split.split_at_buckets(T.make_model(args.seed).to(device), x0, int(0.1 * 2**20))
        ui.table(f"DDPOptimizer on the whole model's graph, 0.1 MiB buckets: {len(pieces)} pieces",
                 ["piece", "first parameters", "parameters", "bytes", "calls"],
                 [[i + 1, ", ".join(p["params"][:2]), len(p["params"]), f"{p['bytes']:,}", p["calls"]]
                  for i, p in enumerate(pieces)])
    ui.print(f"torch._dynamo.config.optimize_ddp = {torch._dynamo.config.optimize_ddp!r} (False: one graph, "
             f"every gradient at its end, no overlap)")
    trap = {cap: ddp_graph_split.bucket_trap(T.make_model(args.seed).to(device), x0, cap) for cap in (0.1, 1.0)}
    ui.print(f"DDP(bucket_cap_mb=0.1), blocks compiled, first forward: {trap[0.1]['error']}")
    ui.print(f"why: given bucket_cap_mb, DDP's first bucket is that cap, {trap[0.1]['bucket_cap_bytes']:,} bytes; "
             f"dynamo builds DDPOptimizer without first_bucket_cap, so it takes DDP's default "
             f"{trap[0.1]['first_bucket_bytes_dynamo']:,} (1 MiB) for it, and asserts first <= cap")
    ui.print(f"DDP(bucket_cap_mb=1): {trap[1.0]['error'] or 'no error'} (any cap of 1 MiB or more passes)")

    # Step 7: FSDP2: the hooks stay outside the graph
    # fully_shard's all-gathers and frees run in forward hooks that dynamo will not trace
    # (fsdp_hook_breaks.py). Compiled per block, then the whole model (backend "eager").
    ui.step(7, "FSDP2: the hooks stay outside the graph")
    mesh = mesh or dist.init_device_mesh(device.type, (world,))
    xs, ys = (T.shard(t, rank, world).to(device) for t in T.batch(0, args.seed))
    fsdp = {region: fsdp_hook_breaks.compiled_fsdp(args.seed, mesh, xs, ys, whole=region == "model")
            for region in ("block", "model")}
    for region, found in fsdp.items():
        graphs = ", ".join(f"{g['calls']} calls from {g['first_input']}" for g in found["graphs"])
        ui.print(f"compiled per {region}: {len(found['graphs'])} graph ({graphs}), "
                 f"{sum(b['kind'] == 'break' for b in found['breaks'])} graph breaks, "
                 f"{sum(b['kind'] == 'skipped frame' for b in found['breaks'])} skipped frame(s)")
        for b in found["breaks"]:
            ui.print(f"  {b['kind']}: {graph_census.described(b)}")
    ui.print("SimpleFSDP (torchtitan's graph_trainer) puts the all-gathers in the graph as DTensor "
             "redistributes, so none of this breaks it; not run here (nightly PyTorch, GPUs)")

    # Step 8: Compare the compiled weights with eager's, save the results
    ui.step(8, "Compare the compiled weights with eager's, save the results")
    # every rank gathers (FSDP2's full state dict is a collective); rank 0 alone gets the weights
    states = {name: full_state(models[name][0], args.wrap) for name in compile_timing.NAMES}
    mean_losses = T.mean_over_ranks(losses["compiled"])
    del models
    teardown()  # nothing below talks to the other ranks
    if rank != 0:
        return
    diff = max_abs_diff(states["compiled"], states["eager"])
    loss_diff = max(abs(a - b) for a, b in zip(losses["compiled"], losses["eager"]))
    ui.print(f"max |w_compiled - w_eager| = {diff:.1e} (allowed {ALLOWED:.0e}); largest loss difference "
             f"in {args.steps} steps: {loss_diff:.1e}")
    folder = out_dir("29", args.out)
    wall = sum(seconds["compiled"]) + sum(seconds["eager"])
    save_results(folder, states["compiled"], make_metrics(
        lesson="29", world_size=world, backend=backend_for(device), device=str(device), losses=mean_losses,
        final_accuracy=None, wall_seconds=wall, samples=2 * args.steps * T.GLOBAL_BATCH, steps=args.steps,
        seed=args.seed, global_batch=T.GLOBAL_BATCH, wrap=args.wrap, compile=args.compile, region=args.region,
        max_abs_diff_vs_eager=diff, max_loss_diff_vs_eager=loss_diff, allowed=ALLOWED,
        graphs=census["graphs"], graph_breaks=len(census["breaks"]), graph_break_reasons=census["breaks"],
        recompiles=len(census["recompiles"]), recompile_reasons=census["recompiles"], new_shape=shapes,
        compile_seconds=compile_s, compile_cache={"state": state, **hits, "cold_cache_flag": args.cold_cache},
        step_seconds_eager=steady["eager"]["median"], step_seconds_compiled=steady["compiled"]["median"],
        step_seconds_spread=steady, compiled_over_eager=ratio, payback_steps=payback,
        step_seconds_all=seconds, load_average=[load_before[0], load_after[0]], cores=load_after[1],
        ddp_pieces=pieces, bucket_trap=list(trap.values()),
        fsdp={region: {"graphs": len(f["graphs"]), "breaks": f["breaks"]} for region, f in fsdp.items()}))
    ui.print(f"wrote {shown(folder / 'final.pt')} and {shown(folder / 'metrics.json')}")


if __name__ == "__main__":
    run(main)
