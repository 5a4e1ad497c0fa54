"""Check exercise 29: run_batches, one compiled graph for batches of every size, no recompile.

In the answer's process: dynamo's caches and counters emptied, lesson 13's transformer compiled
whole with a backend that counts (the graphs it is handed, and every call of their compiled
code: the backend "eager" does the work), then the learner's run_batches on batches of 24, 16,
8 and 40 rows, under no_grad. Back come the outputs, the graphs, the calls and dynamo's
recompile reasons (its guard_failures). The outputs the model should give are computed here,
eagerly, from the same seed, and compared (1e-5); then one graph, no recompile, and every batch
through compiled code (a run that called the plain model would match too).
"""
from __future__ import annotations

STARTER = "exercises/29_one_graph.py"
ROWS = (24, 16, 8, 40)  # a size, two smaller ones (the second recompile would be avoided by
                        # automatic dynamic shapes), and a larger one than the first


def _batches() -> list:
    from common import transformer as T

    tokens = T.batch(0, T.SEED)[0]  # 48 rows of 32 tokens
    return [tokens[:n].clone() for n in ROWS]


def _run(module) -> dict:
    """In the answer's process: the learner's run_batches on a compiled model, counted."""
    import torch
    from torch._dynamo.utils import counters

    import graph_census
    from check_exercise import NotYet
    from common import transformer as T

    torch._dynamo.reset()
    counters.clear()
    graphs, calls = [], []

    def counting(gm, example_inputs):  # a backend: note the graph, run it eagerly, count its calls
        graphs.append(sum(n.op == "placeholder" for n in gm.graph.nodes))

        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    compiled = torch.compile(T.make_model(T.SEED), backend=counting)
    with torch.no_grad():
        try:
            outputs = module.run_batches(compiled, _batches())
        except Exception as exc:
            raise NotYet(f"run_batches raised {type(exc).__name__}: {exc}") from None
    if not isinstance(outputs, (list, tuple)) or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise NotYet("run_batches must return a list of tensors: the model's output for each batch, in order")
    return {"outputs": [o.detach().clone() for o in outputs], "graphs": len(graphs), "calls": len(calls),
            "recompiles": graph_census.recompile_reasons()}


def check(path) -> str:
    """The outputs are the model's; one graph, no recompile; every batch ran compiled code."""
    import torch

    from check_exercise import NotYet, answer, listed, one_line
    from common import transformer as T

    got = answer(path, _run, limit_s=120)  # two or three compiles of a small model, on a busy laptop
    if not (isinstance(got, dict) and isinstance(got.get("outputs"), list)):
        raise NotYet("run_batches did not give back its outputs")
    outputs, sizes = got["outputs"], ", ".join(map(str, ROWS))
    if len(outputs) != len(ROWS):
        raise NotYet(f"run_batches returned {len(outputs)} outputs for {len(ROWS)} batches "
                     f"({sizes} rows): one per batch, in order")
    model = T.make_model(T.SEED)
    with torch.no_grad():
        for n, x, out in zip(ROWS, _batches(), outputs):
            want = model(x)
            if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                raise NotYet(f"for the batch of {n} rows run_batches returned "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}, "
                             f"the model gives {tuple(want.shape)}: return compiled(x) for each batch")
            diff = (out - want).abs().max().item()
            if not diff <= 1e-5:
                raise NotYet(f"for the batch of {n} rows the output is {diff:.3g} away from the model's: "
                             f"return what compiled(x) gives for that very batch")
    graphs, recompiles, calls = got.get("graphs"), got.get("recompiles") or [], got.get("calls")
    if not graphs:
        raise NotYet("the outputs are right, but dynamo compiled nothing: call `compiled`, not a plain model")
    if graphs > 1 or recompiles:
        reasons = listed([one_line(r, 120) for r in recompiles], 3)
        raise NotYet(f"dynamo compiled {graphs} graphs for batches of {sizes} rows, with {len(recompiles)} "
                     f"recompile(s) ({reasons or 'no reason booked'}): the first graph was made for "
                     f"{ROWS[0]} rows only. Tell dynamo before the first call that dimension 0 changes: "
                     f"docs/29_compile.md, Step 4")
    if calls != len(ROWS):
        raise NotYet(f"one graph and no recompile, but compiled code ran for {calls} of the {len(ROWS)} "
                     f"batches: every batch goes through `compiled`")
    return (f"one graph for batches of {sizes} rows, compiled at the first call, no recompile; "
            f"every output equals the model's")
