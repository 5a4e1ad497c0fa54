"""tests/zygote.py: a command forked from the zygote behaves as `python script.py` would."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, _zygote

SCRIPT = textwrap.dedent('''
    import atexit, json, os, sys
    import torch.multiprocessing as mp

    def child(i, folder):
        open(os.path.join(folder, f"rank{i}"), "w").write(str(os.getpid()))

    if __name__ == "__main__":
        atexit.register(lambda: print("atexit ran"))
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                          "pid": os.getpid(), "ppid": os.getppid(), "stdin": sys.stdin.read(),
                          "env": os.environ.get("ZYGOTE_TEST"), "name": __name__}))
        print("to stderr", file=sys.stderr)
        mode = sys.argv[1]
        if mode == "spawn":
            mp.spawn(child, args=(sys.argv[2],), nprocs=2)
        elif mode == "raise":
            raise ValueError("boom")
        elif mode == "exit":
            sys.exit("a message")
        elif mode == "signal":
            os.kill(os.getpid(), 15)
        elif mode == "sleep":
            import time
            open(sys.argv[2], "w").write(str(os.getpid()))
            time.sleep(60)
''')


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "script.py"
    path.write_text(SCRIPT)
    return path


def both(script, *args, env=None, timeout=60):
    """The same command as a real new Python and as a zygote child."""
    cmd = [sys.executable, str(script), *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "ZYGOTE_TEST": "yes", **(env or {})}
    real = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)
    assert _zygote().usable(cmd, full_env, {})
    forked = _zygote().run(cmd, cwd=ROOT, env=full_env, timeout=timeout)
    return real, forked


def facts(proc):
    import json
    return json.loads(proc.stdout.splitlines()[0])


def test_a_child_is_a_process_of_its_own_with_the_commands_setting(script, tmp_path):
    real, forked = both(script, "spawn", tmp_path)
    assert forked.returncode == real.returncode == 0, forked.stderr
    a, b = facts(real), facts(forked)
    assert b["pid"] not in (os.getpid(), _zygote().proc.pid) and b["ppid"] == _zygote().proc.pid
    for key in ("argv", "path0", "cwd", "stdin", "env", "name"):
        assert a[key] == b[key], key
    assert b["name"] == "__main__" and b["stdin"] == "" and b["env"] == "yes"
    assert real.stderr == forked.stderr == "to stderr\n"
    assert real.stdout.splitlines()[1:] == forked.stdout.splitlines()[1:] == ["atexit ran"]
    # mp.spawn from the child started its ranks from the script's __main__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.parametrize("mode,code", [("raise", 1), ("exit", 1), ("signal", -15)])
def test_errors_end_it_as_they_end_python(script, mode, code):
    real, forked = both(script, mode)
    assert real.returncode == forked.returncode == code
    assert real.stderr.splitlines()[-1] == forked.stderr.splitlines()[-1]  # same last line
    if mode == "raise":
        assert "Traceback" in forked.stderr and "ValueError: boom" in forked.stderr


def test_a_timeout_kills_the_child(script, tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        _zygote().run([sys.executable, str(script), "sleep", pid_file], cwd=ROOT,
                      env=dict(os.environ), timeout=5)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_it_outlives_the_thread_that_started_it():
    """The parent-death signal follows the thread that started a process: the zygote must
    survive a ThreadPoolExecutor's worker starting it (tests/test_lesson_12.py's does)."""
    from concurrent.futures import ThreadPoolExecutor

    from zygote import Zygote
    zygote = Zygote()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(zygote.start).result()
    import time
    time.sleep(1)
    assert zygote.proc.poll() is None
    proc = zygote.run([sys.executable, "-m", "json.tool", "--help"], cwd=ROOT,
                      env=dict(os.environ), timeout=60)
    assert proc.returncode == 0
    zygote.proc.kill()


def test_what_torch_reads_at_import_runs_in_a_new_python(script):
    cmd = [sys.executable, str(script), "x"]
    env = dict(_zygote().env)
    assert _zygote().usable(cmd, env, {})
    # emulated in the child instead (test_a_commands_python_subprocess_is_forked_...: threads)
    assert _zygote().usable(cmd, {**env, "OMP_NUM_THREADS": "1"}, {})
    assert not _zygote().usable(cmd, {**env, "TORCH_CPP_LOG_LEVEL": "INFO"}, {})
    assert not _zygote().usable(cmd, env, {"input": "x"})
    assert not _zygote().usable(["make", "test"], env, {})
    assert _zygote().usable([".venv/bin/python", "-m", "bench.run"], env, {}, cwd=ROOT)


def test_python_dash_m_runs_the_module_as_main():
    cmd = [sys.executable, "-m", "json.tool", "--help"]
    real = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    forked = _zygote().run(cmd, cwd=ROOT, env=dict(os.environ), timeout=60)
    assert forked.returncode == real.returncode == 0
    assert forked.stdout == real.stdout and "usage:" in forked.stdout


def test_a_changed_import_time_variable_starts_a_new_zygote(monkeypatch):
    before = _zygote()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    after = _zygote()
    assert after is not before and after.env["OMP_NUM_THREADS"] == "3"
    assert before.proc.wait(10) is not None  # the old one has exited
    proc = after.run([sys.executable, "-m", "json.tool", "--help"], cwd=ROOT,
                     env=dict(os.environ), timeout=60)
    assert proc.returncode == 0


RANKS = textwrap.dedent('''
    import json, os, signal, sys, tempfile
    sys.path.insert(0, os.getcwd())
    from common.processes import start_ranks

    def facts(rank, world):
        server = os.getppid()  # a rank's parent is the fork server
        return json.dumps({
            "server_is_python_c": b"multiprocessing.forkserver" in open(f"/proc/{server}/cmdline", "rb").read(),
            "server_parent": open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1],
            "fds": sorted(os.listdir("/proc/self/fd")), "path": sys.path, "cwd": os.getcwd(),
            "main": sys.modules["__main__"].__name__, "env": os.environ.get("ZYGOTE_TEST"),
            "sigint": str(signal.getsignal(signal.SIGINT)), "dynamo": "torch._dynamo" in sys.modules,
            "argv": sys.argv, "tmp": tempfile.gettempdir()})

    if __name__ == "__main__":
        print(os.getpid())
        for line in start_ranks(facts, 2):
            print(line)
''')


def test_a_commands_fork_server_is_forked_too_and_serves_as_the_real_one(tmp_path):
    """start_ranks' fork server: a new `python -c` in a real Python, the zygote child's standby
    copy of itself under the zygote. Either way it is the command's child, and its ranks see
    the same descriptors, path, __main__, environment, directory and SIGINT handler."""
    path = tmp_path / "ranks.py"
    path.write_text(RANKS)
    tmp = tmp_path / "tmp"  # the command's $TMPDIR, not the zygote's (Python keeps the first it reads)
    tmp.mkdir()
    real, forked = both(path, timeout=240, env={"TMPDIR": str(tmp)})  # a real Python imports torch and torch._dynamo twice
    assert real.returncode == forked.returncode == 0, forked.stderr
    (real_pid, *a), (forked_pid, *b) = real.stdout.splitlines(), forked.stdout.splitlines()
    a, b = [json.loads(x) for x in a], [json.loads(x) for x in b]
    assert [r["server_is_python_c"] for r in a] == [True, True]
    assert [r["server_is_python_c"] for r in b] == [False, False]  # the standby served
    assert [r["server_parent"] for r in a] == [real_pid] * 2
    assert [r["server_parent"] for r in b] == [forked_pid] * 2
    for x, y in zip(a, b):
        assert x["tmp"] == y["tmp"] == str(tmp)
        for key in ("fds", "path", "cwd", "main", "env", "sigint", "dynamo", "argv"):
            assert x[key] == y[key], (key, x[key], y[key])


def test_a_command_that_starts_no_fork_server_leaves_no_standby(script, tmp_path):
    """The standby ends with its command: nothing of it is left once the command has ended."""
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        _zygote().run([sys.executable, str(script), "sleep", pid_file], cwd=ROOT,
                      env=dict(os.environ), timeout=3)
    command = pid_file.read_text()
    import time
    deadline = time.time() + 5
    while time.time() < deadline:
        left = [p for p in os.listdir("/proc") if p.isdigit()
                and _stat_field(p, 1) == command]  # children of the killed command
        if not left:
            break
        time.sleep(0.2)
    assert not left, left


def _stat_field(pid: str, index: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[index]
    except OSError:
        return None


POPEN_PARENT = textwrap.dedent('''
    import json, os, signal, subprocess, sys
    if __name__ == "__main__":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a new Python inherits what is ignored
        r, w = os.pipe()
        child = subprocess.Popen(
            [sys.executable, "-u", sys.argv[1], str(w)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=sys.argv[2], pass_fds=(w,),
            env={**os.environ, "CHILD_VAR": "set", "OMP_NUM_THREADS": "1",
                 "TORCHELASTIC_RUN_ID": "x"}, start_new_session=True, text=True)
        os.close(w)
        out, _ = child.communicate("from the parent", timeout=120)
        print(json.dumps({"out": out, "code": child.returncode, "pid": child.pid,
                          "ppid_was_us": json.loads(out.splitlines()[0])["ppid"] == os.getpid(),
                          "through_pass_fd": os.read(r, 100).decode()}))
''')

POPEN_CHILD = textwrap.dedent('''
    import json, os, signal, sys, torch
    fd = int(sys.argv[1])
    print(json.dumps({"ppid": os.getppid(), "own_session": os.getsid(0) == os.getpid(),
                      "argv": sys.argv[0], "path0": sys.path[0], "cwd": os.getcwd(),
                      "var": os.environ.get("CHILD_VAR"), "stdin": sys.stdin.read(),
                      # fd, and not the socket to its own nursery, when forked (1000 and up)
                      "fds": sorted(f for f in os.listdir("/proc/self/fd") if f != sys.argv[1]
                                    and int(f) < 1000),
                      "main": __name__,
                      "sigint": str(signal.getsignal(signal.SIGINT)),
                      "sighup": str(signal.getsignal(signal.SIGHUP)),
                      "sigterm": str(signal.getsignal(signal.SIGTERM)),
                      "threads": torch.get_num_threads(),
                      "forked": b"zygote.py" in open("/proc/self/cmdline", "rb").read()}))
    os.write(fd, b"written")
    print("to stderr", file=sys.stderr)
    sys.exit(3)
''')


def test_a_commands_python_subprocess_is_forked_and_behaves_as_a_new_one(tmp_path):
    """subprocess.Popen([sys.executable, "-u", script, ...]) in a command (tools/nodes.py's
    agents, torchrun's workers): a new Python in a real Python, the command's nursery's child
    under the zygote. Either way it is the command's child, in its own session, with Popen's
    pipes, passed descriptor, environment, directory, argv, and what the command ignores."""
    parent, child = tmp_path / "parent.py", tmp_path / "child.py"
    parent.write_text(POPEN_PARENT)
    child.write_text(POPEN_CHILD)
    real, forked = both(parent, child, tmp_path, timeout=240)
    assert real.returncode == forked.returncode == 0, forked.stderr
    a, b = json.loads(real.stdout), json.loads(forked.stdout)
    assert a["ppid_was_us"] and b["ppid_was_us"]
    for result in (a, b):
        assert result["code"] == 3 and result["through_pass_fd"] == "written"
        assert result["out"].splitlines()[1:] == ["to stderr"]
    x, y = (json.loads(r["out"].splitlines()[0]) for r in (a, b))
    for key in ("own_session", "argv", "path0", "cwd", "var", "stdin", "fds", "main", "sigint",
                "sighup", "sigterm", "threads"):
        assert x[key] == y[key], (key, x[key], y[key])
    assert y["threads"] == 1 and y["sighup"] == str(int(signal.SIG_IGN)) and y["stdin"] == "from the parent"
    # and the forked one really was forked (its /proc/PID/cmdline is the zygote's)
    assert not x["forked"] and y["forked"]


def test_described_gives_a_forked_commands_own_command_line_and_environment(script, tmp_path):
    from conftest import described
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        import threading
        seen = {}

        def look():
            import time
            deadline = time.time() + 30
            while not pid_file.exists() or not pid_file.read_text():
                if time.time() > deadline:
                    return
                time.sleep(0.05)
            pid = int(pid_file.read_text())
            seen["proc"] = open(f"/proc/{pid}/cmdline", "rb").read()
            seen["described"] = described(pid)
        looker = threading.Thread(target=look)
        looker.start()
        _zygote().run([sys.executable, str(script), "sleep", pid_file], cwd=ROOT,
                      env={**os.environ, "ZYGOTE_TEST": "described"}, timeout=5)
    looker.join()
    assert b"zygote.py" in seen["proc"]  # what /proc says of a forked command
    cmdline, env = seen["described"]
    assert cmdline == [sys.executable, str(script), "sleep", str(pid_file)]
    assert env["ZYGOTE_TEST"] == "described"
