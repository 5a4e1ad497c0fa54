"""Single-machine runs listen on loopback only, whatever the hostname resolves to, and leave
nothing in $TMPDIR.

On cloud VMs and in containers the hostname usually resolves to a real network address, and
gloo's own listener (one per rank, beside the rendezvous store) binds to that address by
default (torch 2.14.1). Here each lesson runs in a network namespace of its own, made by the
test, where the hostname resolves to 192.0.2.2 (a documentation address, on a veth pair that
reaches nothing outside the namespace), and every TCP listener the job opens is recorded.
Before common/distributed.keep_gloo_on_loopback, lessons 05, 15 and make lesson-06 each had a
gloo listener per rank on 192.0.2.2.
"""
import os
import shutil
import subprocess

import pytest

from conftest import ROOT, lesson_path

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)

PROBE = r"""
set -e
ip link set lo up
ip link add v0 type veth peer name v1
ip addr add 192.0.2.2/24 dev v0
ip link set v0 up; ip link set v1 up
printf '127.0.0.1 localhost\n192.0.2.2 %s\n' "$(hostname)" > "$HOSTS_FILE"
mount --bind "$HOSTS_FILE" /etc/hosts
getent hosts "$(hostname)" | grep -q 192.0.2.2
"$@" &
pid=$!
seen=""
while kill -0 $pid 2>/dev/null; do
  seen="$seen $(ss -ltnH | awk '{print $4}' | tr '\n' ' ')"
  sleep 0.05
done
set +e; wait $pid; rc=$?
echo "RC=$rc"
echo "LISTENED:$(echo $seen | tr ' ' '\n' | sort -u | tr '\n' ' ')"
"""


def namespace_ok() -> str | None:
    """Why this machine cannot make the test's namespace, or None when it can."""
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("ss")):
        return "needs unshare, ip and ss (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "-n", "-m", "sh", "-c",
                            "ip link add v0 type veth peer name v1"], capture_output=True)
    return None if probe.returncode == 0 else "cannot create a network namespace here (not root?)"


@pytest.mark.parametrize("command", [
    [".venv/bin/python", str(lesson_path("05")), "--epochs", "1"],
    [".venv/bin/python", str(lesson_path("15")), "--steps", "10"],
    ["make", "-s", "lesson-06", "ARGS=--epochs 1"],
], ids=["05", "15", "06"])
def test_listeners_stay_on_loopback_when_the_hostname_does_not(command, tmp_path):
    why = namespace_ok()
    if why:
        pytest.skip(why)
    out = tmp_path / "out"
    if command[0] == "make":
        command = [*command[:-1], f"{command[-1]} --out {out}"]
    else:
        command = [*command, "--out", str(out)]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(["unshare", "-n", "-m", "bash", "-c", PROBE, "probe", *command],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HOSTS_FILE": str(tmp_path / "hosts"),
                               "TMPDIR": str(tmp)})
    lines = done.stdout.splitlines()
    assert "RC=0" in lines, done.stdout[-2000:] + done.stderr[-2000:]
    listened = next(line for line in lines if line.startswith("LISTENED:")).split(":", 1)[1].split()
    assert listened, "no listener was ever seen: the probe is broken"
    assert all(a.startswith(("127.", "[::1]")) for a in listened), \
        f"listened beyond loopback: {[a for a in listened if not a.startswith(('127.', '[::1]'))]}"
    assert (out / "final.pt").exists()
    # nothing left in $TMPDIR either (torch._dynamo's torchinductor_$USER, pymp-*)
    assert not list(tmp.iterdir()), f"left in $TMPDIR: {[p.name for p in tmp.iterdir()]}"
