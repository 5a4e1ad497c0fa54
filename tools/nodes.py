"""Simulate several machines on this one: start one torchrun agent per "node".

    .venv/bin/python tools/nodes.py --nnodes 2 --nproc-per-node 2 -- lessons/06_torchrun_multinode.py --epochs 3

On real machines you would type one torchrun command per machine; this launcher types
them for you, on 127.0.0.1, prints them first so you can copy them, and watches the
agents: when one fails, the others are stopped, so the job never hangs. Each agent's
torchrun log (stderr) is shown with a `[node N]` prefix and saved whole, tracebacks and
all, to <the job's --out>/nodes/node-N.log; tracebacks are left out of the terminal copy.

Nothing listens beyond this machine: the launcher hosts the rendezvous store itself on
127.0.0.1 (the agents join it as clients) and holds its port until the job ends, and the
workers' own store binds 127.0.0.1 too (--local-addr). Ctrl-C, SIGTERM or SIGHUP stop every
agent and worker first; a launcher killed with SIGKILL takes its agents along (Linux
parent-death signal), and they take their workers. A worker's one-line `error:` (a usage
error, a refused snapshot) ends the job at once: a restart could not fix it.

Make targets use it: `make lesson-06` (static rendezvous, two nodes) and `make lesson-07`
(c10d rendezvous with restarts: --elastic).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.cli import LessonParser, fail, nonnegative_int, port_number, positive_float, positive_int  # noqa: E402
from common.distributed import LOOPBACK, host_store  # noqa: E402
from common.processes import (die_with_make, restore_terminal, set_parent_death_signal,  # noqa: E402
                                 signal_name, stop_signals)
from apparatus.results import LOCK_ENV, claim_out, out_dir  # noqa: E402


def parse_args(argv):
    if "--" not in argv:
        fail("usage: .venv/bin/python tools/nodes.py [options] -- SCRIPT [script flags]")
    cut = argv.index("--")
    own, script = argv[:cut], argv[cut + 1:]
    if not script:
        fail("no script after --; e.g. .venv/bin/python tools/nodes.py -- lessons/06_torchrun_multinode.py")
    p = LessonParser(prog=".venv/bin/python tools/nodes.py", description=__doc__.splitlines()[0])
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


def torchrun_command(args, node_rank: int, port: int, script: list[str],
                     simulated: bool = False) -> list[str]:
    """The torchrun command one machine would run (simulated=True: the one we run here)."""
    cmd = ["torchrun", f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}"]
    if args.elastic:
        # c10d: the agents meet in a store at --rdzv-endpoint (the agent on that host
        # serves it; here the launcher does, so every agent is a client: is_host=false);
        # node ranks are assigned at the rendezvous, so no --node-rank.
        conf = f"join_timeout={args.rdzv_timeout}" + (",is_host=false" if simulated else "")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lesson",
                f"--rdzv-conf={conf}", f"--max-restarts={args.max_restarts}"]
        if simulated:
            cmd += [f"--local-addr={LOOPBACK}"]  # the workers' MASTER_ADDR: their store binds it
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


def pump(node: int, stream, log_path: Path, seen: dict, hide_info: bool = False,
         quiet: threading.Event | None = None) -> None:
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
            m = re.match(r"^\s+time\s+:\s+(\S+)", text)
            if m and node in seen.get("roots", {}):
                seen["roots"][node]["time"] = m[1]
            m = re.match(r"^\s+traceback : Signal (\d+) \((\w+)\) received", text)
            if m and node in seen.get("roots", {}):  # killed: no traceback, only the signal
                seen["roots"][node]["error"] = f"killed by {m[2]} (signal {m[1]})"
            if text.startswith("error: ") and "usage" not in seen:
                # a worker's one-line error (common.cli.fail): a restart could not fix it
                seen["usage"] = (node, text[len("error: "):].strip())
                if quiet is not None:
                    quiet.set()
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
                if quiet is None or not quiet.is_set():
                    sys.stderr.write(f"[node {node}]   traceback : (in {shown(log_path)})\n")
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
            if quiet is not None and quiet.is_set():
                continue  # the job is being stopped: its noise stays in the log file
            if "[c10d] waitForInput" in line:
                continue  # the socket-level echo of a store timeout reported just below
            if FORGIVEN.search(line):
                continue  # the agent's own store bind failing on purpose (see AGENT_CLIENT_ENV)
            sys.stderr.write(f"[node {node}] {line}")
            sys.stderr.flush()


# What a rank reports when it was not the cause but lost a peer that crashed
CONSEQUENCE = re.compile(r"Connection closed by peer|remote worker crash|Connection reset|"
                         r"SIGTERM|SignalException|got signal|SIGHUP|SIGINT")
FORGIVEN = re.compile(r"failed to bind\. TORCHELASTIC_USE_AGENT_STORE is enabled")


def root_cause(roots: dict) -> dict | None:
    """The failure that started it, out of every node's torchrun summary: a real error (a
    crash, a SIGKILL) before a consequence (a peer that lost its connection), and of those
    the earliest (torchrun's time stamps have one-second steps; ties go to the lower node)."""
    found = [{"node": n, **r} for n, r in sorted(roots.items()) if "error" in r]
    real = [r for r in found if not CONSEQUENCE.search(r["error"])]
    ranked = sorted(real or found, key=lambda r: r.get("time", ""))
    return ranked[0] if ranked else None


def explain(node: int, error: str, args, port: int) -> str:
    m = re.search(r"(\d+)/(\d+) clients joined", error)
    # static rendezvous with our store: the agents swap their role info through it, and an
    # agent gives up waiting for the keys of nodes that never came (we started only these)
    if "torchelastic/role_info" in error and "timeout" in error:
        came = len(args.only_node) if args.only_node is not None else args.min_nodes
        m = [None, str(min(came, args.min_nodes)), str(args.min_nodes)]
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


def job_folder(script: list[str]) -> Path:
    """The script's --out (where its results and our logs go), else runs/lesson-NN."""
    for k, word in enumerate(script):
        if word == "--out" and k + 1 < len(script):
            return Path(script[k + 1])
        if word.startswith("--out="):
            return Path(word[len("--out="):])
    path = Path(script[0])
    lesson = path.parent.name == "lessons" and path.stem[:2].isdigit()
    return out_dir(path.stem[:2], None) if lesson else ROOT / "runs" / path.stem


def descendants(roots: list[int]) -> list[int]:
    """Every process below `roots` (from /proc): torchrun starts its workers in process
    groups of their own, so stopping an agent's group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


# Static rendezvous: node 0's agent would host the store, on every interface. The launcher
# hosts it on 127.0.0.1 instead; with these variables the agent's TCPStore forgives its own
# failed bind and joins ours as a client (torch 2.14.1, TCPStore.cpp: the same address check
# as torch/distributed/rendezvous.py's _agent_store_serves).
def agent_client_env(port: int) -> dict:
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}


def main(argv: list[str]) -> None:
    die_with_make()  # make lesson-06 / lesson-07: killed with make, the agents with us
    args, script = parse_args(argv)
    nodes = args.only_node if args.only_node is not None else list(range(args.max_nodes if args.elastic else args.min_nodes))
    # the job's folder is ours alone (a second job on it stops here), and holds our logs
    folder = claim_out(job_folder(script))
    log_dir = folder / "nodes"
    log_dir.mkdir(parents=True, exist_ok=True)
    # Each agent makes a folder of its own under $TMPDIR (torchelastic_...) and leaves it there
    # when it exits: give them one inside the job's folder, removed when the job ends.
    agent_tmp = log_dir / "tmp"
    agent_tmp.mkdir(exist_ok=True)
    # the rendezvous store, on 127.0.0.1 only; we hold its port until the job ends
    store, port = host_store(LOOPBACK, args.master_port or 0, args.job_timeout)

    gpus_for = plan_gpus(len(nodes), args.nproc_per_node)
    print(f"Simulating {len(nodes)} node(s) on this machine; on real machines run one of these per machine\n"
          f"(with the first machine's address instead of 127.0.0.1):", flush=True)
    procs = []
    quiet = threading.Event()  # set when the job is being stopped: no more agent noise
    with stop_signals():
        try:
            for node in nodes:
                cmd = torchrun_command(args, node, port, script)
                extra = {k: v for k, v in ELASTIC_ENV.items() if k not in os.environ} if args.elastic else {}
                shown_env = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in extra else ""
                # shown as .venv/bin/torchrun: the command runs as printed from the repo root
                print(f"  node {node}: {shown_env}.venv/bin/{shlex.join(cmd)}", flush=True)
                # `python -m torch.distributed.run` is what the `torchrun` script runs
                env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra,
                       LOCK_ENV: str(folder.resolve())}  # we hold the lock for the ranks
                # torchrun sets OMP_NUM_THREADS=1 when it is unset, with a 3-line banner per
                # agent; set it the same way ourselves, quietly (the lessons then set their own
                # thread count with torch.set_num_threads)
                env.setdefault("OMP_NUM_THREADS", "1")
                env["TMPDIR"] = str(agent_tmp)
                if not args.elastic:
                    env.update(agent_client_env(port))
                if gpus_for is not None:
                    env["CUDA_VISIBLE_DEVICES"] = gpus_for(node)
                real = torchrun_command(args, node, port, script, simulated=True)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", *real[1:]], cwd=ROOT, env=env,
                    stderr=subprocess.PIPE, text=True,
                    start_new_session=True,  # own group: a Ctrl-C reaches us, we stop it whole
                    preexec_fn=set_parent_death_signal))  # and if we are SIGKILLed, it dies too
                time.sleep(0.2)  # node 0 first
            print(flush=True)
            run_job(args, nodes, procs, port, log_dir, quiet)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (Stopped)
            quiet.set()
            stop_all(procs)
            restore_terminal(end_line=True)
            name, code = signal_name(exc)
            fail(f"interrupted ({name}): every node and worker was stopped; nothing was saved "
                 f"for this run", code=code)
        finally:
            stop_all(procs)
            shutil.rmtree(agent_tmp, ignore_errors=True)
            restore_terminal()
            del store


def stop_all(procs, grace: float = 15.0) -> None:
    """SIGTERM each agent's group (the agent stops its workers), SIGKILL what is left after
    `grace` seconds, and return only once every agent and worker is gone."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    workers = descendants([p.pid for p in running])
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # the agent and its own group
    deadline = time.time() + grace
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for pid in workers + descendants([p.pid for p in procs]):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    end = time.time() + 5
    while time.time() < end and any(alive(pid) for pid in workers):
        time.sleep(0.05)


def run_job(args, nodes, procs, port, log_dir, quiet) -> None:
    last_error: dict = {}  # node -> its last exception line
    hide_info = args.elastic and "LOGLEVEL" not in os.environ  # we raised it: show only restarts
    pumps = [threading.Thread(target=pump, args=(n, p.stderr, log_dir / f"node-{n}.log", last_error,
                                                 hide_info, quiet), daemon=True)
             for n, p in zip(nodes, procs)]
    for t in pumps:
        t.start()
    shown_logs = shown(log_dir)

    start = time.time()
    failed = None
    while True:
        if "usage" in last_error:  # a worker's one-line error: stop now, do not restart
            quiet.set()
            stop_all(procs)
            node, message = last_error["usage"]
            fail(message, code=2)
        codes = [p.poll() for p in procs]
        bad = [(n, c) for n, c in zip(nodes, codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
            break
        if all(c == 0 for c in codes):
            break
        if time.time() - start > args.job_timeout:
            quiet.set()
            stop_all(procs)
            fail(f"the job ran longer than --job-timeout {args.job_timeout:g} s and was stopped", code=1)
        time.sleep(0.1)
    if failed:
        node, code = failed
        # Give the other agents a few seconds to notice and report their own workers'
        # failures: the node that fails *first* is often not the one with the real error.
        deadline = time.time() + 10
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        quiet.set()
        stop_all(procs)
        for t in pumps:
            t.join(timeout=5)
        if "usage" in last_error:
            fail(last_error["usage"][1], code=2)
        root = root_cause(last_error.get("roots", {}))
        if root:
            fail(f"rank {root['rank']} on node {root['node']} failed first: {root['error']}; "
                 f"the other nodes were stopped (full logs: {shown_logs}/node-*.log)", code=1)
        fail(f"{explain(node, str(last_error.get(node, '')), args, port)} "
             f"(full log: {shown_logs}/node-{node}.log)", code=1)
    for t in pumps:
        t.join(timeout=5)
    late = sorted(last_error.get("exit_barrier", ()))
    if late:
        print(f"note: 'Error waiting on exit barrier' from node(s) {late} is torchrun's agents racing "
              f"at shutdown (node 0 closed its store first); every worker had finished and the job "
              f"succeeded.", file=sys.stderr)


def shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main(sys.argv[1:])
