"""Lesson 12's helpers, shared by its pitfall files: run a collective, leave a rank, gather.

Not a pitfall: lessons/12_pitfalls.py and every file beside this one import it.
"""
import os
import re
import sys
import time

if __name__ == "__main__":  # a helper, not a pitfall: one line instead of an ImportError
    sys.exit("error: kit.py holds lesson 12's helpers and runs nothing; run "
             ".venv/bin/python lessons/12_pitfalls.py, or one pitfall file beside kit.py")

import torch
import torch.distributed as dist
from rich.markup import escape

from apparatus.ui import UI, Timer


def collective(ui: UI, what: str, call, wait_if_peer_died: float = 0.0) -> None:
    """Run one collective; if it fails (timeout, mismatch, dead peer), say which, and leave."""
    timer = Timer()
    try:
        call()
    except RuntimeError as exc:
        message = re.sub(r"TensorDeviceTypes=TensorOptions\(.*?memory_format=\(nullopt\)\)",
                         "TensorDeviceTypes=...", str(exc))
        ui.say_all(f"{what} gave up after {timer.seconds:.1f}s: {escape(message.strip())}")
        if wait_if_peer_died:
            # A peer is gone: this rank is not the culprit. Wait to be stopped, so that
            # spawn() reports the rank that really failed, not this one.
            time.sleep(wait_if_peer_died)
        leave(1)


def leave(code: int) -> None:
    """Leave this rank *now*, without destroying the process group.

    After a failure the group is in an unknown state and peers may be gone: we do not call
    destroy_process_group() (it can deadlock, NCCL above all), and a normal Python exit
    would run gloo's destructors, which sometimes abort ("terminate called without an
    active exception": measured here after a timeout). os._exit skips all that; spawn()
    sees the exit code and stops the other ranks.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (so rank 0 can print them all)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def fmt(values) -> str:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return "[" + ", ".join(f"{v:+.4f}" for v in values) + "]"

