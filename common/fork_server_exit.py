"""Imported by multiprocessing's fork server only, as its last preload (start_ranks in
common/processes.py): how the server ends when the job that started it is killed, and
collection back on once the imports are done.

Everything imported so far is moved out of the collector's sight (gc.freeze): the server's
first preload, common/fork_server_start.py, switched collection off for the imports, and the
ranks forked from the server never walk torch's millions of objects in their own collections.

The server ends when the job's end of its pipe closes. A job that exits normally stops it
itself (_stop_fork_server) and removes its $TMPDIR/pymp-* folder (the server's socket lives
there). A job killed with SIGKILL does neither, and the server then ended as any Python
does: it ran every exit handler and tore down torch, which took 5-30 s of CPU on 2 busy
cores (measured here with py-spy: gc_collect_main), while the ranks, killed by the kernel
only when their parent (this server) dies, trained on and printed "Broken pipe". So, as
the first exit handler to run (registered last): remove the folder, and end at once.
"""
import atexit
import gc
import os
import shutil

gc.freeze()  # what the preloads imported: kept, never scanned again, here or in a rank
gc.enable()

_FOLDER = os.environ.pop("LESSON_FORK_SERVER_TIDY", None)  # processes.TIDY_ENV
_SERVER = os.getpid()


def _end_now() -> None:
    if os.getpid() != _SERVER:  # a process forked below the server (a rank's own child)
        return
    if _FOLDER:
        shutil.rmtree(_FOLDER, ignore_errors=True)
    os._exit(0)


if _FOLDER:  # only in a server that start_ranks started
    atexit.register(_end_now)
