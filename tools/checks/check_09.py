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


def _rank_09(rank: int, world: int, path: str) -> dict:
    """Save a DDP model whose parts are called `module` and `submodule`, strip the keys with
    the learner's function, and load them strictly into the plain model."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Lesson 09's own model (Step 7): keys stem.submodule.*, block.module.*, head.*
    from checkpoint_keys import TinyNet
    from check_exercise import NotYet, load

    module = load(Path(path))
    torch.manual_seed(0)
    trained = TinyNet()
    ddp_model = DDP(trained)
    saved = ddp_model.state_dict()  # the file a DDP job writes: module.stem.submodule.weight, ...
    stripped = module.strip_prefix(saved, "module.")
    if stripped is None:
        raise NotYet("strip_prefix returned None; return the new state_dict")
    torch.manual_seed(1)
    plain = TinyNet()  # other initial weights: loading must overwrite every one of them
    result = {"saved": list(saved), "stripped": [str(k) for k in stripped],
              "wanted": list(plain.state_dict())}
    try:
        plain.load_state_dict(stripped, strict=True)
        result["error"] = ""
        result["max_diff"] = max((plain.state_dict()[k] - v).abs().max().item()
                                 for k, v in trained.state_dict().items())
    except RuntimeError as exc:
        result["error"] = " ".join(str(exc).split()).rstrip(".")
    del ddp_model
    return result


def check(path: Path) -> str:
    """Only the prefix is stripped: a real DDP checkpoint loads strictly into the plain model."""
    import torch

    from check_exercise import NotYet, listed, load, run_world, where

    module = load(path)
    [ddp] = run_world(1, _rank_09, (str(path),), path)
    if ddp["error"]:
        wrong = [f"{a} -> {b}" for a, b in zip(ddp["saved"], ddp["stripped"])
                 if b not in ddp["wanted"]]
        missing = [k for k in ddp["wanted"] if k not in ddp["stripped"]]
        raise NotYet(f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load strictly "
                     f"into a plain TinyNet: your function turned {listed(wrong, 2)}, and the "
                     f"model misses {listed(missing, 4)}. Which part of each key belongs to "
                     f"the wrapper? (lesson 09, Step 7)" if wrong or missing else
                     f"DDP(TinyNet()).state_dict(), stripped of 'module.', does not load into a "
                     f"plain TinyNet: {ddp['error'][:300]}")
    if ddp["max_diff"] != 0:
        raise NotYet(f"the stripped state_dict loads, but the weights differ from the saved "
                     f"model's by {ddp['max_diff']:.1e}: keep every tensor with its own key")
    w = [torch.full((2,), float(i)) for i in range(4)]
    cases = [
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
    for what, prefix, given, wanted in cases:
        before = dict(given)
        try:
            got = module.strip_prefix(given, prefix)
        except Exception as exc:
            raise NotYet(f"strip_prefix on {what} raised {type(exc).__name__}: "
                         f"{exc}{where(exc, str(path))}")
        if got is None:
            raise NotYet("strip_prefix returned None; return the new state_dict")
        if list(got) != list(wanted):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: keys {list(before)} became "
                         f"{list(got)}; expected {list(wanted)}")
        if any(got[k] is not v and not torch.equal(got[k], v) for k, v in wanted.items()):
            raise NotYet(f"strip_prefix(..., {prefix!r}) on {what}: the keys are right but some "
                         f"tensors changed; keep every tensor with its key")
    return (f"a DDP checkpoint with `module` and `submodule` parts loads strictly after "
            f"stripping; plain keys stay as they are, and compile's prefix works too")
