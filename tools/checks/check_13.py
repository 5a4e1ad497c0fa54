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


def check(path: Path) -> str:
    """Checkpoint only the MLP of every block: less saved, same loss and gradients."""
    import torch

    from apparatus.memory import SavedTensors, mib
    from check_exercise import NotYet, load
    from common import transformer as T

    module = load(path)
    if not hasattr(module, "forward_mlp_checkpointed"):
        raise NotYet(f"{path} has no function forward_mlp_checkpointed(model, x)")
    torch.set_num_threads(1)
    model = T.make_model(0)
    x, y = T.batch(0)

    def measure(forward):
        model.zero_grad(set_to_none=True)
        with SavedTensors(model) as saved:
            loss = T.loss_fn(forward(x), y)
        loss.backward()
        return saved.bytes, loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain, loss, grads = measure(model)
    whole, _, _ = measure(lambda t: _lesson_13().forward_checkpointed(model, t))
    try:
        mine, my_loss, my_grads = measure(lambda t: module.forward_mlp_checkpointed(model, t))
    except Exception as exc:
        raise NotYet(f"forward_mlp_checkpointed failed: {type(exc).__name__}: {exc}")
    if my_loss.shape != loss.shape or not torch.allclose(my_loss, loss, rtol=0, atol=1e-6):
        raise NotYet(f"the loss is {my_loss.item():.6f}, model(x) gives {loss.item():.6f}: "
                     f"checkpointing must not change what is computed")
    for (name, _), g, mine_g in zip(model.named_parameters(), grads, my_grads):
        if not torch.allclose(g, mine_g, rtol=1e-5, atol=1e-6):
            raise NotYet(f"the gradient of {name} differs from model(x)'s")
    hidden = 2 * T.N_BLOCKS * x.numel() * T.MLP_DIM * 4  # fc's output and GELU's, fp32
    if plain - mine < hidden:
        raise NotYet(f"it saves {mib(mine)} for backward, model(x) {mib(plain)}: the MLPs' hidden "
                     f"activations ({mib(hidden)}) are still saved. Which call should checkpoint wrap?")
    if mine <= 2 * whole:
        raise NotYet(f"it saves only {mib(mine)}, about what whole-block checkpointing saves "
                     f"({mib(whole)}): checkpoint the MLP only, and let the attention keep its activations")
    return (f"{mib(plain)} saved plain -> {mib(mine)} with the MLPs checkpointed "
            f"({mib(whole)} with whole blocks); same loss and gradients")
