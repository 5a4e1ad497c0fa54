"""Exercise 26, solved for SEED 0: recorded with .venv/bin/python exercises/26_first_divergence.py,
compared with tools/parity.py, whose verdict said: first divergence: step 1, backward,
blocks.0.norm1.bias (module blocks.0.norm1), with |B| / |A| below 1 on the tp layout: a
sequence-parallel LayerNorm whose gradient holds rank 0's tokens only."""
SEED = 0
MODULE = "blocks.0.norm1"
PASS = "backward"
BUG = "sp-norm"
