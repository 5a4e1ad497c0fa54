"""Exercise 09: strip a wrapper's prefix from checkpoint keys, and only the prefix.

A checkpoint saved from `DDP(model).state_dict()` names every tensor `module.<name>`, and
a plain model refuses it. `strip_prefix` should give back the keys the plain model
expects. As written it uses `k.replace(prefix, "")`, which looks right on lesson 05's MLP
(`module.fc1.weight` -> `fc1.weight`) and breaks any model whose own parts are called
`module` or `submodule`: a residual block that keeps its layer in `self.module` is common.

Your task: remove `prefix` from the *start* of every key that starts with it, and leave
every other key as it is (so that stripping a checkpoint that has no prefix changes
nothing). Return a new dict with the same tensors.
Hint: lesson 09, Step 7 (and the table it prints; the code is strip_by_hand in lessons/09_checkpoint_keys/checkpoint_keys.py).

Check it:  make check-09   (saves a real DDP model with such parts, in a world of one,
                            strips it with your function and loads it strictly)
"""


def strip_prefix(state_dict: dict, prefix: str) -> dict:
    """`state_dict` with `prefix` taken off the front of its keys."""
    return {k.replace(prefix, ""): v for k, v in state_dict.items()}


if __name__ == "__main__":
    keys = {"module.stem.submodule.weight": 0, "module.block.module.bias": 1,
            "module.head.weight": 2}
    for old, new in zip(keys, strip_prefix(keys, "module.")):
        print(f"{old:32} -> {new}")
