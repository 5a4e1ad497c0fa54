"""Single-machine runs listen on loopback only, whatever the hostname resolves to, and leave
nothing in $TMPDIR.

On cloud VMs and in containers the hostname usually resolves to a real network address, and
gloo's own listener (one per rank, beside the rendezvous store) binds to that address by
default (torch 2.14.1). Here each lesson runs, as a new Python, in a network and mount
namespace of its own (`unshare -n -m`, root only), where the hostname resolves to 192.0.2.2 (a
documentation address, on a veth pair that reaches nothing outside the namespace), and every
TCP listener the job opens is recorded: /proc/PID/net/tcp and tcp6 of a process in the
namespace list its sockets, read every 20 ms until the job ends.
Before common/distributed.keep_gloo_on_loopback, lessons 05, 15 and make lesson-06 each had a
gloo listener per rank on 192.0.2.2.
"""
import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, lesson_path, make_command

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

# run as root in the command's new network and mount namespace, before the command (exec'd)
SETUP = r"""
set -e
mount --make-rprivate /
ip link set lo up
ip link add v0 type veth peer name v1
ip addr add 192.0.2.2/24 dev v0
ip link set v0 up; ip link set v1 up
printf '127.0.0.1 localhost\n192.0.2.2 %s\n' "$(hostname)" > "$HOSTS_FILE"
mount --bind "$HOSTS_FILE" /etc/hosts
getent hosts "$(hostname)" | grep -q 192.0.2.2
"""


def namespace_ok() -> str | None:
    """Why this machine cannot make the test's namespace, or None when it can."""
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("mount")):
        return "needs unshare, ip and mount (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "-n", "-m", "sh", "-c",
                            "ip link add v0 type veth peer name v1"], capture_output=True)
    return None if probe.returncode == 0 else "cannot create a network namespace here (not root?)"


@pytest.mark.parametrize("command", [
    [sys.executable, str(lesson_path("05")), "--epochs", "1"],
    [sys.executable, str(lesson_path("15")), "--steps", "10"],
    make_command("06", "--epochs", "1"),  # make lesson-06's command: 2 nodes x 2 workers
], ids=["05", "15", "06"])
def test_listeners_stay_on_loopback_when_the_hostname_does_not(command, tmp_path):
    why = namespace_ok()
    if why:
        pytest.skip(why)
    out = tmp_path / "out"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "TMPDIR": str(tmp),
           "HOSTS_FILE": str(tmp_path / "hosts")}
    job = subprocess.Popen(["unshare", "-n", "-m", "bash", "-c", SETUP + '\nexec "$@"', "bash",
                            *map(str, command), "--out", str(out)],
                           cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                           stdout=open(tmp_path / "output", "w"), stderr=subprocess.STDOUT)
    listened, deadline = set(), time.monotonic() + 240
    ours = os.readlink("/proc/self/ns/net")
    while job.poll() is None and time.monotonic() < deadline:
        # the job's pid is in the namespace once unshare has made it (unshare then execs bash,
        # bash the command): read nothing before, or we would see this machine's listeners
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{job.pid}/ns/net") != ours:
                listened |= tcp_listeners(job.pid)
        time.sleep(0.02)
    if job.poll() is None:
        job.kill()
    job.wait()
    assert job.returncode == 0, (tmp_path / "output").read_text()[-4000:]
    assert listened, "no listener was ever seen: the watcher is broken"
    beyond = [a for a in listened if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not beyond, f"listened beyond loopback: {beyond}"
    assert (out / "final.pt").exists()
    # nothing left in $TMPDIR either (torch._dynamo's torchinductor_$USER, pymp-*)
    assert not list(tmp.iterdir()), f"left in $TMPDIR: {[p.name for p in tmp.iterdir()]}"


def tcp_listeners(pid: int) -> set[str]:
    """"address:port" of every listening TCP socket in process `pid`'s network namespace."""
    out = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return out
