"""Exercise 06: ask the environment who you are.

torchrun starts this file once per worker, on every node, and tells each worker its place
in the job through environment variables (lesson 06, Step 1). Right now `who_am_i` ignores
them and answers as if it were alone, so every worker claims to be rank 0 on node 0.

Your task: return the real values, read from the environment torchrun sets. Under plain
`python` (no torchrun) the answer should stay a world of one: rank 0, local rank 0,
world size 1, node 0.

Check it:  make check-06   (starts 2 simulated nodes x 2 workers and asks each of them)
"""
import json
import os
import sys


def who_am_i() -> dict:
    return {"rank": 0, "local_rank": 0, "world_size": 1, "node": 0}


if __name__ == "__main__":
    # Each worker reports itself as one JSON line; the check collects them.
    sys.stdout.write(json.dumps({**who_am_i(), "pid": os.getpid()}) + "\n")  # one write per line
