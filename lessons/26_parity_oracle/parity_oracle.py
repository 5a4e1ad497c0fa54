"""Lesson 26's parity oracle: record two runs of the same training, compare them entry by entry
in the order they happened, and say whether each difference is rounding or where the first
real one starts. Written for any model: lesson 26 and tools/parity.py use it, and so can you.

    shapes = whole_shapes(model_on_meta, x_on_meta)  # each output's and gradient's whole shape
    recorder = Recorder(model, shapes, about="...")   # a hook on every module
    with recorder.forward(step):                      # this forward's outputs are recorded
        loss = loss_fn(model(x), y)
    loss.backward()                                   # ... and whatever syncs the gradients
    recorder.gradients(step)                          # every parameter's gradient, as it is now
    recorder.collect()                                # the pieces made whole (N ranks: collectives)
    recording = recorder.recording                    # on rank 0: what save() writes

    measure_rounding(recording, twin)  # per entry: max |x - x_float64|, the same run in float64
    rows = compare(a, b)               # per entry of a, in a's order: difference, floor, ratio
    first = first_divergence(rows)     # the first row whose ratio is above LIMIT, or None
    save(recording, path); load(path)  # the file format below

A recording is plain data, written with torch.save and read with torch.load(weights_only=True),
so a file can hold tensors, strings and numbers but never code:

    {"format": "parity-recording/1",
     "about": "what ran: the model, the layout, the dtype",
     "names": ["1/forward/tok_emb", ..., "1/backward/head.bias", ...],   # in the order they happened
     "values": {name: tensor},           # each whole, as one process would hold it
     "rounding": {name: float}}          # optional: max |value - value in float64| (measure_rounding)

A name is "step/pass/module" for a module's forward output and "step/pass/parameter" for a
parameter's gradient; steps count from 1. Backward lists the gradients last parameter first,
roughly the order autograd produces them.

The floor. Two float32 runs of the same mathematics never agree bit for bit once they sum in
another order; the question is only whether they differ by more than rounding. Run each of them
again in float64 (its "twin": same weights, same data, every op in float64), and for each
entry take r = max |x32 - x64|: how far float32 rounding alone carried that run. Then, for
every element, |a32 - b32| <= |a32 - a64| + |a64 - b64| + |b64 - b32| (the triangle
inequality), and if both runs compute the same mathematics, a64 and b64 agree to about 1e-16.
So max |a32 - b32| <= r_a + r_b, up to float64's rounding: the ratio difference / floor
stays at or below 1 for a correct run, whatever the layout did to the order of the sums, and a
bug, which changes the mathematics, moves the float64 twins apart as much as the float32 runs.
Where both runs computed an entry exactly (an embedding lookup at step 1: r_a = r_b = 0), the
floor would be 0; one float32 rounding step of the entry's largest value, 2**-23 x max |a|
(torch.finfo(torch.float32).eps times it), is added to every floor: far above float64's
rounding, which is all that can separate two exact runs, and far below any bug.
"""
from __future__ import annotations

import math
import os
import stat
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "parity-recording/1"
ULP = 2.0 ** -23  # float32's spacing at 1.0: one rounding step, relative (torch.finfo(torch.float32).eps)
LIMIT = 1.0       # a ratio above this is not rounding (the floor is a proven bound, see above)


def new_recording(about: str = "") -> dict:
    return {"format": FORMAT, "about": about, "names": [], "values": {}, "rounding": {}}


# --- recording ---------------------------------------------------------------------------

def whole_shapes(model: torch.nn.Module, *inputs) -> dict[str, tuple]:
    """{"forward/<module>": shape of its output, "backward/<parameter>": shape of it} for one
    forward of `model` on `inputs`, whole: a one-process model, built on the meta device (no
    memory, no arithmetic) with the whole batch. Recorder uses them to put pieces together."""
    shapes = {}

    def seen(name, module, args, out):
        if isinstance(out, torch.Tensor):
            shapes.setdefault(f"forward/{name}", tuple(out.shape))
    hooks = [module.register_forward_hook(partial(seen, name)) for name, module in model.named_modules() if name]
    with torch.no_grad():
        model(*inputs)
    for hook in hooks:
        hook.remove()
    shapes.update({f"backward/{name}": tuple(p.shape) for name, p in model.named_parameters()})
    return shapes


def whole(piece: torch.Tensor, shape: tuple | None) -> torch.Tensor:
    """A rank's piece of a tensor made whole, on every rank. A DTensor gathers itself
    (full_tensor); a plain tensor smaller than `shape` along one dimension is that dimension's
    slice of rank r (data parallel: rows; tensor parallel: heads or units; sequence and
    context parallel: tokens): all_gather, joined in rank order. The same shape: already whole
    on every rank (a replicated tensor), this rank's copy is kept. Every rank must call it for
    the same entries in the same order: the decision depends on shapes only."""
    if hasattr(piece, "full_tensor"):
        piece = piece.full_tensor()
    if shape is None or tuple(piece.shape) == tuple(shape):
        return piece
    world = dist.get_world_size() if dist.is_initialized() else 1
    cut = [d for d in range(piece.dim()) if piece.shape[d] != shape[d]]
    if len(cut) != 1 or piece.shape[cut[0]] * world != shape[cut[0]]:
        raise ValueError(f"a piece of shape {tuple(piece.shape)} is not 1/{world} of {tuple(shape)} along one dimension")
    parts = [torch.empty_like(piece) for _ in range(world)]
    dist.all_gather(parts, piece.contiguous())
    return torch.cat(parts, cut[0])


class Recorder:
    """Hooks that record every module's forward output and, when asked, every parameter's
    gradient; collect() makes the pieces whole and adds them to self.recording, in the order
    they happened. On N ranks, every rank records and collects (the gathers are collectives);
    rank 0 keeps the recording. One process: shapes may be {} and nothing is gathered."""

    def __init__(self, model: torch.nn.Module, shapes: dict | None = None, about: str = ""):
        self.model, self.shapes = model, shapes or {}
        self.recording = new_recording(about)
        self.keep = not dist.is_initialized() or dist.get_rank() == 0
        self._step, self._pieces = None, []
        self._hooks = [module.register_forward_hook(partial(self._output, name))
                       for name, module in model.named_modules() if name]  # the root's output is its last module's

    def _output(self, name, module, args, output):
        if self._step is not None and isinstance(output, torch.Tensor):
            self._add(f"{self._step}/forward/{name}", output)

    def _add(self, key: str, tensor: torch.Tensor) -> None:
        taken = {k for k, _ in self._pieces}
        n, unique = 1, key
        while unique in taken or unique in self.recording["values"]:  # a module called twice
            n += 1
            unique = f"{key}#{n}"
        self._pieces.append((unique, tensor.detach().clone()))

    @contextmanager
    def forward(self, step: int):
        """Record the outputs of the forward run inside this block as step `step`."""
        self._step = step
        try:
            yield
        finally:
            self._step = None

    def gradients(self, step: int) -> None:
        """Record every parameter's .grad as it is now: call it after the gradients are synced
        (DDP's backward, FSDP's reduce-scatter, your all-reduce), before optimizer.step()."""
        for name, p in reversed(list(self.model.named_parameters())):
            if p.grad is not None:
                self._add(f"{step}/backward/{name}", p.grad)

    def collect(self) -> None:
        """Make every recorded piece whole (see whole()) and keep it, on rank 0, in float32 or
        the dtype it ran in, on the CPU."""
        for key, piece in self._pieces:
            step, kind, name = key.split("/", 2)
            full = whole(piece, self.shapes.get(f"{kind}/{name.split('#')[0]}"))
            if self.keep:
                self.recording["names"].append(key)
                self.recording["values"][key] = full.detach().cpu()
        self._pieces = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def measure_rounding(recording: dict, twin: dict) -> None:
    """recording["rounding"][name] = max |value - twin's value|: how far float32 rounding
    carried this run from the same run in float64 (its twin), entry by entry."""
    for key in recording["names"]:
        if key in recording["rounding"]:  # measured at an earlier step
            continue
        if key not in twin["values"]:
            raise KeyError(f"the float64 twin has no {key}: record the same steps of the same model")
        a, b = recording["values"][key].double(), twin["values"][key].double()
        recording["rounding"][key] = (a - b).abs().max().item() if a.numel() else 0.0


def join_chunks(recording: dict, shapes: dict) -> dict:
    """A recording of steps run in chunks of the batch (each module called once per chunk:
    name, name#2, ...) with each module's chunks joined back into the whole batch, along the
    dimension where a chunk is smaller than its whole shape (`shapes`, from whole_shapes); a
    chunk already whole (the position embedding's output) is kept once."""
    joined, parts = new_recording(recording["about"]), {}
    for key in recording["names"]:
        parts.setdefault(key.split("#")[0], []).append(recording["values"][key])
    for key, pieces in parts.items():
        _, kind, name = split_key(key)
        shape = shapes.get(f"{kind}/{name}", tuple(pieces[0].shape))
        cut = [d for d in range(pieces[0].dim()) if pieces[0].shape[d] != shape[d]]
        joined["names"].append(key)
        joined["values"][key] = torch.cat(pieces, cut[0]) if cut else pieces[0]
    return joined


def with_floor_from(recording: dict, other: dict) -> dict:
    """`recording` whose rounding, entry by entry, is max |recording - other| instead: the
    floor lessons 14-24 use for weights when `other` is lesson 13 summing its batch in N chunks."""
    rounding = {k: (recording["values"][k].double() - other["values"][k].double()).abs().max().item()
                for k in recording["names"]}
    return {**recording, "rounding": rounding}


# --- comparing ---------------------------------------------------------------------------

def split_key(key: str) -> tuple[int, str, str]:
    step, kind, name = key.split("/", 2)
    return int(step), kind, name


def compare_entry(key: str, a: dict, b: dict) -> dict:
    """One row: the largest |a - b| of entry `key`, its floor and their ratio, and |b| / |a|."""
    step, kind, name = split_key(key)
    row = {"key": key, "step": step, "pass": kind, "name": name, "diff": math.inf,
           "floor": 0.0, "ratio": math.inf, "norm_ratio": math.nan, "note": ""}
    if key not in b["values"]:
        return {**row, "note": "missing in B"}
    x, y = a["values"][key].double(), b["values"][key].double()
    if x.shape != y.shape:
        return {**row, "note": f"shape {tuple(x.shape)} in A, {tuple(y.shape)} in B"}
    if x.numel() == 0:
        return {**row, "diff": 0.0, "ratio": 0.0}
    diff = (x - y).abs().max().item()
    floor = a["rounding"].get(key, 0.0) + b["rounding"].get(key, 0.0) + ULP * x.abs().max().item()
    if not math.isfinite(diff):
        ratio = math.inf  # a nan or an inf is never rounding
    elif diff == 0:
        ratio = 0.0
    else:
        ratio = diff / floor if floor > 0 else math.inf
    size = x.norm().item()
    return {**row, "diff": diff, "floor": floor, "ratio": ratio,
            "norm_ratio": y.norm().item() / size if size > 0 else math.nan}


def compare(a: dict, b: dict, keys: list[str] | None = None) -> list[dict]:
    """compare_entry for every entry of A (or `keys`), in A's order."""
    return [compare_entry(key, a, b) for key in (a["names"] if keys is None else keys)]


def first_divergence(rows: list[dict], limit: float = LIMIT) -> dict | None:
    """The first row, in order, whose difference is more than `limit` times its floor."""
    return next((row for row in rows if not row["ratio"] <= limit), None)


def module_of(row: dict) -> str:
    """The module a row belongs to: itself for a forward output, its owner for a gradient."""
    return row["name"].split("#")[0].rsplit(".", 1)[0] if row["pass"] == "backward" else row["name"].split("#")[0]


def number(x: float) -> float | None:
    """x for a JSON file: inf and nan (a missing entry, a nan in a run) become null."""
    return x if math.isfinite(x) else None


def divergence_metrics(row: dict | None) -> dict | None:
    """metrics.json's first_divergence: null, or where and by how much."""
    if row is None:
        return None
    return {"step": row["step"], "module": module_of(row), "pass": row["pass"], "tensor": row["name"],
            "ratio": number(row["ratio"]), "difference": number(row["diff"]), "floor": row["floor"],
            "norm_ratio": number(row["norm_ratio"]), "note": row["note"]}


def max_abs_diff64(a: dict, b: dict) -> float:
    """The largest |a - b| over two dicts of tensors with the same keys, in float64 (a float64
    twin cast to float32 first would lose the digits we compare)."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def by_step(rows: list[dict]) -> dict[int, dict]:
    """{step: the row with the largest ratio of that step}."""
    worst: dict[int, dict] = {}
    for row in rows:
        if row["step"] not in worst or not row["ratio"] <= worst[row["step"]]["ratio"]:
            worst[row["step"]] = row
    return worst


# --- saying it ---------------------------------------------------------------------------

def times(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2g}x" if x < 100 else f"{x:.1e}x"


def where(row: dict) -> str:
    return f"step {row['step']}, {row['pass']}, {row['name']}"


def step_line(step: int, rows: list[dict], limit: float = LIMIT) -> str:
    """'step 1: 64 entries, largest |difference| 4.8e-07; largest ratio to its floor 0.41 (at
    ...): within rounding' for the rows of one step."""
    mine = [row for row in rows if row["step"] == step]
    worst = by_step(mine)[step]
    top = max(row["diff"] for row in mine)
    verdict = "within rounding" if worst["ratio"] <= limit else "NOT rounding"
    return (f"step {step}: {len(mine)} entries, largest |difference| {top:.1e}; largest ratio to "
            f"its floor {times(worst['ratio'])} ({worst['pass']}, {worst['name']}): {verdict}")


def verdict_line(rows: list[dict], limit: float = LIMIT) -> str:
    """'within rounding everywhere: ...' or where the first difference leaves its floor."""
    first = first_divergence(rows, limit)
    if first is None:
        worst = max(rows, key=lambda row: row["ratio"])
        steps = len(by_step(rows))
        return (f"within rounding everywhere: {len(rows)} entries in {steps} step{'s' if steps > 1 else ''}, "
                f"the largest ratio {times(worst['ratio'])} ({where(worst)})")
    how = f" ({first['note']})" if first["note"] else (
        f": |difference| {first['diff']:.1e} is {times(first['ratio'])} its floor {first['floor']:.1e}; "
        f"|B| / |A| = {first['norm_ratio']:.3f}")
    return f"first divergence: {where(first)} (module {module_of(first)}){how}"


COLUMNS = ["step", "pass", "entry", "max |A - B|", "floor", "ratio", "|B| / |A|"]


def table_rows(rows: list[dict], limit: float = LIMIT, before: int = 4) -> list[list[str]]:
    """The rows up to the first divergence (the last `before` of them, then it), or the
    `before` + 1 largest ratios when there is none: what the lesson and the tool print."""
    first = first_divergence(rows, limit)
    if first is None:
        shown = sorted(rows, key=lambda row: -row["ratio"])[:before + 1]
    else:
        at = rows.index(first)
        shown = rows[max(0, at - before):at + 1]
    return [[str(r["step"]), r["pass"], r["name"], f"{r['diff']:.1e}", f"{r['floor']:.1e}",
             times(r["ratio"]), f"{r['norm_ratio']:.3f}"] for r in shown]


# --- the file --------------------------------------------------------------------------------

def save(recording: dict, path: Path) -> None:
    """torch.save of the plain recording, written whole or not at all."""
    from apparatus.results import atomic_write

    atomic_write(Path(path), lambda f: torch.save(recording, f))


def load(path: Path) -> dict:
    """A recording from `path`, read with weights_only=True (tensors, strings and numbers:
    never code). ValueError with one line saying what is wrong otherwise."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror.lower()}") from None
    if not stat.S_ISREG(mode):  # a FIFO or a device would make torch.load wait or read forever
        raise ValueError(f"{path} is not a regular file")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle refusing a class, a truncated zip, not a torch file at all
        raise ValueError(f"{path} is not a recording: torch.load(weights_only=True) cannot read it "
                         f"({type(exc).__name__}; a recording holds tensors, strings and numbers only)") from None
    ok = (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("names"), list)
          and isinstance(data.get("values"), dict) and isinstance(data.get("rounding", {}), dict)
          and all(isinstance(k, str) and isinstance(data["values"].get(k), torch.Tensor) for k in data["names"])
          and all(isinstance(v, float) for v in data.get("rounding", {}).values()))
    if not ok:
        raise ValueError(f"{path} is not a {FORMAT} file (a dict with format, names, values and rounding)")
    data.setdefault("rounding", {})
    data.setdefault("about", "")
    return data
