"""Every command a lesson prints or a doc shows runs as written from the repository root in a
fresh shell: `.venv/bin/python ...` or `make ...`, never a bare `python`, which outside an
activated venv is a Python without torch (ModuleNotFoundError). Scanned: the lessons (their
docstrings and printed hints), the exercises, bench/ and tools/, every doc in English and
Chinese, and the READMEs, the `<!-- output: ... -->` markers included (a reader copies them
too; tools/doc_output.py runs them as written)."""
import re

from conftest import ROOT

# this repository's scripts and modules (the before-stop hook's rule); a PyTorch module
# named in passing (`python -m torch.distributed.launch`, the old launcher) is not flagged
BARE = re.compile(r"(?<![\w/.-])python3? +(lessons/|tools/|bench/|exercises/|apparatus/|"
                  r"-m +(common|bench|tools|apparatus|lessons)\b)")


def scanned():
    for pattern in ("lessons/**/*.py", "exercises/*", "bench/*.py", "tools/*.py",
                    "docs/*.md", "docs/zh/*.md", "README*.md"):
        yield from (p for p in sorted(ROOT.glob(pattern)) if p.is_file())


def test_no_command_needs_an_activated_venv():
    hits = []
    for path in scanned():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if BARE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, ("commands with a bare `python` (write `.venv/bin/python ...` or "
                      "`make lesson-NN ARGS=...`):\n" + "\n".join(hits))


def test_the_scan_catches_what_it_should():
    for bad in ("python lessons/05_ddp_spawn.py", "    python -m bench.run --quick",
                "`python3 tools/check_exercise.py 05`", "run `python tools/nodes.py --nnodes 2`"):
        assert BARE.search(bad), bad
    for good in (".venv/bin/python lessons/05_ddp_spawn.py", "make lesson-05",
                 "<!-- output: .venv/bin/python lessons/01_single_device.py -->", "Python 3.11",
                 "a python object", "cpython -m x"):
        assert not BARE.search(good), good
