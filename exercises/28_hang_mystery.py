"""Exercise 28: a job hangs. Name the rank, the call and the line, from the evidence alone.

1. Hang it:   make lesson-28 ARGS="--hang mystery"
   (your teacher may give you another seed: make lesson-28 ARGS="--hang mystery --seed 7";
   then set SEED below to the same number, and WORLD_SIZE if you pass --world-size)
   One of lesson 28's hangs, on one rank, at one step. The job ends by itself in seconds and
   prints every rank's evidence, but no verdict: the recorders side by side (Step 5), the
   check-ins (Step 6), the stacks (Step 7). The files are in runs/lesson-28/: fr_rank_N.json,
   check_in_rank_N.json, stack_rank_N.txt, pyspy_rank_N.txt (where py-spy is installed) and
   log_rank_N.txt.
2. Fill in RANK, OPERATION and WHERE below, as docs/28_hang_lab.md's Step 8 reads them.

Check it:  make check-28   (it works out which hang SEED planted, and compares)
"""
SEED = 0          # the --seed you ran with (0 unless you passed one)
WORLD_SIZE = 3    # the --world-size you ran with (3 unless you passed one)

RANK = None       # the culprit: 0, 1, 2, ...
OPERATION = ""    # the call that went wrong: a collective ("all_reduce", "broadcast", "all_gather"),
                  # "send" or "recv", or, for a rank stuck outside any collective, the Python call
                  # its stack shows it waiting in
WHERE = ""        # that call's file:line as the evidence prints it, e.g. "lessons/28_hang_lab.py:123";
                  # for a call the culprit left out or never reached: the line where the others wait
