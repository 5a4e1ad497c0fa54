"""Check exercise 13: each block's MLP checkpointed, the attention's activations kept.

The learner's forward_mlp_checkpointed runs on the recipe's transformer and first batch,
beside model(x) and whole-block checkpointing (lesson 13's forward_checkpointed), each
measured with apparatus.memory.SavedTensors as the lesson measures it.
"""
from __future__ import annotations

from pathlib import Path

STARTER = "exercises/13_checkpoint_mlp.py"


def _lesson_13():
    from common import lesson_module
    return lesson_module("13")


def _measure(forward) -> tuple:
    """(bytes saved for backward, the loss, every parameter's gradient) of forward(model, x)
    on the recipe's transformer and first batch, measured as lesson 13 measures it."""
    import torch

    from apparatus.memory import SavedTensors
    from common import transformer as T

    torch.set_num_threads(1)
    model = T.make_model(0)
    x, y = T.batch(0)
    with SavedTensors(model) as saved:
        loss = T.loss_fn(forward(model, x), y)
    loss.backward()
    return saved.bytes, loss.detach(), [p.grad.clone() for p in model.parameters()]


def _mine(module) -> dict:
    """In the answer's process: the learner's forward, measured."""
    from check_exercise import NotYet

    if not hasattr(module, "forward_mlp_checkpointed"):
        raise NotYet(f"{module.__file__} has no function forward_mlp_checkpointed(model, x)")
    try:
        saved, loss, grads = _measure(module.forward_mlp_checkpointed)
    except Exception as exc:
        raise NotYet(f"forward_mlp_checkpointed failed: {type(exc).__name__}: {exc}")
    return {"saved": int(saved), "loss": loss, "grads": grads}


def check(path: Path) -> str:
    """Checkpoint only the MLP of every block: less saved, same loss and gradients."""
    import torch

    from apparatus.memory import mib
    from check_exercise import NotYet, answer
    from common import transformer as T

    got = answer(path, _mine)  # the learner's forward, in its own process; the others here
    mine, my_loss, my_grads = got["saved"], got["loss"], got["grads"]
    plain, loss, grads = _measure(lambda model, x: model(x))
    whole, _, _ = _measure(lambda model, x: _lesson_13().forward_checkpointed(model, x))
    if my_loss.shape != loss.shape or not torch.allclose(my_loss, loss, rtol=0, atol=1e-6):
        raise NotYet(f"the loss is {my_loss.item():.6f}, model(x) gives {loss.item():.6f}: "
                     f"checkpointing must not change what is computed")
    names = [name for name, _ in T.make_model(0).named_parameters()]
    for name, g, mine_g in zip(names, grads, my_grads, strict=True):
        if not torch.allclose(g, mine_g, rtol=1e-5, atol=1e-6):
            raise NotYet(f"the gradient of {name} differs from model(x)'s")
    x, _ = T.batch(0)
    hidden = 2 * T.N_BLOCKS * x.numel() * T.MLP_DIM * 4  # fc's output and GELU's, fp32
    if plain - mine < hidden:
        raise NotYet(f"it saves {mib(mine)} for backward, model(x) {mib(plain)}: the MLPs' hidden "
                     f"activations ({mib(hidden)}) are still saved. Which call should checkpoint wrap?")
    if mine <= 2 * whole:
        raise NotYet(f"it saves only {mib(mine)}, about what whole-block checkpointing saves "
                     f"({mib(whole)}): checkpoint the MLP only, and let the attention keep its activations")
    return (f"{mib(plain)} saved plain -> {mib(mine)} with the MLPs checkpointed "
            f"({mib(whole)} with whole blocks); same loss and gradients")
