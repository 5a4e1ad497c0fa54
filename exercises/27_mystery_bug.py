"""Exercise 27: a bug from the zoo, unnamed: which one is it?

SEED picks one of lesson 27's six bugs (your teacher may give each of you another SEED). The
lesson re-creates it, measures its symptom against the baseline and catches it, without saying
which bug, which layout or which mistake it is:

1. Run it:  .venv/bin/python exercises/27_mystery_bug.py
   (the same as make lesson-27 ARGS="--bug mystery --seed SEED --out runs/exercise-27", with
   this file's SEED; about 20 seconds on 2 cores)
2. Read Steps 2 and 3 as an engineer reads a bug report: how far the weights and the loss end
   from the baseline, what the run's own checks found (the ranks' copies of the weights, the
   stages' norms, the learning rate...), and where lesson 26's oracle finds the first
   difference above its floor (step, pass, module, |B| / |A|), if the oracle is what catches it.
3. Fill in BUG: the zoo's name for it (docs/27_bug_zoo.md, Steps 2 and 3, say what each one
   looks like).

Check it:  make check-27   (it draws the same bug from SEED and compares it with your BUG)
"""
SEED = 0
BUG = ""  # one of lesson 27's: "gloo-avg", "late-sync-flag", "tp-same-seed", "hsdp-seed", "pipeline-clip", "dcp-initial-lr"


if __name__ == "__main__":  # step 1: run the mystery with this file's SEED (the check reads only the names above)
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.exit(subprocess.call([sys.executable, str(root / "lessons" / "27_bug_zoo.py"), "--bug", "mystery",
                              "--seed", str(SEED), "--out", str(root / "runs" / "exercise-27")]))
