"""The shared code behind the lessons: the bottom layer, which imports nothing of ours but
itself. The first five are what a learner meets; each is short enough to read in one sitting:

    cli.py          flags every lesson shares, one-line errors instead of tracebacks
    device.py       --device auto|cpu|cuda and the matching backend (nccl / gloo)
    distributed.py  the rendezvous store on loopback, process groups with a timeout,
                    starting N ranks (spawn; run_ranks, in a gloo group, for the checks,
                    bench/ and the tests) and a clean teardown
    recipe.py       Part 1's recipe (lesson 01): data, model, optimizer, sample order,
                    and its one world-size rule
    transformer.py  Part 2's recipe (lesson 13): a small transformer, its data, its
                    single-process reference and its one world-size rule

and the plumbing beneath them, which every lesson relies on without it being any lesson's idea:

    processes.py    start_ranks, the one way ranks are started (forked from a fork server,
                    rank 0 given the terminal for --step), and nobody outliving the job
    datasets.py     MNIST / CIFAR-10 files read without running code (recipe.py's --dataset)

Each helper first appears *inline* in the lesson that teaches it; later lessons call it so
they can focus on their own idea. One layer up, apparatus/ holds the output and the
instruments (step mode, metrics files, collective and memory counters); code that serves one
lesson lives in that lesson's folder, lessons/NN_topic/.
"""
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent

# Importing torch._dynamo (DDP, FSDP2, DTensor and the pipelines import it; start_ranks
# preloads it) makes $TMPDIR/torchinductor_$USER and leaves it there (torch 2.14.1,
# torch/_inductor/runtime/cache_dir_utils.py). No lesson compiles anything: keep that folder
# in runs/, which `make clean` removes, unless you chose one. Every process of a lesson
# imports common first, and its children inherit the variable.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.access(ROOT, os.W_OK):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(ROOT / "runs" / ".torchinductor")
# torch.profiler's C++ half (kineto) writes to stderr at every start and stop of a trace
# ("USDT: ... profiler_start", and without CUDA "gpuGetDeviceCount failed with code 35"):
# lines about the profiler itself, not the job (lesson 20, check-20). Level 6 keeps them
# out; set KINETO_LOG_LEVEL=0 to see them. Read when a trace starts, so set here is in time.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C before a lesson's main() runs (importing torch takes seconds): the line
    common.cli.run prints for a Ctrl-C later, not a KeyboardInterrupt traceback."""
    sys.stderr.write("\ninterrupted (Ctrl-C): nothing was saved for this run\n")
    sys.stderr.flush()
    os._exit(130)


# A lesson imports common before torch: from here on Ctrl-C stops it quietly, until
# common.cli.run gives Python's own handler back to main(). Only in the lesson's own
# process (its script is lessons/NN_*.py: a rank's and the fork server's is `-c`), and
# only where Ctrl-C is not ignored already.
_LESSON_SCRIPT = Path(sys.argv[0] if sys.argv else "").resolve().parent == ROOT / "lessons"
if _LESSON_SCRIPT and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
# No garbage collection while the lesson's script imports torch, until common.cli.run starts
# its main(): the collector's passes over a heap that only grows (no import leaves garbage)
# were a third of the time `import torch` took here (common/fork_server_start.py does the
# same in the fork server). Only where the script runs as __main__: a rank that mp.spawn
# starts runs the lesson's file under another name (its __main__ is `-c`) and never reaches
# run(), so it keeps Python's default.
_main_file = getattr(sys.modules.get("__main__"), "__file__", None)
if _LESSON_SCRIPT and _main_file and Path(_main_file).resolve() == Path(sys.argv[0]).resolve():
    import gc

    gc.disable()


def lesson_module(number: str):
    """Lesson NN's file as a module, for the tools, bench/, the exercises and the tests that
    use what a lesson defines (lesson 15's ShardedOptimizer, lesson 10's ring). A lesson's
    name starts with digits, so `import` cannot name it; its main() does not run (every
    lesson guards it with `if __name__ == "__main__"`). Loaded once per process."""
    import importlib.util

    name = f"lesson_{number}"
    if name not in sys.modules:
        path = next((ROOT / "lessons").glob(f"{number}_*.py"), None)
        if path is None:
            raise ImportError(f"there is no lessons/{number}_*.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: a class it defines may be pickled by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state_dicts with the same keys: how every
    lesson compares its weights with its baseline's."""
    if a.keys() != b.keys():
        raise KeyError(f"different keys: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit: for mistakes the learner can fix."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)
