"""Docs cannot drift from the code.

1. Every lesson command a doc shows (in a bash block or an output marker) uses only flags
   that the lesson's --help lists.
2. Every command that runs a lesson, shown anywhere (docs/*.md, docs/zh/*.md, README*.md, the
   lessons' docstrings: bash blocks, output markers, inline code), is accepted by the lesson's
   own flag checks, parsed in this process as the lesson parses it; a few quick ones run.
3. Pasted output is real: for a chosen set of blocks we run the command again and compare,
   with every number masked (timings, pids and ports change from run to run; the words,
   the steps and the shape of tables must not).
"""
import ast
import contextlib
import io
import os
import re
import shlex
import sys
from functools import lru_cache

import pytest

from common.cli import LessonParser
from conftest import LAUNCHERS, ROOT, import_lesson, make_command, run

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


# --- 2. every shown command, parsed by its lesson ----------------------------------------

SHOWN_IN = sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "zh").glob("*.md"), *ROOT.glob("README*.md"),
                   *(ROOT / "lessons").glob("[0-9][0-9]_*.py")])
FENCE = re.compile(r"```.*?```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
RUNNER = re.compile(r"(?:[A-Z_]+=\S*\s+)*(?:make|\S*python3?|\S*torchrun)\s")  # a line that runs something
SHELL = {"|", "||", "&&", ";", "&"}  # where one command ends and the next begins


def shown_commands(path) -> list[str]:
    """The command lines a page shows: bash blocks' lines (continuations joined), output
    markers, and inline code that runs something; of a lesson file, its docstring's lines."""
    text = path.read_text()
    if path.suffix == ".py":
        lines = (ast.get_docstring(ast.parse(text)) or "").replace("\\\n", " ").splitlines()
    else:
        lines = [m[1] for m in OUTPUT.finditer(text)]
        for block in BASH.findall(text):
            lines += block.replace("\\\n", " ").splitlines()
        lines += SPAN.findall(FENCE.sub("", text))
    return [line.strip() for line in lines if RUNNER.match(line.strip())]


def launched_world(words: list[str]) -> dict[str, str]:
    """The WORLD_SIZE and LOCAL_WORLD_SIZE a launcher (torchrun, tools/nodes.py) gives the
    lesson it starts, from its --nnodes (the least of an elastic N:M) and --nproc-per-node."""
    if not any(w.endswith(("torchrun", "nodes.py")) for w in words):
        return {}
    given = {}
    for i, word in enumerate(words):
        key, equals, value = word.partition("=")
        if key in ("--nnodes", "--nproc-per-node", "--nproc_per_node"):
            given[key.replace("_", "-")] = value if equals else words[i + 1]
    per_node = int(given.get("--nproc-per-node", 1))
    return {"WORLD_SIZE": str(int(given.get("--nnodes", "1").split(":")[0]) * per_node), "LOCAL_WORLD_SIZE": str(per_node)}


def lesson_argvs(cmd: str) -> list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]]:
    """(lesson number, the flags the lesson receives, the environment the command gives it) for
    each lesson a command line runs: `... lessons/NN_x.py FLAGS` (python, torchrun,
    tools/nodes.py), or `make lesson-NN [STEP=1] [ARGS="FLAGS"]` (the Makefile's lesson rule:
    lesson NN's launcher if it has one, --step, then ARGS). The environment: VAR=value words
    before the command, and a launcher's world size."""
    words = shlex.split(cmd, comments=True)
    out, start = [], 0
    for end in [i for i, w in enumerate(words) if w in SHELL] + [len(words)]:
        part, start = words[start:end], end + 1
        part = [w for w in part if not re.match(r"\d?>", w)]  # 2>&1, > file: the shell's, not the lesson's
        env = dict(w.split("=", 1) for w in part[:next((i for i, w in enumerate(part) if not re.match(r"[A-Z_]+=", w)), 0)])
        for i, word in enumerate(part):
            if m := re.match(r"(?:\S*/)?lessons/(\d\d)_\w+\.py$", word):
                env |= launched_world(part[:i])
                out.append((m[1], tuple(part[i + 1:]), tuple(sorted(env.items()))))
                break
            if (m := re.match(r"lesson-(\d\d)$", word)) and "make" in part[:i]:
                flags = ["--step"] if "STEP=1" in part else []
                for w in part:
                    flags += shlex.split(w[5:]) if w.startswith("ARGS=") else []
                env |= launched_world(LAUNCHERS.get(m[1], "").split())
                out.append((m[1], tuple(flags), tuple(sorted(env.items()))))
                break
    return out


def every_shown_lesson_command() -> dict[tuple, list[str]]:
    """{(lesson, flags, environment): the pages that show it}."""
    found: dict = {}
    for path in SHOWN_IN:
        for cmd in shown_commands(path):
            for key in lesson_argvs(cmd):
                found.setdefault(key, []).append(f"{path.relative_to(ROOT)}: {cmd}")
    return found


SHOWN = every_shown_lesson_command()


class Parsed(Exception):
    """argparse accepted the flags (lessons 01-04 parse inside main(): we stop it there)."""


def parse_as_the_lesson(number: str, flags: tuple[str, ...], env: tuple, monkeypatch, capsys) -> str | None:
    """None if lesson `number` accepts `flags` in environment `env`, else its error line. Every
    lesson but 01-04 has parse_args(): argparse and the lesson's own checks (dp x tp, heads,
    world sizes ...), which end in one line and exit 2 before any work. Lessons 01-04 parse
    inside main(): argparse's checks only (types and choices), main() stopped once they pass.
    A lesson may set variables for its ranks as it parses (12's --debug-detail): they go."""
    module = import_lesson(number)
    before = dict(os.environ)
    monkeypatch.setattr(sys, "argv", [module.__file__, *flags])
    os.environ.update(env)
    try:
        return _parsed(module, monkeypatch, capsys)
    finally:  # this worker's environment as it was, whatever the lesson set
        os.environ.clear()
        os.environ.update(before)


def _parsed(module, monkeypatch, capsys) -> str | None:
    parse = getattr(module, "parse_args", None)
    if parse is None:
        accept = LessonParser.parse_args

        def parse_then_stop(self, *args, **kwargs):
            raise Parsed(accept(self, *args, **kwargs))
        monkeypatch.setattr(LessonParser, "parse_args", parse_then_stop)
        parse = module.main
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help
            parse()
    except Parsed:
        pass
    except SystemExit as exc:
        if exc.code not in (0, None):
            return (capsys.readouterr().err.strip().splitlines() or [f"exit code {exc.code}"])[-1]
    return None


@pytest.mark.parametrize("number,flags,env", sorted(SHOWN),
                         ids=[" ".join([*(f"{k}={v}" for k, v in e), n, *f]) for n, f, e in sorted(SHOWN)])
def test_every_shown_command_is_accepted_by_its_lesson(number, flags, env, monkeypatch, capsys):
    """Issue 34: doc 23 showed `--model 3b --dp 64 --tp 8 --microbatches 2`, which lesson 23
    refused (512 ranks, not the default 1,024). A command a page shows must pass the lesson's
    own checks as written."""
    error = parse_as_the_lesson(number, flags, env, monkeypatch, capsys)
    assert error is None, f"lesson {number} refuses {' '.join(flags) or '(no flags)'}: {error}\nshown in " + \
        "\n  ".join(SHOWN[number, flags, env])


def test_the_shown_commands_are_found():
    """The collection above sees every kind of place: a docstring, a bash block, an output
    marker, a make line with ARGS and STEP, inline code, a pipe, a Chinese page."""
    places = {place.split(":")[0] for pages in SHOWN.values() for place in pages}
    assert {"lessons/23_cluster_on_a_laptop.py", "docs/23_cluster_on_a_laptop.md",
            "docs/zh/23_cluster_on_a_laptop.md", "README.md", "docs/TEACHING.md"} <= places
    assert ("23", ("--model", "3b", "--dp", "64", "--tp", "8", "--microbatches", "2"), ()) in SHOWN
    assert ("23", ("--step",), ()) in SHOWN and ("05", ("--world-size", "4"), ()) in SHOWN
    assert lesson_argvs('X_Y=1 make -s lesson-12 STEP=1 ARGS="--break set-epoch" 2>&1 | grep -v x  # y') == \
        [("12", ("--step", "--break", "set-epoch"), (("X_Y", "1"),))]
    assert lesson_argvs(".venv/bin/python lessons/17_tensor_parallel.py --impl dtensor | grep a && "
                        ".venv/bin/python lessons/17_tensor_parallel.py --sequence-parallel") == \
        [("17", ("--impl", "dtensor"), ()), ("17", ("--sequence-parallel",), ())]
    world = (("LOCAL_WORLD_SIZE", "2"), ("WORLD_SIZE", "4"))  # 2 nodes x 2
    assert lesson_argvs(".venv/bin/python tools/nodes.py --nnodes 2 --nproc-per-node 2 -- "
                        "lessons/06_torchrun_multinode.py --crash-rank 3") == [("06", ("--crash-rank", "3"), world)]
    assert lesson_argvs("make lesson-06") == [("06", (), world)]  # the Makefile's RUN_06
    assert lesson_argvs("torchrun --nnodes=1:3 --nproc-per-node=8 lessons/07_elastic.py")[0][2] == \
        (("LOCAL_WORLD_SIZE", "8"), ("WORLD_SIZE", "8"))
    assert len(SHOWN) > 100


# Shown commands that also run here, as written (plus --out into a temporary folder): quick ones.
RUN_AS_SHOWN = [
    ".venv/bin/python lessons/23_cluster_on_a_laptop.py --model tiny --world-size 1024 --tp 4",
    ".venv/bin/python lessons/19_two_d_mesh.py --plan 7e9 --gpus 8 --gpu-gb 80",
]


@pytest.mark.parametrize("command", RUN_AS_SHOWN)
def test_a_few_shown_commands_run(command, tmp_path):
    (number, flags, env), = lesson_argvs(command)
    assert (number, flags, env) in SHOWN, f"no page shows `{command}` any more: pick another quick one"
    proc = run(make_command(number, *flags, "--out", tmp_path), timeout=300)
    assert "Traceback" not in proc.stderr and (tmp_path / ("plan.json" if "--plan" in flags else "metrics.json")).exists()


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
