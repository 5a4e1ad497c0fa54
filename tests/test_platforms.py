"""Every lesson imports cleanly where the POSIX-only parts of the standard library are missing.

Tested here on Linux only. Native Windows has no fcntl, termios or pty, and no SIGHUP or
SIGKILL; a lesson that touched one of them at import time could not even print its --help
there (apparatus/results.py imported fcntl at the top: issue 26). This test hides them in a
fresh Python and imports every module of ours and every lesson file (their main() does not
run), so an import-time use of them fails here first. What then runs on Windows is not
tested here: README says what is tested (Linux) and what is expected elsewhere.
"""
import subprocess
import sys

from conftest import ROOT

HIDE_POSIX = r"""
import importlib.util, signal, subprocess, sys, types
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root)] + [str(d) for d in sorted((root / "lessons").glob("[0-9][0-9]_*/"))]
LESSONS = sorted((root / "lessons").glob("[0-9][0-9]_*.py"))


def import_lessons():
    from common import lesson_module
    for path in LESSONS:
        sys.modules.pop("lesson_" + path.name[:2], None)  # anew: step 4 imports them again
        lesson_module(path.name[:2])


# 1. Everything theirs (torch, rich, the standard library) as this platform has it: on
#    Windows they take their own paths, which this Linux cannot imitate.
import_lessons()
# 2. Forget ours, 3. hide what Windows lacks, 4. import ours again.
venv = root / ".venv"
for name, module in list(sys.modules.items()):
    file = getattr(module, "__file__", None) or ""
    if file.startswith(str(root)) and not file.startswith(str(venv)):
        del sys.modules[name]
for name in ("fcntl", "termios", "tty", "pty", "resource"):
    sys.modules[name] = None                  # `import fcntl` now raises ImportError
for name in ("SIGHUP", "SIGKILL", "SIGQUIT", "SIGUSR1"):
    if hasattr(signal, name):
        delattr(signal, name)
fake = types.ModuleType("msvcrt")              # Windows' own lock, which Linux lacks
fake.LK_NBLCK = 2
fake.locking = lambda fd, mode, n: None
sys.modules["msvcrt"] = fake
import_lessons()
import apparatus.results, common.distributed, common.datasets
apparatus.results.claim_out(root / "runs" / "platform-test")  # the lock through msvcrt's stand-in
print("imported", " ".join(p.name[:2] for p in LESSONS))
"""


def test_every_lesson_imports_without_posix_only_modules():
    done = subprocess.run([sys.executable, "-c", HIDE_POSIX, str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lessons = sorted(p.name[:2] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    assert done.stdout.split("imported", 1)[1].split() == lessons
