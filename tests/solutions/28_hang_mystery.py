"""Exercise 28, solved for SEED 0 on 3 ranks: `make lesson-28 ARGS="--hang mystery"` showed rank 1
behind at collective #42 in the recorders, never checking in at the monitored barrier (rank 0:
"Ranks 1 failed to pass monitoredBarrier"), and its stack waiting in queue.py's get, called from
the lesson's train loop: alive, stuck in Python before a collective."""
SEED = 0
WORLD_SIZE = 3

RANK = 1
OPERATION = "Queue.get"
WHERE = "lessons/28_hang_lab.py:216"
