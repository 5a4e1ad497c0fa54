"""Imported by multiprocessing's fork server only, as its first preload (start_ranks in
common/processes.py): no garbage collection while the server imports torch.

A fork server imports torch and its friends once, then forks every rank from itself. While
Python imports, the cyclic garbage collector runs again and again over a heap that only grows
(no import leaves garbage behind), and those passes were a third of the server's start: on
this project's 2-core machine, `import torch, torch._dynamo` took 2.9-3.6 CPU s with the
collector on and 2.1-2.2 s with it off (2026-12-07). Python's own advice for a process that
forks without exec (the docs of gc.freeze) is the same: gc.disable() early in the parent,
gc.freeze() before forking, collection on again in the children. The server's last preload,
common/fork_server_exit.py, freezes what was imported and turns collection back on.
"""
import gc

gc.disable()
