"""Exercise 27, solved for SEED 0: .venv/bin/python exercises/27_mystery_bug.py printed no
divergence from the oracle, but a caught-by line for the state-dict round trip: initial_lr
0.01 when saved, missing after dcp.load, a KeyError when the schedule was resumed where it was,
and after the resume a learning rate five times below the uninterrupted schedule's."""
SEED = 0
BUG = "dcp-initial-lr"
