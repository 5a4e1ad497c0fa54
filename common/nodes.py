"""Simulate several machines on this one: start one torchrun agent per "node".

    python -m common.nodes --nnodes 2 --nproc-per-node 2 -- lessons/06_torchrun_multinode.py --epochs 3

On real machines you would type one torchrun command per machine; this launcher types
them for you, on 127.0.0.1, prints them first so you can copy them, and watches the
agents: when one fails, the others are stopped, so the job never hangs. Each agent's
torchrun log (stderr) is shown with a `[node N]` prefix and saved whole, tracebacks and
all, to runs/nodes/node-N.log; tracebacks are left out of the terminal copy.

Make targets use it: `make lesson-06` (static rendezvous, two nodes) and `make lesson-07`
(c10d rendezvous with restarts: --elastic).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.cli import LessonParser, fail, nonnegative_int, port_number, positive_float, positive_int  # noqa: E402
from common.distributed import choose_port  # noqa: E402


def parse_args(argv):
    if "--" not in argv:
        fail("usage: python -m common.nodes [options] -- SCRIPT [script flags]")
    cut = argv.index("--")
    own, script = argv[:cut], argv[cut + 1:]
    if not script:
        fail("no script after --; e.g. python -m common.nodes -- lessons/06_torchrun_multinode.py")
    p = LessonParser(prog="python -m common.nodes", description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", default="2",
                   help="how many nodes (agents) to start; MIN:MAX with --elastic")
    p.add_argument("--nproc-per-node", type=positive_int, default=2, help="workers per node")
    p.add_argument("--elastic", action="store_true",
                   help="c10d rendezvous (elastic: restarts, node ranges) instead of static")
    p.add_argument("--max-restarts", type=nonnegative_int, default=0,
                   help="how often torchrun restarts the workers after a failure")
    p.add_argument("--rdzv-timeout", type=positive_int, default=60,
                   help="seconds a node waits for the others at the rendezvous")
    p.add_argument("--master-port", type=port_number, default=None,
                   help="port of the rendezvous store (default: a free one)")
    p.add_argument("--only-node", type=nonnegative_int, action="append", default=None,
                   help="start only this node rank (repeatable), to see a missing node")
    p.add_argument("--job-timeout", type=positive_float, default=900,
                   help="stop everything after this many seconds")
    args = p.parse_args(own)
    m = re.fullmatch(r"(\d+)(?::(\d+))?", args.nnodes)
    if not m or int(m[1]) < 1 or (m[2] and int(m[2]) < int(m[1])):
        fail(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    if m[2] and not args.elastic:
        fail("--nnodes MIN:MAX needs --elastic (static rendezvous has a fixed node count)")
    args.min_nodes, args.max_nodes = int(m[1]), int(m[2] or m[1])
    if not Path(script[0]).exists():
        fail(f"script {script[0]} not found")
    return args, script


def torchrun_command(args, node_rank: int, port: int, script: list[str]) -> list[str]:
    """The torchrun command one machine would run."""
    cmd = ["torchrun", f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}"]
    if args.elastic:
        # c10d: the agents meet in a store at --rdzv-endpoint (the agent on that host
        # serves it); node ranks are assigned at the rendezvous, so no --node-rank.
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lesson",
                f"--rdzv-conf=join_timeout={args.rdzv_timeout}",
                f"--max-restarts={args.max_restarts}"]
    else:
        # static: node 0 hosts the store at --master-addr:--master-port; ranks are fixed.
        cmd += [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                f"--rdzv-conf=timeout={args.rdzv_timeout}", f"--max-restarts={args.max_restarts}"]
    return cmd + script


GLOG = re.compile(r"^[EWI]\d{4} [\d:.]+ +\d+ \S+:\d+\] ?")  # torch's log-line header
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")  # torch prefixes workers' tracebacks with it
NOISE = re.compile(r"^(frame #\d+:|<omitting python frames>|Exception raised from )")
# With --elastic the agents log at INFO (see ELASTIC_ENV); of those lines the terminal shows
# only the agent's decisions to restart, the rest stays in runs/nodes/node-N.log.
INFO_SHOWN = re.compile(r"will restart worker group")

# --elastic only. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default (torch 2.14.1) the c10d
# agent keeps one TCPStore for the whole job and lends it to the workers of every attempt,
# so a restarted process group can read the previous attempt's addresses and fail with
# "Gloo connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712; measured
# here: 4 of 8 restarts failed so, 0 of 8 with this variable). With it, rank 0 of each
# attempt hosts a fresh store. LOGLEVEL=INFO: the agent says when it restarts the workers.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}


def pump(node: int, stream, log_path: Path, seen: dict, hide_info: bool = False) -> None:
    """Copy an agent's stderr to ours with a [node N] prefix.

    The log file gets every line; the terminal gets them without Python tracebacks and C++
    frame dumps, keeping each exception's last line (also remembered for the summary).
    """
    in_traceback = in_box_traceback = False
    with open(log_path, "w") as log:
        for line in stream:
            log.write(line)
            log.flush()
            text = RANK_PREFIX.sub("", GLOG.sub("", line))
            # torchrun's failure summary (the "Root Cause" box, filled in thanks to @record)
            if text.startswith("Root Cause"):
                seen.setdefault("roots", {})[node] = {}
            m = re.match(r"^\s+rank\s+:\s+(\d+)", text)
            if m and node in seen.get("roots", {}):
                seen["roots"][node]["rank"] = int(m[1])
            m = re.match(r"^  ([A-Za-z_][\w.]*(?:Error|Exception)\b.*)", text)
            if m and node in seen.get("roots", {}):
                seen["roots"][node]["error"] = m[1].strip()
            if "exit barrier" in text:
                seen.setdefault("exit_barrier", set()).add(node)
            if text.startswith("Traceback (most recent call last)"):
                in_traceback = True
                continue
            if in_traceback:
                if text.startswith((" ", "\t")) or not text.strip():
                    continue
                in_traceback = False  # the exception line itself ends the traceback
                seen[node] = text.strip()
            # inside torchrun's summary box the traceback is indented: keep its last line only
            if "traceback : Traceback" in text:
                sys.stderr.write(f"[node {node}]   traceback : (in {log_path.relative_to(ROOT)})\n")
                in_box_traceback = True
                continue
            if in_box_traceback:
                if text.startswith("    "):
                    continue
                in_box_traceback = False
            if NOISE.match(text):
                continue
            if hide_info and line.startswith("I") and GLOG.match(line) and not INFO_SHOWN.search(line):
                continue
            sys.stderr.write(f"[node {node}] {line}")
            sys.stderr.flush()


# What a rank reports when it was not the cause but lost a peer that crashed
CONSEQUENCE = re.compile(r"Connection closed by peer|remote worker crash|Connection reset|"
                         r"SIGTERM|SignalException|got signal")


def root_cause(roots: dict) -> dict | None:
    """The failure that started it, out of every node's torchrun summary."""
    found = [{"node": n, **r} for n, r in sorted(roots.items()) if "error" in r]
    real = [r for r in found if not CONSEQUENCE.search(r["error"])]
    return (real or found or [None])[0]


def explain(node: int, error: str, args, port: int) -> str:
    m = re.search(r"(\d+)/(\d+) clients joined", error)
    if m:
        return (f"node {node} waited {args.rdzv_timeout} s at the rendezvous (127.0.0.1:{port}) "
                f"but only {m[1]} of {m[2]} nodes came; start every node with the same --nnodes, "
                f"--master-addr and --master-port, or raise --rdzv-timeout")
    if re.search(r"DistNetworkError|Connection refused|failed to connect|trying to connect", error, re.I):
        return (f"node {node} could not reach the rendezvous store at 127.0.0.1:{port}, which "
                f"node 0 hosts; start node 0 too (same --nnodes, --master-addr, --master-port)")
    if "RendezvousTimeoutError" in error:
        return (f"node {node} timed out at the c10d rendezvous after {args.rdzv_timeout} s "
                f"without enough nodes (need {args.min_nodes}); start the others or lower --nnodes")
    return f"node {node} failed: {error.rstrip('.') or 'see its log'}; the other nodes were stopped"


def plan_gpus(nnodes: int, nproc: int):
    """Real nodes have their own GPUs; simulated ones share this machine's. Give each
    simulated node its own slice through CUDA_VISIBLE_DEVICES (so its local rank 0 is not
    the same GPU as the next node's), or hide the GPUs when there are too few to go round."""
    try:
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        count = 0
    if count == 0:
        return None
    if count >= nnodes * nproc:
        return lambda node: ",".join(str(node * nproc + i) for i in range(nproc))
    print(f"note: {nnodes} simulated nodes x {nproc} workers need {nnodes * nproc} GPUs but "
          f"{count} are visible: the GPUs are hidden and every worker uses the CPU", flush=True)
    return lambda node: ""


def main(argv: list[str]) -> None:
    args, script = parse_args(argv)
    port = choose_port(args.master_port)
    nodes = args.only_node if args.only_node is not None else list(range(args.max_nodes if args.elastic else args.min_nodes))
    log_dir = ROOT / "runs" / "nodes"
    log_dir.mkdir(parents=True, exist_ok=True)

    gpus_for = plan_gpus(len(nodes), args.nproc_per_node)
    print(f"Simulating {len(nodes)} node(s) on this machine; on real machines run one of these per machine\n"
          f"(with the first machine's address instead of 127.0.0.1):", flush=True)
    procs = []
    for node in nodes:
        cmd = torchrun_command(args, node, port, script)
        extra = {k: v for k, v in ELASTIC_ENV.items() if k not in os.environ} if args.elastic else {}
        shown_env = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in extra else ""
        print(f"  node {node}: {shown_env}{shlex.join(cmd)}", flush=True)
        # `python -m torch.distributed.run` is what the `torchrun` script runs
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
        if gpus_for is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus_for(node)
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd[1:]],
                                      cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # own group: we can stop it whole
        time.sleep(0.2)  # node 0 first, so it is the one that hosts the store
    print(flush=True)

    last_error: dict = {}  # node -> its last exception line
    hide_info = args.elastic and "LOGLEVEL" not in os.environ  # we raised it: show only restarts
    pumps = [threading.Thread(target=pump, args=(n, p.stderr, log_dir / f"node-{n}.log", last_error,
                                                 hide_info), daemon=True) for n, p in zip(nodes, procs)]
    for t in pumps:
        t.start()

    def stop_all():
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)  # the agent and its workers
                except ProcessLookupError:
                    pass
        deadline = time.time() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    start = time.time()
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(n, c) for n, c in zip(nodes, codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.time() - start > args.job_timeout:
                stop_all()
                fail(f"the job ran longer than --job-timeout {args.job_timeout:g} s and was stopped", code=1)
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all()
        fail("interrupted (Ctrl-C): every node was stopped", code=130)
    if failed:
        node, code = failed
        # Give the other agents a few seconds to notice and report their own workers'
        # failures: the node that fails *first* is often not the one with the real error.
        deadline = time.time() + 10
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        stop_all()
        for t in pumps:
            t.join(timeout=5)
        root = root_cause(last_error.get("roots", {}))
        if root:
            fail(f"rank {root['rank']} on node {root['node']} failed first: {root['error']}; "
                 f"the other nodes were stopped (full logs: {log_dir.relative_to(ROOT)}/node-*.log)",
                 code=1)
        fail(f"{explain(node, str(last_error.get(node, '')), args, port)} "
             f"(full log: {log_dir.relative_to(ROOT)}/node-{node}.log)", code=1)
    for t in pumps:
        t.join(timeout=5)
    late = sorted(last_error.get("exit_barrier", ()))
    if late:
        print(f"note: 'Error waiting on exit barrier' from node(s) {late} is torchrun's agents racing "
              f"at shutdown (node 0 closed its store first); every worker had finished and the job "
              f"succeeded.", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
