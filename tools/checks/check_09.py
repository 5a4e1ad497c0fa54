"""Check exercise 09: strip the `module.` prefix, and only the prefix.

The learner's strip_prefix(state_dict, prefix) gets a real DDP checkpoint (lesson 09's
TinyNet, whose parts are themselves called `submodule` and `module`, wrapped in DDP on one
rank) and must make it load strictly into the plain model; then four more state_dicts
(already plain, torch.compile's `_orig_mod.` prefix, and both) must keep every other key.
"""
from __future__ import annotations

from pathlib import Path

# check_exercise is imported where it is used (see check_14.py: a top-level import is circular)
STARTER = "exercises/09_strip_prefix.py"


def _plain(got, what: str) -> dict:
    """In the answer's process: the learner's state_dict as {str key: tensor}, or NotYet."""
    import torch

    from check_exercise import NotYet

    if got is None:
        raise NotYet("strip_prefix returned None; return the new state_dict")
    if not hasattr(got, "items"):
        raise NotYet(f"strip_prefix on {what} returned a {type(got).__name__}; return the new state_dict")
    out = {}
    for k, v in got.items():
        if not isinstance(v, torch.Tensor):
            raise NotYet(f"strip_prefix on {what} turned the value of {k!r} into a {type(v).__name__}; "
                         f"keep every tensor with its key")
        out[str(k)] = v.detach().clone()
    return out


def _rank_09(rank: int, world: int, path: str) -> dict:
    """Save a DDP model whose parts are called `module` and `submodule` and strip the keys with
    the learner's function (the check loads them into the plain model itself)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Lesson 09's own model (Step 7): keys stem.submodule.*, block.module.*, head.*
    from checkpoint_keys import TinyNet
    from check_exercise import load

    module = load(Path(path))
    torch.manual_seed(0)
    ddp_model = DDP(TinyNet())
    saved = ddp_model.state_dict()  # the file a DDP job writes: module.stem.submodule.weight, ...
    keys = list(saved)
    stripped = _plain(module.strip_prefix(saved, "module."), "DDP(TinyNet()).state_dict()")
    del ddp_model
    return {"saved": keys, "stripped": stripped}


def _cases():
    import torch

    w = [torch.full((2,), float(i)) for i in range(4)]
    return [
        ("an already plain checkpoint (nothing to strip)", "module.",
         {"stem.submodule.weight": w[0], "block.module.bias": w[1]},
         {"stem.submodule.weight": w[0], "block.module.bias": w[1]}),
        ("torch.compile's prefix", "_orig_mod.",
         {"_orig_mod.block.module.weight": w[0], "_orig_mod.head._orig_mod_x": w[1]},
         {"block.module.weight": w[0], "head._orig_mod_x": w[1]}),
        ("a model with parts called `decoder` and `module`", "module.",
         {"module.decoder.weight": w[0], "module.module.bias": w[1]},
         {"decoder.weight": w[0], "module.bias": w[1]}),
        ("DDP around torch.compile, one layer at a time", "module.",
         {"module._orig_mod.fc1.weight": w[2], "module._orig_mod.module.bias": w[3]},
         {"_orig_mod.fc1.weight": w[2], "_orig_mod.module.bias": w[3]}),
    ]


def _answers(module) -> dict:
    """In the answer's process: the DDP checkpoint stripped (one rank), then the four cases."""
    from check_exercise import NotYet, run_world, where

    [ddp] = run_world(1, _rank_09, (module.__file__,), Path(module.__file__))
    got = []
    for what, prefix, given, _ in _cases():  # the wanted dicts stay with the check
        try:
            got.append(_plain(module.strip_prefix(dict(given), prefix), what))
        except NotYet:
            raise
        except Exception as exc:
            raise NotYet(f"strip_prefix on {what} raised {type(exc).__name__}: "
                         f"{exc}{where(exc, module.__file__)}")
    return {"ddp": ddp, "cases": got}


def check(path: Path) -> str:
    """Only the prefix is stripped: a real DDP checkpoint loads strictly into the plain model."""
    import torch

    from checkpoint_keys import TinyNet
    from check_exercise import WORLD_TIMEOUT_S, NotYet, answer, listed, one_line

    got = answer(path, _answers, limit_s=WORLD_TIMEOUT_S + 30)
    ddp, stripped = got["ddp"], got["ddp"]["stripped"]
    torch.manual_seed(0)
    trained = TinyNet()  # the weights the answer's rank saved (the same seed)
    torch.manual_seed(1)
    plain = TinyNet()  # other initial weights: loading must overwrite every one of them
    wanted = list(plain.state_dict())
    try:
        plain.load_state_dict(stripped, strict=True)
        error = ""
    except RuntimeError as exc:
        error = one_line(str(exc)).rstrip(".")
    if error:
        wrong = [f"{a} -> {b}" for a, b in zip(ddp["saved"], stripped) if b not in wanted]
        missing = [k for k in wanted if k not in stripped]
        raise NotYet(f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load strictly "
                     f"into a plain TinyNet: your function turned {listed(wrong, 2)}, and the "
                     f"model misses {listed(missing, 4)}. Which part of each key belongs to "
                     f"the wrapper? (lesson 09, Step 7)" if wrong or missing else
                     f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load into a "
                     f"plain TinyNet: {error[:300]}")
    diff = max((plain.state_dict()[k] - v).abs().max().item() for k, v in trained.state_dict().items())
    if diff != 0:
        raise NotYet(f"the stripped state_dict loads, but the weights differ from the saved "
                     f"model's by {diff:.1e}: keep every tensor with its own key")
    for (what, prefix, given, wanted), got_case in zip(_cases(), got["cases"], strict=True):
        if list(got_case) != list(wanted):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: keys {list(given)} became "
                         f"{list(got_case)}; expected {list(wanted)}")
        if any(not torch.equal(got_case[k], v) for k, v in wanted.items()):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: the keys are right but some "
                         f"tensors changed; keep every tensor with its key")
    return (f"a DDP checkpoint with `module` and `submodule` parts loads strictly after "
            f"stripping; plain keys stay as they are, and compile's prefix works too")
