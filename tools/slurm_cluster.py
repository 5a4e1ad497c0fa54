"""A real 2-node Slurm cluster on this one Linux machine, for lessons 06 and 07 (root only).

    sudo .venv/bin/python tools/slurm_cluster.py up          # nodes n1 and n2, in about 2 s
    sudo .venv/bin/python tools/slurm_cluster.py exec sinfo  # a command on n1, the login node
    sudo .venv/bin/python tools/slurm_cluster.py exec bash   # a shell on n1: sbatch, squeue, ...
    sudo .venv/bin/python tools/slurm_cluster.py status
    sudo .venv/bin/python tools/slurm_cluster.py down        # every process stopped, nothing left

Debian's Slurm (apt-get install slurmctld slurmd slurm-client munge, 22.05) runs unchanged.
Each node is a Linux network, UTS (host name) and mount namespace of its own, held open by
one `sleep` process; a veth pair joins the two, created inside them, with addresses from
198.51.100.0/24 (a documentation range no real network uses) that exist only there. Each
node has its own munged (one shared key), and sees its own /etc/hosts, /etc/slurm and /run
through bind mounts made inside its namespace only: this machine's /etc, its network
interfaces and its listening ports are not touched. n1 runs slurmctld and a slurmd, n2 a
slurmd; both see this machine's files (the checkout is the cluster's shared file system).
proctrack/linuxproc and task/none: no cgroups, no systemd.

Everything lives in one folder (/tmp/slurm-lessons, or --state DIR) until `down`: the
configuration, the logs, the PIDs started. `down` stops every process inside the two
namespaces by its PID (the daemons, then whatever jobs they started), ends the namespaces
(their veth pair and addresses go with them) and deletes that folder.
Docs: docs/TEACHING.md ("Slurm on one machine"), docs/06_torchrun_multinode.md, docs/07_elastic.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_HOME = Path("/tmp/slurm-lessons")
NODES = {"n1": "198.51.100.1", "n2": "198.51.100.2"}  # RFC 5737 TEST-NET-2: documentation only
CONTROLLER = "n1"  # runs slurmctld, and is where `exec` runs commands (the login node)
SLURM = ["slurmctld", "slurmd", "sbatch", "munged"]  # Debian: slurmctld slurmd slurm-client munge
SYSTEM = ["unshare", "nsenter", "ip"]  # util-linux and iproute2, on every Debian
PACKAGES = "apt-get install -y slurmctld slurmd slurm-client munge"

# One slurm.conf for both nodes (Slurm wants them identical). Its paths are under /run,
# which is each node's own folder (HOME/nX/run), so the same text gives each node its own
# spool, logs and PID files.
SLURM_CONF = """\
# Written by tools/slurm_cluster.py: a 2-node test cluster, CPU only, on one machine.
ClusterName=lessons
SlurmctldHost={controller}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (120 by default):
# 10 here, so that a requeue takes seconds, not minutes.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Pending jobs are all looked at every 2 s (60 by default): a requeued job starts as soon as
# its wait is over, instead of up to a minute later.
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/run/slurm/ctld
SlurmdSpoolDir=/run/slurm/spool
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/run/slurm/slurmctld.log
SlurmdLogFile=/run/slurm/slurmd.log
# Finished jobs stay in squeue/scontrol for 5 minutes (no accounting database here, so no
# sacct); a job's processes get 10 s between SIGTERM and SIGKILL.
MinJobAge=300
KillWait=10
{nodes}
PartitionName=cpu Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def fail(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def command(home: Path) -> str:
    """How to type this tool for the cluster in `home`, for the messages."""
    return "sudo .venv/bin/python tools/slurm_cluster.py" + ("" if home == DEFAULT_HOME else f" --state {home}")


def check_can_run(home: Path) -> None:
    if os.geteuid() != 0:
        fail(f"tools/slurm_cluster.py must run as root (it makes network namespaces and starts "
             f"Slurm's daemons): {command(home)} ...")
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [p for p in SLURM if not shutil.which(p, path=path)]
    if missing:
        fail(f"Slurm's Debian packages are missing ({', '.join(missing)} not found): {PACKAGES}")
    missing = [p for p in SYSTEM if not shutil.which(p, path=path)]
    if missing:
        fail(f"{', '.join(missing)} not found: apt-get install -y util-linux iproute2")


# ----------------------------------------------------------------------- processes by PID

def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): with the PID it names one
    process, so a PID the kernel has given to another process since is never signalled.
    None when there is no such process, or only its zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def alive(proc: list) -> bool:
    pid, started = proc
    return start_time(pid) == started


def net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def in_namespace(ns: str) -> list[int]:
    """Every live process in network namespace `ns`: our daemons and what they started."""
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and net_namespace(int(p.name)) == ns and start_time(int(p.name))]


def stop(pids: list[int], grace: float) -> int:
    """SIGTERM (SIGKILL if grace is 0), up to `grace` s to exit, then SIGKILL what is left."""
    marked = {pid: t for pid in pids if (t := start_time(pid))}
    for pid in marked:
        os.kill(pid, signal.SIGTERM if grace else signal.SIGKILL)
    for wait, sig in ((grace, signal.SIGKILL), (10, None)):
        deadline = time.monotonic() + wait
        while any(start_time(p) == t for p, t in marked.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid, t in marked.items():
            if sig and start_time(pid) == t:
                os.kill(pid, sig)
    return len(marked)


def on_node(holder: int, *cmd: str, wd: str | None = None) -> list[str]:
    """The command line that runs `cmd` on the node whose namespaces `holder` holds."""
    return ["nsenter", "-t", str(holder), "-n", "-u", "-m", *([f"--wd={wd}"] if wd else []), "--", *cmd]


def load_state(home: Path) -> dict | None:
    try:
        return json.loads((home / "state.json").read_text())
    except (OSError, ValueError):
        return None


def save_state(home: Path, state: dict) -> None:
    tmp = home / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, home / "state.json")


# ----------------------------------------------------------------------------------- up

def write_files(home: Path) -> None:
    """The cluster's configuration, all in `home`; the nodes see it at /etc/hosts, /etc/slurm."""
    home.mkdir(mode=0o700)  # fails if it exists: `up` checked that no cluster is there
    (home / "etc" / "slurm").mkdir(parents=True)
    # Each address twice: also as IPv4-mapped IPv6, the form in which torch's TCPStore sees
    # its clients and asks for their names (else it warns "The hostname of the client socket
    # cannot be retrieved"; a real cluster's DNS answers that for it).
    hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n::ffff:{addr} {name}\n"
                                               for name, addr in NODES.items())
    (home / "etc" / "hosts").write_text(hosts)
    nodes = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={os.cpu_count()} State=UNKNOWN"
                      for name, addr in NODES.items())
    (home / "etc" / "slurm" / "slurm.conf").write_text(
        SLURM_CONF.format(controller=CONTROLLER, nodes=nodes, names=",".join(NODES)))
    key = home / "munge.key"  # one key for every node's munged: why they trust each other
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for name in NODES:
        (home / name / "run" / "slurm" / "spool").mkdir(parents=True)
        (home / name / "run" / "munge").mkdir(mode=0o700)


def start_holder(home: Path, name: str) -> list:
    """A `sleep` in new network, UTS and mount namespaces, which it holds open. Before it
    sleeps, it names the node and bind-mounts the node's /etc/hosts, /etc/slurm and /run:
    mounts that exist in its mount namespace only (unshare makes that one private)."""
    setup = (f"hostname {name} && mount --bind {home}/etc/hosts /etc/hosts && "
             f"mount --bind {home}/etc/slurm /etc/slurm && mount --bind {home}/{name}/run /run && "
             f"ip link set lo up && echo ready && exec sleep infinity >/dev/null")
    proc = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                             "sh", "-c", setup], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    if proc.stdout.readline().strip() != "ready":
        proc.wait(5)
        raise RuntimeError(f"node {name}'s namespaces could not be made: {proc.stderr.read().strip()}")
    proc.stdout.close()
    proc.stderr.close()
    return [proc.pid, start_time(proc.pid)]


def start_daemon(holder: int, log: Path, *cmd: str) -> list:
    """A daemon in the foreground of its own session, inside a node: nsenter execs it, so
    the PID we keep is the daemon's."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(on_node(holder, *cmd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd="/", start_new_session=True)
    return [proc.pid, start_time(proc.pid)]


def tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "empty"


def wait_for(what: str, ready, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s ("
                               + "; ".join(f"{log}: {tail(log)}" for log in logs) + ")")
        time.sleep(0.05)


def node_states(holder: int) -> dict[str, str]:
    out = subprocess.run(on_node(holder, "sinfo", "-h", "-N", "-o", "%N %T"),
                         capture_output=True, text=True, timeout=10)
    return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)


def up(home: Path) -> None:
    if home.exists():
        fail(f"a cluster is already up, or was not taken down ({home} exists): {command(home)} down")
    started = time.monotonic()
    write_files(home)
    state: dict = {"holders": {}, "daemons": []}
    try:
        for name in NODES:
            state["holders"][name] = start_holder(home, name)
            save_state(home, state)
        holders = {name: state["holders"][name][0] for name in NODES}
        # the veth pair, made inside the two namespaces: it never exists on this machine's side
        subprocess.run(["ip", "link", "add", "veth0", "netns", str(holders["n1"]), "type", "veth",
                        "peer", "name", "veth0", "netns", str(holders["n2"])],
                       check=True, capture_output=True, text=True, timeout=10)
        for name, addr in NODES.items():
            subprocess.run(on_node(holders[name], "ip", "-batch", "-"), check=True, capture_output=True,
                           text=True, timeout=10, input=f"addr add {addr}/24 dev veth0\nlink set veth0 up\n")
        for name in NODES:  # munged, as root (--force), everything in the node's own /run/munge
            state["daemons"].append(start_daemon(
                holders[name], home / name / "run" / "munge" / "munged.out", "munged", "-F", "--force",
                f"--key-file={home}/munge.key", "--socket=/run/munge/munge.socket.2",
                "--pid-file=/run/munge/munged.pid", "--log-file=/run/munge/munged.log",
                "--seed-file=/run/munge/munged.seed"))
            save_state(home, state)
        for name in NODES:
            munge = home / name / "run" / "munge"
            wait_for(f"munged on {name}", (munge / "munge.socket.2").exists, 10, [munge / "munged.log"])
        slurm = {name: home / name / "run" / "slurm" for name in NODES}
        state["daemons"].append(start_daemon(holders[CONTROLLER], slurm[CONTROLLER] / "slurmctld.out",
                                             "slurmctld", "-D"))
        for name in NODES:
            state["daemons"].append(start_daemon(holders[name], slurm[name] / "slurmd.out", "slurmd", "-D"))
        save_state(home, state)

        def idle() -> bool:
            states = node_states(holders[CONTROLLER])
            return len(states) == len(NODES) and all(s == "idle" for s in states.values())
        wait_for("the nodes", idle, 30, [slurm[CONTROLLER] / "slurmctld.log"]
                 + [slurm[name] / "slurmd.log" for name in NODES])
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or "").strip()
        down(home, quiet=True)
        fail(f"the cluster did not come up: {exc} {detail}".strip())
    print(f"up in {time.monotonic() - started:.1f} s: nodes "
          f"{', '.join(f'{n} ({a})' for n, a in NODES.items())}, partition cpu, {os.cpu_count()} "
          f"CPUs each; configuration and logs in {home}")
    print(f"submit from the repository root: {command(home)} exec sbatch ...; "
          f"stop it: {command(home)} down")


# --------------------------------------------------------------------------------- down

def down(home: Path, quiet: bool = False) -> None:
    started = time.monotonic()
    if not home.exists():
        if not quiet:
            print(f"no cluster is up ({home} does not exist): nothing to do")
        return
    state = load_state(home) or {"holders": {}, "daemons": []}
    holders = [h for h in state["holders"].values() if alive(h)]
    namespaces = {net_namespace(pid) for pid, _ in holders} - {None}
    # 1. the daemons we started, by PID, and every other process in the nodes' namespaces:
    #    the jobs' slurmstepd, torchrun and workers, which our slurmd started
    daemons = {pid for pid, t in state["daemons"] if alive([pid, t])}
    jobs = {pid for ns in namespaces for pid in in_namespace(ns)}
    stopped = stop(sorted((daemons | jobs) - {pid for pid, _ in holders}), grace=2)
    # 2. the holders: when the last process in them is gone, the namespaces end, and with
    #    them the veth pair, its addresses and the bind mounts
    stop([pid for pid, _ in holders], grace=0)
    left = [pid for ns in namespaces for pid in in_namespace(ns)]
    if left:
        fail(f"processes {left} are still inside the cluster's namespaces; {home} kept")
    shutil.rmtree(home)
    if not quiet:
        print(f"down in {time.monotonic() - started:.1f} s: stopped {stopped} process(es) and the "
              f"{len(holders)} nodes' namespaces; removed {home}")


def status(home: Path) -> None:
    state = load_state(home)
    if not state:
        print(f"no cluster is up ({home})")
        return
    for name, holder in state["holders"].items():
        print(f"{name}: {NODES[name]}, namespaces held by pid {holder[0]} "
              f"({'alive' if alive(holder) else 'GONE'})")
    daemons = [f"{pid} ({'alive' if alive([pid, t]) else 'GONE'})" for pid, t in state["daemons"]]
    print(f"daemons: {', '.join(daemons)}; configuration and logs in {home}")
    subprocess.run(on_node(state["holders"][CONTROLLER][0], "sinfo", "-N"), timeout=10)


def exec_on(home: Path, node: str, cmd: list[str]) -> None:
    """Run `cmd` on `node`, in this directory, with this environment: replaces this process."""
    state = load_state(home)
    if not state:
        fail(f"no cluster is up: {command(home)} up")
    if not cmd:
        fail(f"no command: e.g. {command(home)} exec sinfo")
    holder = state["holders"][node]
    if not alive(holder):
        fail(f"node {node} is gone: {command(home)} down, then up")
    os.execvp("nsenter", on_node(holder[0], *cmd, wd=os.getcwd()))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog=".venv/bin/python tools/slurm_cluster.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--state", type=Path, default=DEFAULT_HOME,
                        help=f"the cluster's folder (default {DEFAULT_HOME}); one folder, one cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the cluster: nodes n1 and n2, partition cpu")
    sub.add_parser("down", help="stop every process it started, and remove its folder")
    sub.add_parser("status", help="its PIDs, and sinfo")
    run = sub.add_parser("exec", help="run a command on a node (default n1), in this directory")
    run.add_argument("--node", choices=sorted(NODES), default=CONTROLLER, help="which node (default n1)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    args = parser.parse_args(argv)
    home = args.state.resolve()
    check_can_run(home)
    if args.command == "up":
        up(home)
    elif args.command == "down":
        down(home)
    elif args.command == "status":
        status(home)
    else:
        exec_on(home, args.node, args.cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
