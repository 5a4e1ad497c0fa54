"""Steps 1 and 2 of lesson 12: a busy port, and a rank that crashes while the others wait.

Their code is lessons/12_pitfalls.py's own Steps 1 and 2 (starting and joining the ranks);
this file holds their paragraphs and runs them on their own (Steps 1, 2 and 10 only):
    .venv/bin/python lessons/12_pitfalls/start.py
    .venv/bin/python lessons/12_pitfalls/start.py --break busy-port
    .venv/bin/python lessons/12_pitfalls/start.py --break rank-crash
The doc is docs/12_pitfalls.md, Steps 1 and 2.
"""
import os
import sys
from pathlib import Path

LESSON = Path(__file__).resolve().parent.parent / "12_pitfalls.py"
if __name__ == "__main__":  # on its own: lesson 12's ranks, Steps 1, 2 and 10 only
    os.execv(sys.executable, [sys.executable, str(LESSON), "--only", Path(__file__).stem,
                              *sys.argv[1:]])

STEPS = {"busy-port": 1, "rank-crash": 2}  # its --break modes, and the step of each

# One paragraph per broken mode: symptom, cause, fix. The doc says the same at more length.
EXPLAIN = {
    "busy-port": (
        "Symptom: rank 0 fails at once with DistNetworkError ... EADDRINUSE, address already in "
        "use, while the other ranks, connected to whatever holds the port, wait for an answer "
        "that never comes (their store timeout does not end that wait: spawn() stops them "
        "when rank 0 exits). Cause: rank 0 hosts the rendezvous store on MASTER_PORT, and "
        "another process (often an earlier run that has not exited) already listens there. "
        "Fix: leave --master-port out (common.distributed.choose_port asks the OS for a free "
        "port), or check the port before starting any rank, as choose_port() does with a "
        "port you give."),
    "rank-crash": (
        "Symptom: one rank raised an exception; the other ranks were waiting for it in a "
        "collective, and the job ended at once with the crashed rank's error. Cause: a rank "
        "died, so its partners can never complete the collective. Fix: read the first "
        "failure (the crashed rank's traceback), not the errors of the ranks that lost a "
        "peer; let the launcher (spawn() here, torchrun later) stop the others, and never "
        "call destroy_process_group() in a finally block after a peer failed: it can block."),
}
