"""Docs cannot drift from the code.

1. Every lesson command a doc shows (in a bash block or an output marker) uses only flags
   that the lesson's --help lists.
2. Pasted output is real: for a chosen set of blocks we run the command again and compare,
   with every number masked (timings, pids and ports change from run to run; the words,
   the steps and the shape of tables must not).
"""
import contextlib
import io
import re
import shlex
import sys
from functools import lru_cache

import pytest

from conftest import ROOT, import_lesson, run

DOCS = sorted((ROOT / "docs").glob("[0-9][0-9]_*.md"))
OUTPUT = re.compile(r"<!-- output: (.+?) -->\n```text\n(.*?)```", re.S)
BASH = re.compile(r"```bash\n(.*?)```", re.S)
# Output blocks re-run by test 2: quick, and together they cover one- and multi-process output.
RERUN = [".venv/bin/python lessons/01_single_device.py", ".venv/bin/python lessons/05_ddp_spawn.py"]


def commands(doc):
    text = doc.read_text()
    found = [m[1] for m in OUTPUT.finditer(text)]
    for block in BASH.findall(text):
        found += [line.split("#")[0].strip() for line in block.splitlines()]
    return [c for c in found if c]


def lesson_and_flags(cmd):
    """('05', ['--world-size', ...]) for `python lessons/05_x.py ...` or `make lesson-05 ARGS=...`."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        return None
    for i, w in enumerate(words):
        m = re.match(r"(?:\S*/)?lessons/(\d\d)_\w+\.py$", w)
        if m:
            return m[1], [x.split("=")[0] for x in words[i + 1:] if x.startswith("--")]
        m = re.match(r"lesson-(\d\d)$", w)
        if m:
            args = " ".join(x[5:] for x in words if x.startswith("ARGS="))
            return m[1], [x.split("=")[0] for x in shlex.split(args) if x.startswith("--")]
    return None


@lru_cache(maxsize=None)
def help_text(number):
    """`python lessons/NN_*.py --help`, in this process: every lesson's main() parses its flags
    first, and --help prints the help and exits before anything else runs, so there is no
    Python to start per lesson (24 of them cost this file about 150 s of a worker)."""
    module = import_lesson(number)
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module.__file__, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            module.main()  # lessons 06 and 07: torch's @record turns exit code 0 into a return
    except SystemExit as exc:
        assert exc.code in (0, None), (number, exc.code)
    finally:
        sys.argv = argv
    assert "usage:" in out.getvalue(), (number, out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.stem)
def test_every_shown_command_uses_real_flags(doc):
    checked = 0
    for cmd in commands(doc):
        parsed = lesson_and_flags(cmd)
        if not parsed:
            continue
        number, flags = parsed
        for flag in flags:
            if flag != "--help":
                assert re.search(rf"{re.escape(flag)}\b", help_text(number)), \
                    f"{doc.name} shows `{cmd}`, but lesson {number} has no {flag}"
        checked += 1
    assert checked, f"{doc.name} shows no command for its lesson"


def mask(text):
    """Numbers become # (and a measured "faster"/"slower" with them), table rules and runs of
    spaces collapse; lines are sorted because ranks print in whatever order they reach the
    terminal."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line)
        line = re.sub(r"\b(faster|slower)\b", "faster/slower", line)  # a measurement, like the numbers
        line = re.sub(r"[━─┏┓┗┛┡┩└┘┳┻╇┃│┌┐╸╺]+", "|", line)
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            lines.append(line)
    return sorted(lines)


@pytest.mark.parametrize("command", RERUN)
def test_pasted_output_matches_a_fresh_run(command):
    blocks = {m[1]: m[2] for doc in DOCS for m in OUTPUT.finditer(doc.read_text())}
    assert command in blocks, f"no doc pastes the output of `{command}`"
    words = shlex.split(command)
    fresh = run([sys.executable, *words[1:]], timeout=180)
    assert mask(fresh.stdout + fresh.stderr) == mask(blocks[command]), \
        f"the output pasted for `{command}` is stale: run `make docs-output`"
