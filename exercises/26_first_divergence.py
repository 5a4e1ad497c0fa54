"""Exercise 26: a layout with a hidden bug: find where it starts, and name it.

SEED picks one of lesson 26's layouts and hides a mistake in it (your teacher may give each of
you another SEED). The mistake is of a kind lesson 26 injects, but it may sit in another
layer, norm or rank than the lesson's --bug puts it. Use the oracle:

1. Record it:  .venv/bin/python exercises/26_first_divergence.py
   (2 ranks, one step of lesson 13's recipe in one process and under the layout, each beside
   its float64 twin: runs/exercise-26/reference.pt and parallel.pt; it names the layout only)
2. Compare:    .venv/bin/python tools/parity.py runs/exercise-26/reference.pt runs/exercise-26/parallel.pt
3. Fill in MODULE and PASS: where the difference first leaves its floor. Then BUG: which of
   lesson 26's --bug names makes that mistake (the pass, the module and |B| / |A| tell you).

Check it:  make check-26   (it runs the same hidden bug itself, with its own oracle, and
                            compares what it finds with your three names)
"""
SEED = 0
MODULE = ""  # as the oracle names it: "blocks.0.attn.q"; for a gradient, its module ("head" for head.bias)
PASS = ""    # "forward" or "backward"
BUG = ""     # one of lesson 26's: "grad-sum", "data-shift", "tp-bias", "sp-norm", "cp-positions"


if __name__ == "__main__":  # step 1: record the hidden run (the check reads only the names above)
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), *(str(root / "lessons" / name) for name in
                                 ("26_parity_oracle", "17_tensor_parallel", "21_context_parallel"))]
    import parity_layouts

    out = root / "runs" / "exercise-26"
    layout = parity_layouts.record_hidden(SEED, out)
    print(f"SEED {SEED}: the {layout} layout, with a hidden bug; recorded one step in "
          f"{out.relative_to(root)}/reference.pt and parallel.pt. Now:\n"
          f"  .venv/bin/python tools/parity.py {out.relative_to(root)}/reference.pt {out.relative_to(root)}/parallel.pt")
