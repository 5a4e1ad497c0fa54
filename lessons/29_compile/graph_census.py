"""What torch.compile did, counted: the graphs dynamo handed to the backend, the graph breaks
and skipped frames with their reasons, the recompilations with theirs. Lesson 29's Step 4.

A backend is any function (graph_module, example_inputs) -> callable: Counted wraps the real
one (torch._dynamo.lookup_backend("inductor"), "aot_eager", "eager") and notes each graph it is
handed. The reasons come from dynamo's own books (PRIVATE API, torch._dynamo.utils):
counters["graph_break"] holds the breaks dynamo resumed after (one graph before, one after),
counters["unimplemented"] the ones it could not resume after, where it gave up on the whole
frame ("skipping the frame"); guard_failures holds, per code object, why a cached graph's
guards failed and it compiled again. TORCH_LOGS="graph_breaks,recompiles" prints the same.
"""
from __future__ import annotations

import re

import torch


class Counted:
    """A backend that counts: every graph dynamo hands it (its calls and inputs), then the real
    backend compiles it. name: "inductor", "aot_eager", "eager"."""

    def __init__(self, name: str):
        self.name, self.graphs = name, []
        self.real = torch._dynamo.lookup_backend(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        calls = sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.graphs.append({"calls": calls, "inputs": len(inputs), "first_input": nice_name(inputs[0])})
        return self.real(gm, example_inputs)


def nice_name(placeholder: str) -> str:
    """Dynamo's name for a graph input, as the module path: l_self_modules_blocks_modules_0_
    modules_attn_modules_q_parameters_weight_ -> blocks.0.attn.q.weight; l_x_ -> x."""
    name = re.sub(r"^[lL]_(self_)?(modules_)?", "", placeholder).rstrip("_")
    return name.replace("_modules_", ".").replace("_parameters_", ".").replace("_buffers_", ".")


def named_breaks(counters) -> list[dict]:
    """Each graph break and each skipped frame in dynamo's counters, once: what it was (the first
    line of dynamo's message, and its Explanation line), the reason it names ("skipping FSDP hooks"), and, where dynamo
    could not resume after it, what then ("graph break in loop") and which frame it gave up on
    (that frame runs eagerly). Dynamo books a skip twice, the break and then the skip: merged."""
    found: dict[tuple, dict] = {}
    for kind, book in (("break", counters["graph_break"]), ("skipped frame", counters["unimplemented"])):
        for message, times in book.items():
            reason = re.search(r"'reason': ConstantVariable\(str: '([^']*)'\)", message)
            skipped = re.search(r"frame skipped: (\w+) \((.+?) line (\d+)\)", message)
            what = message.splitlines()[0].strip()
            explained = re.search(r"Explanation: (.+)", message)
            entry = found.setdefault((kind, what, reason[1] if reason else None), {
                "kind": kind, "what": what, "explanation": explained[1].strip() if explained else None,
                "reason": reason[1] if reason else None, "then": None, "skipped": None})
            if skipped:
                entry["then"] = "graph break in loop" if "graph break in loop" in message else "frame skipped"
                entry["skipped"] = f"{skipped[1]} ({skipped[2].rsplit('/', 1)[-1]} line {skipped[3]})"
    return list(found.values())


def described(b: dict) -> str:
    """A break in one line: 'Call to `torch._dynamo.disable()` (reason 'skipping FSDP hooks'),
    then 'graph break in loop': dynamo gave up on forward (transformer.py line 119)'."""
    return (f"{b['what']}" + (f" (reason {b['reason']!r})" if b["reason"] else f": {b['explanation']}")
            + (f", then {b['then']!r}: dynamo gave up on {b['skipped']}, which runs eagerly" if b["skipped"] else ""))


def recompile_reasons() -> list[str]:
    """Why a compiled frame was compiled again, per failed guard: "tensor 'x' size mismatch
    at index 0. expected 24, actual 16", "GLOBAL_STATE changed: grad_mode"."""
    from torch._dynamo.utils import guard_failures

    return [re.sub(r"^\d+/\d+: ", "", reason) for reasons in guard_failures.values() for reason in reasons]


def new_shape(model: torch.nn.Module, tokens: torch.Tensor, rows: tuple[int, ...], mark: bool) -> dict:
    """Compile `model` whole (backend "eager": whether to recompile is dynamo's decision, not
    the backend's) and call it on the first rows[i] rows of `tokens`, in turn: a shorter last
    batch, say. mark=True first marks dimension 0 of the first input dynamic
    (torch._dynamo.mark_dynamic): one graph for every batch size. {graphs, recompiles, reasons}."""
    torch._dynamo.reset()  # no graph from before: only this model's compiles count
    backend = Counted("eager")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i, n in enumerate(rows):
            x = tokens[:n].clone()
            if mark and i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            compiled(x)
    reasons = recompile_reasons()
    torch._dynamo.reset()
    return {"graphs": len(backend.graphs), "recompiles": len(reasons), "reasons": reasons}
