"""Check a learner's exercise: `make check-NN [FILE=path]`.

Every check runs the learner's code for real and prints either "ok: ..." (exit 0) or what
is still wrong and a hint (exit 1). Each check is a file of its own beside this one,
tools/checks/check_NN.py, that defines STARTER (the exercise's path, in exercises/) and
check(path), and shares this small harness: NotYet, load, run_world (the learner's code on
several ranks), and the messages' helpers where, listed and max_diff.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the lessons' own folders (lessons/NN_topic/), for their helpers: `import pipeline`
sys.path[1:1] = [str(d) for d in sorted((ROOT / "lessons").glob("[0-9][0-9]_*/")) if d.name != "12_pitfalls"]

from common.cli import fail  # noqa: E402

if __name__ == "__main__":  # so that `from check_exercise import NotYet` finds this very module
    sys.modules.setdefault("check_exercise", sys.modules[__name__])


class NotYet(Exception):
    """The learner's answer is not right yet; the message says why."""


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise NotYet(f"{path} does not run: {type(exc).__name__}: {exc}")
    return module


def where(exc_or_frames, learner: str) -> str:
    """' (your_file.py, line 12)' for the deepest frame of the learner's file, if any: from an
    exception, or from the (file, line) frames a rank sent back (RankFailed.frames)."""
    import traceback
    frames = exc_or_frames
    if isinstance(exc_or_frames, BaseException):
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc_or_frames.__traceback__)]
    lines = [line for file, line in frames if file == learner]
    return f" ({Path(learner).name}, line {lines[-1]})" if lines else ""


def listed(values, limit: int = 6) -> str:
    values = list(values)
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def max_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over two state_dicts."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


# ---------------------------------------------------------------------------------------
# Running a learner's code on several ranks: common/distributed.py's run_ranks (each rank a
# fresh process in a gloo group on a free port, with a timeout on the group and on the whole
# run), its failures told as the learner needs them.
# ---------------------------------------------------------------------------------------

GROUP_TIMEOUT_S = 20   # every collective and point-to-point message gives up after this
WORLD_TIMEOUT_S = 120  # a whole run of ranks, start-up included (torch imports take a while)


def run_world(world: int, target, args: tuple, learner: Path) -> list:
    """target(rank, world, *args) on `world` new processes in a gloo group: the results by rank.

    Raises NotYet with the first rank's error, or when the ranks do not finish in time.
    """
    from common.distributed import RankFailed, run_ranks

    try:
        return run_ranks(target, world, args, timeout_s=WORLD_TIMEOUT_S,
                         group_timeout_s=GROUP_TIMEOUT_S)
    except RankFailed as failed:
        if failed.kind == "timeout":
            raise NotYet(f"the {world} ranks did not finish within {WORLD_TIMEOUT_S}s: "
                         f"does a rank wait for a message that never comes?") from None
        if failed.kind == "died":
            raise NotYet(f"with {world} ranks, rank {failed.rank} died (exit code "
                         f"{failed.code}) without an error message") from None
        if failed.error == "NotYet":  # the check's own verdict, raised inside a rank
            raise NotYet(failed.text) from None
        text = " ".join(failed.text.split())
        text = text if len(text) < 300 else text[:300] + " ..."
        at = where(failed.frames, str(learner))
        if "Timed out" in text:  # gloo: "Timed out waiting 20000ms for recv operation ..."
            raise NotYet(f"with {world} ranks, rank {failed.rank} waited {GROUP_TIMEOUT_S}s for "
                         f"a message that never came{at}: do all ranks make the same calls, "
                         f"and does every receive have a matching send?") from None
        raise NotYet(f"with {world} ranks, rank {failed.rank} raised {failed.error}: "
                     f"{text}{at}") from None


CHECKS_DIR = Path(__file__).resolve().parent / "checks"
sys.path.insert(0, str(CHECKS_DIR))
CHECKS: dict = {}


def all_checks() -> dict:
    """{NN: (STARTER, check)}, one entry per tools/checks/check_NN.py. Found on first use, not
    at import, so that a check file may itself import this harness at its top."""
    for file in sorted(CHECKS_DIR.glob("check_[0-9][0-9].py")):
        if file.stem[-2:] not in CHECKS:
            module = importlib.import_module(file.stem)
            CHECKS[file.stem[-2:]] = (module.STARTER, module.check)
    return CHECKS


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("Checked exercises (make check-NN [FILE=path]):")
        for n, (starter, fn) in sorted(all_checks().items()):
            print(f"  make check-{n}   {starter}: {(fn.__doc__ or '(no description)').strip().splitlines()[0]}")
        return
    number = argv[0].zfill(2)
    if number not in all_checks():
        fail(f"lesson {number} has no checked exercise; these do: {' '.join(sorted(CHECKS))}")
    starter, check = CHECKS[number]
    path = Path(argv[1]) if len(argv) > 1 and argv[1] else ROOT / starter
    if not path.exists():
        fail(f"{path} not found; give the learner's file as FILE=path")
    try:
        message = check(path.resolve())
    except NotYet as exc:
        print(f"not yet: {exc}")
        raise SystemExit(1)
    except subprocess.TimeoutExpired:
        print("not yet: the exercise did not finish in time (does something wait forever?)")
        raise SystemExit(1)
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM or SIGHUP while ranks run
        from common.processes import signal_name
        name, code = signal_name(exc)
        fail(f"interrupted ({name}): the check was stopped, and every rank it had started",
             code=code)
    print(f"ok: {message}")


if __name__ == "__main__":
    main(sys.argv[1:])
