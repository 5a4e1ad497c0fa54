"""Single-machine runs listen on loopback only, whatever the hostname resolves to, and leave
nothing in $TMPDIR.

On cloud VMs and in containers the hostname usually resolves to a real network address, and
gloo's own listener (one per rank, beside the rendezvous store) binds to that address by
default (torch 2.14.1). Here each lesson runs in a network namespace of its own, made by the
test, where the hostname resolves to 192.0.2.2 (a documentation address, on a veth pair that
reaches nothing outside the namespace), and every TCP listener the job opens is recorded
(read from the namespace's /proc/net/tcp and tcp6 every 20 ms).
Before common/distributed.keep_gloo_on_loopback, lessons 05, 15 and make lesson-06 each had a
gloo listener per rank on 192.0.2.2.
"""
import ipaddress
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, _zygote, lesson_path, make_command

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

# run as root in the command's new network and mount namespace (tests/zygote.py)
SETUP = r"""
set -e
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
    report = tmp_path / "listened.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "TMPDIR": str(tmp)}
    # forked from the test zygote, as are the Pythons it starts (ranks' fork server, agents,
    # workers): all of them in the namespace, where a watcher records every TCP listener
    done = _zygote().run([*command, "--out", out], cwd=ROOT, env=env, timeout=240,
                         netns={"setup": SETUP, "env": {"HOSTS_FILE": str(tmp_path / "hosts")},
                                "listeners_file": str(report)})
    seen = json.loads(report.read_text())
    assert "error" not in seen, seen
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    listened = seen["listened"]
    assert listened, "no listener was ever seen: the watcher is broken"
    beyond = [a for a in listened if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not beyond, f"listened beyond loopback: {beyond}"
    assert (out / "final.pt").exists()
    # nothing left in $TMPDIR either (torch._dynamo's torchinductor_$USER, pymp-*)
    assert not list(tmp.iterdir()), f"left in $TMPDIR: {[p.name for p in tmp.iterdir()]}"
