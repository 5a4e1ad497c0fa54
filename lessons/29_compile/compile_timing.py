"""Timing eager against compiled steps on a shared machine (lesson 29's Steps 3 and 5).

The two models take turns, one step each, the order reversed every round (A B, B A, A B, ...,
as bench/measure.py's in_turn): a machine that slows down during the run slows both alike,
and neither always runs right after the other. The first round is left out of the numbers:
the compiled model compiles in it, and both pay first-step costs (DDP's bucket rebuild).
Each is summed up by its median and spread, never a mean alone, and the machine's load is
printed beside them.
"""
from __future__ import annotations

import os
import statistics

NAMES = ("eager", "compiled")


def turn(step: int) -> tuple[str, str]:
    """Who goes first at this step: eager on even steps, compiled on odd ones."""
    return NAMES if step % 2 == 0 else NAMES[::-1]


def spread(values: list[float]) -> dict:
    """Median, the middle half (first and third quartiles) and the extremes."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


def ratios(compiled: list[float], eager: list[float]) -> dict:
    """compiled / eager, round by round (the two steps of one round ran back to back)."""
    return spread([c / e for c, e in zip(compiled, eager)])


def payback(compile_s: float, eager_s: float, compiled_s: float) -> float | None:
    """Steps after which the compile has paid for itself at these speeds; None if never."""
    saved = eager_s - compiled_s
    return compile_s / saved if saved > 0 else None


def load() -> tuple[float, int]:
    """The 1-minute load average and the cores: a load above the cores means the steps queued."""
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")), os.cpu_count() or 1


def milliseconds(s: dict) -> list[str]:
    """A spread as table cells, in ms."""
    return [f"{s['median'] * 1e3:.1f}", f"{s['q1'] * 1e3:.1f}-{s['q3'] * 1e3:.1f}",
            f"{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}"]
