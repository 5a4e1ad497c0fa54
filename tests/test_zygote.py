"""tests/zygote.py: a command forked from the zygote behaves as `python script.py` would, but
for the differences its docstring lists (checked here too, so the list stays true); and what
a command starts itself is a new Python, as on a learner's machine."""
import os
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
    assert _zygote().usable(cmd, full_env)
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


def test_what_python_or_torch_reads_as_they_start_runs_in_a_new_python(script):
    cmd = [sys.executable, str(script), "x"]
    env = dict(_zygote().env)
    assert _zygote().usable(cmd, env)
    assert _zygote().usable(cmd, {**env, "PYTHONUNBUFFERED": "1"})  # set up again in the child
    for name, value in (("OMP_NUM_THREADS", "1"), ("TORCH_CPP_LOG_LEVEL", "INFO"),
                        ("PYTHONWARNINGS", "error"), ("PYTHONPATH", "/elsewhere")):
        assert not _zygote().usable(cmd, {**env, name: value}), name
    assert not _zygote().usable(cmd, env, {"input": "x"})
    assert not _zygote().usable(["make", "test"], env)
    assert _zygote().usable([".venv/bin/python", "-m", "bench.run"], env, cwd=ROOT)


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


# No torch here: a new Python running it costs little.
LIGHT = textwrap.dedent('''
    import subprocess, sys
    IMPORTED = "import sys; print(sorted(m for m in ('torch', 'rich') if m in sys.modules))"
    if sys.argv[1] == "imported":    # what this process finds imported already
        exec(IMPORTED)
    elif sys.argv[1] == "child":     # what a Python this command starts finds imported
        print(subprocess.run([sys.executable, "-c", IMPORTED], capture_output=True, text=True).stdout.strip())
    elif sys.argv[1] == "hash":
        print(hash("rank-order"))
''')


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "light.py"
    path.write_text(LIGHT)
    return path


def forked_line(path, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return _zygote().run([sys.executable, str(path), *args], cwd=ROOT, env=env, timeout=60).stdout.strip()


def new_line(path, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def test_a_python_the_command_starts_is_a_new_one(light):
    """No nursery: subprocess and multiprocessing are left as they are, so the Pythons a
    command starts (in the lessons: the ranks' fork server, torchrun's agents and workers)
    import everything themselves, as on a learner's machine."""
    assert forked_line(light, "child") == new_line(light, "child") == "[]"


def test_the_listed_differences_hold(light):
    """tests/zygote.py says forked commands share the zygote's string-hash seed and find torch
    and rich imported already: both are true (a new Python draws its own seed)."""
    assert forked_line(light, "hash") == forked_line(light, "hash")
    assert len({new_line(light, "hash") for _ in range(3)}) > 1  # 3 equal 64-bit draws: never
    assert forked_line(light, "imported") == "['rich', 'torch']" and new_line(light, "imported") == "[]"


def test_described_reads_proc(tmp_path):
    from conftest import described
    argv, env = described(os.getpid())
    assert argv[0].endswith("python") or "python" in argv[0] and env.get("PATH") == os.environ.get("PATH")
    assert described(2 ** 22 + 12345) is None
