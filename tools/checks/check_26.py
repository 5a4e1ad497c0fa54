"""Check exercise 26: name where a hidden bug starts (module, pass) and which bug it is.

The learner's file holds data only: SEED, MODULE, PASS and BUG, read in the answer's process
(the harness's answer(): the file runs there, never here). The check then finds the answer
itself: it draws the same hidden bug from SEED (lessons/26_parity_oracle/parity_layouts.py's
hidden_bug), records one step of it on 2 gloo ranks beside lesson 13's one process, both with
their float64 twins (record_pair, the lesson's own code: no learner code runs in it), and
compares with lesson 26's oracle. MODULE and PASS must be the oracle's first divergence, BUG
the name of the mistake hidden there.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/26_first_divergence.py"
NAMES = ("SEED", "MODULE", "PASS", "BUG")


def _names(module) -> dict:
    """In the answer's process: the four names, as plain data (anything else as its repr)."""
    said = {}
    for name in NAMES:
        value = getattr(module, name, None)
        said[name] = value if isinstance(value, (str, int)) and not isinstance(value, bool) else repr(value)
    return said


def _rank_26(rank: int, world: int, layout: str, bug) -> dict:
    """One rank of the check's own run (lesson 26's code, no learner code): on rank 0, where
    the oracle finds the first divergence; {} on the others."""
    import parity_layouts
    import parity_oracle

    pair = parity_layouts.record_pair(rank, world, layout, bug, 0, 1)
    if rank != 0:
        return {}
    first = parity_oracle.first_divergence(parity_oracle.compare(*pair))
    return {"first": parity_oracle.divergence_metrics(first)}


def _oracle(layout: str, bug) -> dict | None:
    from check_exercise import run_world

    return run_world(2, _rank_26, (layout, bug), Path(__file__))[0]["first"]


def check(path: Path) -> str:
    """MODULE and PASS are where the oracle first finds a difference above its floor; BUG names it."""
    from check_exercise import NotYet, answer

    import parity_layouts

    said = answer(path, _names)
    seed = said["SEED"]
    if not isinstance(seed, int) or not 0 <= seed < 2 ** 31:
        raise NotYet(f"SEED must be a whole number from 0 to {2 ** 31 - 1} (your teacher may give you one); it is {seed}")
    for name in NAMES[1:]:
        if not isinstance(said[name], str) or not said[name].strip():
            raise NotYet(f"{name} is not filled in yet. Record the hidden run (.venv/bin/python {STARTER}), "
                         f"compare it (.venv/bin/python tools/parity.py runs/exercise-26/reference.pt "
                         f"runs/exercise-26/parallel.pt), and read the verdict's last line")
    module, kind, bug = said["MODULE"].strip(), said["PASS"].strip().lower(), said["BUG"].strip()
    if kind not in ("forward", "backward"):
        raise NotYet(f'PASS is "forward" (a module\'s output) or "backward" (a parameter\'s gradient), not {kind!r}')
    if bug not in parity_layouts.BUGS:
        raise NotYet(f"BUG is one of lesson 26's --bug names ({', '.join(sorted(parity_layouts.BUGS))}), not {bug!r}")
    layout, hidden = parity_layouts.hidden_bug(seed)
    first = _oracle(layout, hidden)
    if first is None:  # the hidden bugs are built to show at step 1; this would be the check's fault
        raise NotYet(f"the check found no divergence for SEED {seed}: please report it (its bug did not show)")
    where = f"step {first['step']}, {first['pass']}, {first['module']}"
    names = {first["module"], first["tensor"]}
    if kind != first["pass"]:
        raise NotYet(f"SEED {seed} ({layout}): the first difference above its floor is not in the {kind} pass. "
                     f"Read the entries in the order they happened (a step's forward outputs, then its "
                     f"gradients) and stop at the first ratio above 1")
    if module not in names:
        raise NotYet(f"SEED {seed} ({layout}): {module} is not where the difference first leaves its floor in "
                     f"the {kind} pass: the oracle walks the entries in the order they happened and names the "
                     f"first one above 1, not the largest (later entries inherit the bug's numbers)")
    if bug != hidden.name:
        found = f"|B| / |A| = {first['norm_ratio']:.3f} there" if first["norm_ratio"] is not None else "its ratio"
        raise NotYet(f"SEED {seed} ({layout}): {where} is right; but {bug} ({parity_layouts.BUGS[bug][1]}) is not "
                     f"what makes it diverge there. Which of lesson 26's bugs can live in the {layout} layout "
                     f"and first show in this module's {kind}? ({found})")
    return (f"SEED {seed}: the {layout} layout's first divergence is {where} ({first['tensor']}, ratio "
            f"{first['ratio']:.1e}), and the mistake is {bug}: {parity_layouts.BUGS[bug][1]}")
