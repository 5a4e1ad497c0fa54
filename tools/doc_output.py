"""Regenerate the real output pasted into the docs, so no doc shows typed-in numbers.

A doc marks a block like this, and this script replaces the block's body with what the
command prints today (run from the repository root, stdout not a terminal):

    <!-- output: .venv/bin/python lessons/01_single_device.py -->
    ```text
    ...
    ```

Usage:
    .venv/bin/python tools/doc_output.py                 # every doc
    .venv/bin/python tools/doc_output.py docs/05_*.md    # some docs
    .venv/bin/python tools/doc_output.py --check         # list the commands, run nothing
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- output: (?P<cmd>.+?) -->\n```text\n)(?P<body>.*?)(```)", re.S)


def render(cmd: str, timeout: float = 300) -> str:
    # run as written (the reader may copy it); a fixed width keeps tables the same everywhere
    env = {**os.environ, "COLUMNS": "100", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    text = proc.stdout + proc.stderr
    text = text.replace(str(ROOT) + "/", "")  # no author's paths in the docs
    if proc.returncode != 0:
        text += f"(exit code {proc.returncode})\n"
    return text if text.endswith("\n") else text + "\n"


def main(argv: list[str]) -> None:
    check = "--check" in argv
    paths = [Path(a).resolve() for a in argv if a != "--check"] or sorted((ROOT / "docs").rglob("*.md"))
    # A translation shows the same output as its English doc: regenerate both, from one run.
    twins = [ROOT / "docs" / "zh" / p.name for p in paths if p.parent == ROOT / "docs"]
    paths += [t for t in twins if t.exists() and t not in paths]
    cache: dict[str, str] = {}

    def output(cmd: str) -> str:
        if cmd not in cache:
            cache[cmd] = render(cmd)
        return cache[cmd]

    for path in paths:
        text = path.read_text()
        commands = [m["cmd"] for m in BLOCK.finditer(text)]
        if not commands:
            continue
        for cmd in commands:
            print(f"{path.relative_to(ROOT) if path.is_absolute() else path}: {cmd}")
        if check:
            continue
        new = BLOCK.sub(lambda m: m.group(1) + output(m["cmd"]) + m.group(4), text)
        path.write_text(new)


if __name__ == "__main__":
    main(sys.argv[1:])
