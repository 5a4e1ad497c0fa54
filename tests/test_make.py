"""The Makefile: the learner's entry point."""
import re

from conftest import ROOT, one_error_line, run

SPREAD_OVER_WORKERS = True  # its tests share no fixture: any free xdist worker takes each (conftest.py)


def lesson_numbers():
    return sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def test_help_lists_every_lesson_with_its_title():
    out = run(["make", "-s", "help"]).stdout
    for n in lesson_numbers():
        line = next(l for l in out.splitlines() if f"make lesson-{n}" in l)
        assert len(line.split(f"lesson-{n}", 1)[1].strip()) > 10, line
    for target in ("make test", "make lessons", "make clean"):
        assert target in out


def test_unknown_lesson_is_one_line_listing_the_lessons():
    proc = run(["make", "-s", "lesson-99"], check=False)
    line = one_error_line(proc)
    assert "99" in line and all(n in line for n in lesson_numbers())


def test_make_lesson_passes_args_through(tmp_path):
    out = run(["make", "-s", "lesson-01", f"ARGS=--epochs 1 --out {tmp_path}"]).stdout
    assert re.search(r"step\s+32/32", out)
    assert (tmp_path / "metrics.json").exists()


def test_diff_between_two_lessons_counts_and_shows_the_changes():
    out = run(["make", "-s", "diff", "FROM=01", "TO=05"]).stdout
    first = out.splitlines()[0]
    assert first.startswith("01_single_device.py -> 05_ddp_spawn.py:")
    added = int(re.search(r"(\d+) lines added", first)[1])
    assert added > 50 and "+++ lessons/05_ddp_spawn.py" in out
    assert "+from torch.nn.parallel import DistributedDataParallel as DDP" in out
    assert "\x1b[" not in out  # plain text when piped


def test_diff_with_an_unknown_lesson_is_one_line():
    line = one_error_line(run(["make", "-s", "diff", "FROM=01", "TO=77"], check=False))
    assert "'77'" in line and "01" in line
    line = one_error_line(run(["make", "-s", "diff", "FROM=01"], check=False))
    assert "FROM=04 TO=05" in line


def test_one_digit_lesson_number_means_that_lesson_and_no_number_is_one_line():
    # make lesson-1 is lesson 01, as make diff FROM=1 is; flags still pass through
    out = run(["make", "-s", "lesson-1", "ARGS=--help"]).stdout
    assert "lessons/01_single_device.py" in out or "01_single_device" in out, out
    line = one_error_line(run(["make", "-s", "lesson-"], check=False))
    assert "make lesson-01" in line and all(n in line for n in lesson_numbers())


def test_first_setup_shows_pips_progress():
    """The first make lesson-01 installs torch for minutes: pip must not be silenced."""
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\n$(STAMP): ", 1)[1].split("\n\n", 1)[0]
    assert "pip install" in recipe and "--quiet" not in recipe and " -q " not in recipe
    assert "--progress-bar on" in recipe


# --- the virtual environment: content, not times; a classroom's offline install -------------

import base64  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402

import pytest  # noqa: E402

# The fake .venv/bin/python of the tests below: it writes down how it was called and, for
# `-m pip`, fails when pip.fails exists beside it (an install cut short).
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls.log"
case "$*" in *"-m pip"*) [ -e "$(dirname "$0")/pip.fails" ] && exit 1 ;; esac
exit 0
"""


def fake_clone(folder, requirements: str = "torch==2.14.1\n"):
    """A copy of the repository's Makefile beside a lesson file, requirements.txt and a .venv
    whose python only writes down its calls: what `make` asks of pip, without pip."""
    (folder / "lessons").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", folder / "Makefile")
    (folder / "lessons" / "01_probe.py").write_text('"""Lesson 01: a probe."""\n')
    (folder / "requirements.txt").write_text(requirements)
    python = folder / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return python.parent / "calls.log"


def make(folder, *args, env=None):
    return subprocess.run(["make", "-s", "-C", str(folder), *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def pip_calls(log) -> list[str]:
    return [c for c in (log.read_text().splitlines() if log.exists() else []) if "-m pip" in c]


def test_a_fresh_clone_beside_an_installed_venv_does_not_run_pip_again(tmp_path):
    """The stamp says what was installed (requirements.txt's sha256), so a newer
    requirements.txt with the same pins (a fresh clone, a git checkout) runs no pip, through
    `make venv` or `make lesson-NN`; different pins do, once; an install that fails writes no
    stamp, so the next make tries again. (With the old `touch` stamp, the newer file ran pip.)"""
    log = fake_clone(tmp_path)
    assert make(tmp_path, "venv").returncode == 0 and len(pip_calls(log)) == 1
    stamp = tmp_path / ".venv" / ".installed"
    assert stamp.read_text().split() == [hashlib.sha256(b"torch==2.14.1\n").hexdigest()]
    later = time.time() + 60  # the clone's requirements.txt, newer than the venv's stamp
    os.utime(tmp_path / "requirements.txt", (later, later))
    assert make(tmp_path, "venv").returncode == 0
    proc = make(tmp_path, "lesson-01")
    assert proc.returncode == 0, proc.stderr
    assert len(pip_calls(log)) == 1, "pip ran again for the same requirements.txt"
    assert "lessons/01_probe.py" in log.read_text().splitlines()[-1]
    (tmp_path / "requirements.txt").write_text("torch==2.14.2\n")  # new pins: install them
    (log.parent / "pip.fails").touch()
    assert make(tmp_path, "lesson-01").returncode != 0 and len(pip_calls(log)) == 2
    assert stamp.read_text().split() == [hashlib.sha256(b"torch==2.14.1\n").hexdigest()]
    (log.parent / "pip.fails").unlink()
    assert make(tmp_path, "lesson-01").returncode == 0 and len(pip_calls(log)) == 3
    assert stamp.read_text().split() == [hashlib.sha256(b"torch==2.14.2\n").hexdigest()]


def test_make_venv_with_wheels_asks_that_folder_only(tmp_path):
    log = fake_clone(tmp_path)
    (tmp_path / "cache").mkdir()
    assert make(tmp_path, "venv", "WHEELS=cache").returncode == 0
    assert "--no-index --find-links cache -r requirements.txt" in pip_calls(log)[0]
    (tmp_path / ".venv" / ".installed").unlink()  # nothing installed yet, and no such folder:
    line = one_error_line(make(tmp_path, "venv", "WHEELS=nowhere"))
    assert "WHEELS=nowhere is not a folder" in line and "make wheels WHEELS=nowhere" in line
    assert len(pip_calls(log)) == 1
    line = one_error_line(make(tmp_path, "wheels"))
    assert "make wheels WHEELS=" in line and "make venv WHEELS=" in line


def tiny_wheel(folder, name: str = "classroom_probe", version: str = "1.0"):
    """A pure-Python wheel made by hand (a zip with METADATA, WHEEL and RECORD): what stands for
    torch and its friends when the test builds a wheel cache without the network."""
    files = {f"{name}.py": "VALUE = 42\n",
             f"{name}-{version}.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        lines.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[record] = "\n".join(lines + [f"{record},,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def offline_env(**extra) -> dict:
    """The environment without any pip setting of this machine (its local mirror, its
    find-links): only what the test sets reaches pip."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PYTHON": sys.executable, **extra}


def test_a_classroom_wheel_cache_installs_a_venv_with_no_index(tmp_path):
    """End to end, small: one machine runs `make wheels WHEELS=cache` (its "index" here is a
    folder holding a hand-made wheel, so no network is needed); a second clone runs
    `make venv WHEELS=cache` with an index that does not answer: pip looks in the folder only,
    the venv imports the package, and the stamp is written. The full-size run (torch and
    all, 2.7 GB) is measured by hand: README's "Installing for a classroom"."""
    index = tmp_path / "index"
    index.mkdir()
    tiny_wheel(index)
    teacher, student, cache = tmp_path / "teacher", tmp_path / "student", tmp_path / "cache"
    for clone in (teacher, student):
        clone.mkdir()
        shutil.copy(ROOT / "Makefile", clone / "Makefile")
        (clone / "requirements.txt").write_text("classroom-probe==1.0\n")
    proc = subprocess.run(["make", "-s", "-C", str(teacher), "wheels", f"WHEELS={cache}"],
                          capture_output=True, text=True, timeout=300,
                          env=offline_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in cache.iterdir()] == ["classroom_probe-1.0-py3-none-any.whl"]
    assert not (teacher / ".venv" / ".installed").exists()  # a pip to download with, no install
    proc = subprocess.run(["make", "-s", "-C", str(student), "venv", f"WHEELS={cache}"],
                          capture_output=True, text=True, timeout=300,
                          env=offline_env(PIP_INDEX_URL="http://127.0.0.1:9/simple"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Looking in links: {cache}" in proc.stdout and "Looking in indexes" not in proc.stdout
    assert "Successfully installed classroom-probe-1.0" in proc.stdout
    got = subprocess.run([str(student / ".venv" / "bin" / "python"), "-c",
                          "import classroom_probe; print(classroom_probe.VALUE)"],
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.strip() == "42", got.stderr
    stamp = (student / ".venv" / ".installed").read_text().split()
    assert stamp == [hashlib.sha256(b"classroom-probe==1.0\n").hexdigest()]
    again = subprocess.run(["make", "-C", str(student), "venv", f"WHEELS={cache}"],
                           capture_output=True, text=True, timeout=60, env=offline_env())
    assert "Nothing to be done" in again.stdout, again.stdout + again.stderr


def test_make_check_takes_a_file_whose_name_has_spaces_and_quotes(tmp_path):
    """`make check-05 FILE="my answers/05 try.py"` split the path at its space (issue 35)."""
    solution = (ROOT / "tests" / "solutions" / "05_set_epoch.py").read_text()
    path = tmp_path / "ana's answers" / "05 try.py"
    path.parent.mkdir()
    path.write_text(solution)
    proc = run(["make", "-s", "check-05", f"FILE={path}"], check=False, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stdout + proc.stderr
