"""Lesson 16: distributed checkpoints, run as a learner would, and attacked as testers did.

Three lesson runs are shared by the file:
* "stopped": 2 ranks stop after step 3 of 6 and leave a DCP checkpoint (`ckpt`);
* "seven": a --seed 7 run on 2 ranks saves a whole checkpoint of its own (`seven`), then is
  killed in the middle of its asynchronous save, into a folder that held a copy of `ckpt`
  (rank 1 is SIGKILLed by a hook after it wrote 3 pieces of its shard: the job's script is
  the lesson behind that hook, written below): that copy must come through byte for byte,
  nothing left beside it;
* "resumed": 3 ranks resume from `ckpt` (DCP reshards 2 -> 3) and must end with the
  uninterrupted run's weights (lesson 13's reference, within 1e-3).
Everything else is refused in the launcher before any rank starts, so it is checked
in-process: one line, exit 2, nothing changed. Crafted pickles (a `.metadata` or a shard
whose __reduce__ calls eval) must never run: each writes a marker file if it does.
"""
import builtins
import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common import transformer as T
from apparatus.state_dicts import load_into
from conftest import (ROOT, import_lesson, lesson_path, load_run, make_lesson, max_abs_diff,
                      one_error_line, parse_error, run, run_lesson)

STEPS, STOP = 6, 3

# The "seven" job's script: lesson 16 itself, with a hook that SIGKILLs rank 1 while it writes
# the asynchronous checkpoint, after its third piece, mid-shard. The ranks import the job's
# script (as __mp_main__), so the hook is in them too. A script, not a sitecustomize on
# PYTHONPATH (as before): a changed PYTHONPATH needs a new Python, and a new fork server,
# about 11 CPU s; `python script.py` is forked from the tests' zygote (tests/zygote.py).
KILLED_LESSON = '''"""Lesson 16 with rank {rank} SIGKILLed after the 3rd piece it writes of the asynchronous checkpoint."""
import os
import signal

import torch.distributed.checkpoint.filesystem as fs

_write_item, _written = fs._write_item, []


def _write_then_die(transforms, stream, *args, **kwargs):
    result = _write_item(transforms, stream, *args, **kwargs)
    if os.environ.get("RANK") == "{rank}" and "checkpoint-async" in str(getattr(stream, "name", "")):
        _written.append(1)
        if len(_written) == 3:
            stream.flush()  # three pieces on disk, the rest never
            os.kill(os.getpid(), signal.SIGKILL)
    return result


fs._write_item = _write_then_die

# The lesson's code runs here, as this module's (its __doc__, its worker), with the lesson's
# own __file__ while it runs (its sys.path lines); then ours again, so that the ranks import
# this file and not the lesson.
_source = open({lesson!r}).read()
_guard = 'if __name__ == "__main__":\\n    run(main)\\n'
assert _source.endswith(_guard), "lesson 16 no longer ends with its usual guard"
_ours, __file__ = __file__, {lesson!r}
exec(compile(_source[:-len(_guard)], {lesson!r}, "exec"))
__file__ = _ours
if __name__ == "__main__":
    run(main)
'''


@pytest.fixture(scope="module")
def reference():
    return T.train_reference(T.SEED, STEPS)  # computed (or read) once, before the ranks need it


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference):
    base = tmp_path_factory.mktemp("lesson16")
    ckpt = base / "ckpt"
    stopped = make_lesson("16", "--device", "cpu", "--world-size", 2, "--steps", STEPS,
                          "--stop-at-step", STOP, "--checkpoint", ckpt, "--out", base / "stopped",
                          timeout=240)
    saved = _bytes(ckpt)
    killed = base / "lesson16_rank1_killed.py"
    killed.write_text(KILLED_LESSON.format(rank=1, lesson=str(lesson_path("16"))))
    shutil.copytree(ckpt, base / "seven-out" / "checkpoint-async")  # the earlier checkpoint there
    seven = run([sys.executable, killed, "--device", "cpu", "--world-size", 2, "--steps", STEPS,
                 "--seed", 7, "--checkpoint", base / "seven", "--out", base / "seven-out"],
                timeout=240, check=False)
    resumed = run_lesson("16", "--device", "cpu", "--world-size", 3, "--steps", STEPS,
                         "--resume", ckpt, "--checkpoint", base / "ckpt3", "--out", base / "resumed",
                         timeout=240, check=False)
    return {"base": base, "ckpt": ckpt, "saved": saved, "stopped": stopped.stdout, "seven": seven,
            "resumed": resumed}


def test_stopped_run_leaves_one_shard_per_rank_and_no_results(runs):
    names = sorted(runs["saved"])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.json"], names
    out = runs["stopped"]
    for name, data in runs["saved"].items():  # the lesson lists each file with its size
        assert name in out and f"{len(data):,}" in out
    assert not (runs["base"] / "stopped" / "final.pt").exists()
    assert f"--resume {runs['ckpt']}" in out and "Step 7" not in out  # saved, and exited
    manifest = json.loads(runs["saved"]["checkpoint.json"])
    assert (manifest["seed"], manifest["step"], manifest["world_size"], manifest["strategy"]) == (
        T.SEED, STOP, 2, "fsdp")
    for name, data in runs["saved"].items():  # written last: every other file's digest
        if name != "checkpoint.json":
            assert manifest["files"][name] == {"bytes": len(data),
                                               "sha256": hashlib.sha256(data).hexdigest()}
    assert "checkpoint.json, written last: --seed 0, fsdp, step 3 on 2 ranks" in out
    assert sorted(p.name for p in runs["base"].iterdir() if p.name.startswith("ckpt.")) == []


def test_resumed_at_three_ranks_ends_with_the_uninterrupted_weights(runs, reference):
    proc = runs["resumed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    state, metrics = load_run(runs["base"] / "resumed")
    diff = max_abs_diff(state, reference["state"])
    assert diff <= 1e-3 and metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff)
    assert metrics["world_size"] == 3 and metrics["start_step"] == STOP
    # the losses of steps 4-6, beside the uninterrupted run's, printed and kept
    ref = reference["losses"][STOP:].tolist()
    assert metrics["losses"] == pytest.approx(ref, abs=1e-4)
    assert metrics["reference_losses"] == pytest.approx(ref, abs=1e-12)
    assert not {"memory_bytes", "per_rank_bytes", "activations_bf16_bytes"} & set(metrics)  # lessons 13, 15's
    out = proc.stdout
    assert "resumed after step 3 on 3 ranks" in out and "AdamW's step counter" in out
    assert ": 3" in out.split("AdamW's step counter")[1].splitlines()[0]  # restored, not 0
    for loss in ref:
        assert f"{loss:.6f}" in out
    for folder in (runs["base"] / "ckpt3", runs["base"] / "resumed" / "checkpoint-async"):
        assert sorted(p.name for p in folder.iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "checkpoint.json"]
    assert "returned a Future" in out


def test_every_rank_reports_its_peak_and_the_root_stays_gathered(runs, reference):
    """Issue 23: metrics.json's peak_memory_bytes (rank 0) and peak_memory_bytes_all, torch's
    FSDPMemTracker around the last step, at least what each rank holds at rest (its shards of
    the weights, gradients and AdamW state, under 16 bytes per parameter on 3 ranks). And
    the resharding flag reaches the blocks only: the root, at FSDP2's default, is not
    resharded after forward (its group has no post-forward mesh), so it is gathered once."""
    proc = runs["resumed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, metrics = load_run(runs["base"] / "resumed")
    peaks, at_rest = metrics["peak_memory_bytes_all"], metrics["at_rest_bytes_all"]
    full = 16 * sum(t.numel() for t in reference["state"].values())
    assert len(peaks) == len(at_rest) == 3 and metrics["peak_memory_bytes"] == peaks[0]
    assert metrics["peak_memory_step"] == STEPS  # the last step this run trained
    for peak, rest in zip(peaks, at_rest):
        assert type(peak) is int and peak > rest > 0 and rest < full / 2
    assert metrics["resharded_after_forward"] == {"root": False, "blocks.0": True, "blocks.1": True}
    out = proc.stdout
    assert f"Peak of training step {STEPS}, per rank (torch's FSDPMemTracker)" in out
    assert all(f"{n:,}" in out for n in peaks + at_rest)
    assert "resharded (gathered again in backward): blocks.0, blocks.1; kept gathered for backward: root" in out
    # the stopped run prints its peak too (its step 3), for each of its 2 ranks
    assert f"Peak of training step {STOP}, per rank" in runs["stopped"]


def test_converted_checkpoint_loads_into_a_plain_model(runs):
    state, _ = load_run(runs["base"] / "resumed")
    converted = torch.load(runs["base"] / "resumed" / "from-dcp.pt", weights_only=True)
    assert set(converted) == {"model", "optim", "step"} and int(converted["step"]) == STEPS
    model = T.make_model(seed=1)
    load_into(model, converted["model"])
    assert max_abs_diff(model.state_dict(), state) == 0.0
    assert "max |w - final| = 0.0e+00" in runs["resumed"].stdout


# --- item 2: a save killed half way leaves the earlier checkpoint whole ------------------------

def test_a_rank_killed_during_a_save_leaves_the_earlier_checkpoint_whole(runs):
    """Rank 1 SIGKILLed while it writes the asynchronous checkpoint (Step 7) into a folder
    holding an earlier checkpoint: DCP writes in place, so that used to cut the old shard
    short beside the old .metadata. Saved beside and renamed, the old one stays, byte for
    byte (and resumes: it is `ckpt`, which the 3-rank run resumed), and nothing is left."""
    proc, base = runs["seven"], runs["base"]
    assert proc.returncode == 1 and "rank 1 died (SIGKILL)" in one_error_line(proc), proc.stderr[-2000:]
    assert "Step 7" in proc.stdout  # killed in the asynchronous save, after Step 6's
    assert _bytes(base / "seven-out" / "checkpoint-async") == runs["saved"]
    assert sorted(p.name for p in (base / "seven-out").iterdir()) == [
        ".checkpoint-async.lock", ".lock", "checkpoint-async"]  # no .saving, no .old
    assert json.loads((base / "seven" / "checkpoint.json").read_text())["seed"] == 7


def test_a_failed_save_leaves_the_earlier_checkpoint_and_no_temporary(runs, tmp_path, monkeypatch):
    """A full disk in the middle of dcp.save (one process, a world of 1): one line naming the
    folder and the reason, the earlier checkpoint as it was, no `.saving` folder left."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    checkpointing = import_lesson("16").checkpointing
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full_disk)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(checkpointing.CheckpointError) as info:
            with checkpointing.save_beside(folder, SimpleNamespace(seed=0, strategy="fsdp"), 4) as beside:
                dcp.save({"w": torch.ones(3)}, checkpoint_id=beside)
    finally:
        dist.destroy_process_group()
    assert f"could not save {folder} (No space left on device)" in str(info.value)
    assert _bytes(folder) == runs["saved"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_kill_between_the_two_renames_is_undone_at_the_next_start(runs, tmp_path):
    """Killed after the earlier checkpoint was moved aside and before the new one came in:
    the next job that claims the folder puts the earlier one back and removes the rest."""
    checkpointing = import_lesson("16").checkpointing
    shutil.copytree(runs["ckpt"], tmp_path / "ckpt.old")
    (tmp_path / "ckpt.saving").mkdir()
    (tmp_path / "ckpt.saving" / "__0_0.distcp").write_bytes(b"cut short")
    checkpointing.claim_folder(tmp_path / "ckpt", "--checkpoint")
    assert _bytes(tmp_path / "ckpt") == runs["saved"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]


def test_checkpoint_goes_into_out_unless_named(tmp_path, monkeypatch):
    lesson = import_lesson("16")
    monkeypatch.setattr(sys, "argv", ["16", "--out", str(tmp_path)])
    assert lesson.parse_args().checkpoint == tmp_path / "checkpoint"  # two --out, two checkpoints


# --- item 1: a crafted .metadata runs no code --------------------------------------------------

class _Eval:
    """Unpickles as eval(code): what an attacker puts in a pickle."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (builtins.eval, (self.code,))


def _crafted_metadata(folder, marker):
    """Replace .metadata with a pickle that writes `marker`, then returns the real metadata
    (so that the old lesson resumed normally after running it)."""
    real = (folder / ".metadata").read_bytes()
    code = (f"(__import__('pathlib').Path({str(marker)!r}).write_text('ran'), "
            f"__import__('pickle').loads({real!r}))[1]")
    (folder / ".metadata").write_bytes(pickle.dumps(_Eval(code)))


def _reseal(folder):
    """Rewrite checkpoint.json's sizes and digests, as an attacker who edits the files can."""
    if not (folder / "checkpoint.json").exists():  # a checkpoint of the old lesson: none to fix
        return
    manifest = json.loads((folder / "checkpoint.json").read_text())
    manifest["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(folder.iterdir()) if p.name != "checkpoint.json"}
    (folder / "checkpoint.json").write_text(json.dumps(manifest))


def refusal(flags, tmp_path, monkeypatch, capsys) -> str:
    """The launcher's start in-process (flags, then claim: --checkpoint and --resume checked
    before any rank starts); its one error line."""
    lesson = import_lesson("16")
    monkeypatch.setattr(sys, "argv", ["16", "--steps", str(STEPS), "--checkpoint", str(tmp_path / "new"),
                                      "--out", str(tmp_path / "out"), *map(str, flags)])
    with pytest.raises(SystemExit) as info:
        args = lesson.parse_args()
        lesson.checkpointing.claim(args, lesson.out_dir("16", args.out))
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    return lines[0]


def test_crafted_metadata_is_refused_from_the_command_line_and_runs_nothing(runs, tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    shutil.copytree(runs["ckpt"], folder)
    _crafted_metadata(folder, marker)
    _reseal(folder)  # the digests agree: only the allow-list stands in the way
    proc = run_lesson("16", "--device", "cpu", "--world-size", 1, "--steps", STEPS, "--resume", folder,
                      "--checkpoint", tmp_path / "new", "--out", tmp_path / "out", check=False, timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 2 and f"--resume {folder}: its .metadata names builtins.eval" in line, line
    assert "not one of DCP's metadata classes" in line
    assert not marker.exists() and "Step 1" not in proc.stdout


@pytest.mark.parametrize("resealed", [False, True])
def test_crafted_metadata_is_refused_in_the_launcher(runs, tmp_path, monkeypatch, capsys, resealed):
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    shutil.copytree(runs["ckpt"], folder)
    _crafted_metadata(folder, marker)
    if resealed:
        _reseal(folder)
    line = refusal(["--resume", folder], tmp_path, monkeypatch, capsys)
    expected = "its .metadata names builtins.eval" if resealed else "checkpoint.json lists (not the file that was saved)"
    assert expected in line, line
    assert not marker.exists()


def test_step_8_checks_the_checkpoint_before_dcp_to_torch_save(runs, tmp_path):
    """dcp_to_torch_save (Step 8) reads .metadata with DCP's plain reader, which unpickles it
    as it is: the lesson first checks every file against checkpoint.json and .metadata
    against the allow-list (checkpointing.verify), so a crafted one is refused, not run."""
    checkpointing = import_lesson("16").checkpointing
    checkpointing.verify(runs["ckpt"], "--checkpoint ckpt")  # the run's own checkpoint passes
    marker, folder = tmp_path / "ran", tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    _crafted_metadata(folder, marker)
    with pytest.raises(checkpointing.CheckpointError, match="not the file that was saved"):
        checkpointing.verify(folder, "--checkpoint ckpt")
    _reseal(folder)
    with pytest.raises(checkpointing.CheckpointError, match=r"its \.metadata names builtins\.eval"):
        checkpointing.verify(folder, "--checkpoint ckpt")
    assert not marker.exists()


def test_each_rank_reads_metadata_and_shards_through_the_checks(runs, tmp_path):
    """What each rank hands dcp.load (a file may change after the launcher's check): the
    crafted .metadata refused by the allow-list, a crafted shard by weights_only, each in
    one sentence naming the file, and neither runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    checkpointing = import_lesson("16").checkpointing
    marker = tmp_path / "ran"
    meta = tmp_path / "meta"
    shutil.copytree(runs["ckpt"], meta)
    _crafted_metadata(meta, marker)
    _reseal(meta)
    with pytest.raises(checkpointing.CheckpointError, match=r"its \.metadata names builtins\.eval"):
        checkpointing.Reader(meta).read_metadata()

    shard = tmp_path / "shard"  # the piece holding "step" now points to a crafted torch.save
    shutil.copytree(runs["ckpt"], shard)
    metadata = pickle.loads(runs["saved"][".metadata"])  # our own file: trusted
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "step")
    crafted = io.BytesIO()
    torch.save(_Eval(f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')"), crafted)
    info.offset, info.length = (shard / info.relative_path).stat().st_size, len(crafted.getvalue())
    with open(shard / info.relative_path, "ab") as f:
        f.write(crafted.getvalue())
    (shard / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(shard)
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as exc:
        warnings.simplefilter("ignore")
        dcp.load({"step": torch.tensor(0)}, storage_reader=checkpointing.Reader(shard), no_dist=True)
    last = str(exc.value).strip().splitlines()[-1]
    assert f"the shard {info.relative_path} could not be loaded (torch.load with weights_only=True " \
           f"refused it: Unsupported global: GLOBAL eval" in last, last
    assert not marker.exists()


def _step_as_bytes(folder, marker):
    """Issue 35's attack: .metadata marks "step" as bytes (BytesStorageMetadata, which the
    allow-list accepts: the optimizer's param_groups are saved that way), its piece points
    to a torch.save'd __reduce__ payload appended to a shard, and checkpoint.json is resealed.
    DCP's DefaultLoadPlanner.load_bytes reads bytes with torch.load(weights_only=False)
    (torch 2.14.1 default_planner.py:383-393): the payload writes `marker`, then returns 3,
    so that a rank that ran it resumed "normally" after step 3."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted
    index = next(k for k in metadata.storage_data if k.fqn == "step")
    info = metadata.storage_data.pop(index)
    metadata.storage_data[MetadataIndex("step")] = info  # where DCP looks for bytes
    payload = io.BytesIO()
    torch.save(_Eval(f"(__import__('pathlib').Path({str(marker)!r}).write_text('ran'), 3)[1]"), payload)
    info.offset, info.length = (folder / info.relative_path).stat().st_size, len(payload.getvalue())
    with open(folder / info.relative_path, "ab") as f:
        f.write(payload.getvalue())
    metadata.state_dict_metadata["step"] = BytesStorageMetadata()
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(folder)
    return info.relative_path


def test_step_saved_as_bytes_is_refused_and_runs_nothing(runs, tmp_path):
    """The resume, as a learner runs it, on issue 35's crafted checkpoint: one line, non-zero,
    no traceback, no rank started, and the payload never ran (it ran in every rank, and the
    run exited 0, before)."""
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    shutil.copytree(runs["ckpt"], folder)
    _step_as_bytes(folder, marker)
    proc = run_lesson("16", "--device", "cpu", "--world-size", 1, "--steps", STEPS, "--resume", folder,
                      "--checkpoint", tmp_path / "new", "--out", tmp_path / "out", check=False, timeout=120)
    assert not marker.exists(), "the crafted checkpoint's code ran"
    line = one_error_line(proc)
    assert f"--resume {folder}: its .metadata saves step as bytes" in line, line
    assert "Step 1" not in proc.stdout


def test_each_rank_loads_bytes_with_weights_only(runs, tmp_path):
    """What each rank hands dcp.load, if the files change after the launcher's check: the
    planner refuses a tensor saved as bytes, and loads any bytes it does read with
    torch.load(weights_only=True); the payload never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    checkpointing = import_lesson("16").checkpointing
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    shutil.copytree(runs["ckpt"], folder)
    shard = _step_as_bytes(folder, marker)
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as exc:
        warnings.simplefilter("ignore")
        dcp.load({"step": torch.tensor(0)}, storage_reader=checkpointing.Reader(folder),
                 planner=checkpointing.Planner(), no_dist=True)
    assert "its .metadata saves step as bytes" in str(exc.value), str(exc.value)[-2000:]
    assert not marker.exists()
    # bytes where bytes are expected (the optimizer's param_groups) still load, weights_only
    planner = checkpointing.Planner()
    read_item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    planner.flatten_state_dict, planner.state_dict = False, {}
    crafted = io.BytesIO()
    torch.save(_Eval(f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')"), crafted)
    crafted.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(read_item, crafted)  # Reader names the shard and the reason
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save(0.001, plain)
    plain.seek(0)
    planner.load_bytes(read_item, plain)
    assert planner.state_dict == {"optim.param_groups.0.lr": 0.001}
    assert shard.endswith(".distcp")


# --- item 3: the wrong weights, refused --------------------------------------------------------

def test_a_seed_7_checkpoint_is_refused_for_a_seed_0_run(runs, tmp_path, monkeypatch, capsys):
    seven = runs["base"] / "seven"
    line = refusal(["--resume", seven, "--steps", 10], tmp_path, monkeypatch, capsys)
    assert f"--resume {seven} was made with --seed 7; this run has --seed 0: pass --seed 7" in line


@pytest.mark.parametrize("damage", ["one flipped byte", "a shard swapped in from --seed 7"])
def test_a_changed_shard_is_refused(runs, tmp_path, monkeypatch, capsys, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    shard = folder / "__1_0.distcp"
    if damage == "one flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        other = runs["base"] / "seven" / "__1_0.distcp"
        assert other.stat().st_size == shard.stat().st_size  # the same size: only bytes differ
        shutil.copy(other, shard)
    line = refusal(["--resume", folder], tmp_path, monkeypatch, capsys)
    assert "__1_0.distcp is not the file that was saved" in line, line


def test_two_jobs_on_one_checkpoint_the_second_stops_at_once(runs, tmp_path):
    """A second job that would write the same --checkpoint (or the same --out) while the
    first holds it stops before doing anything, with one line naming the first job."""
    # The first job holds the checkpoint's lock (beside it) and --out's, as a lesson run does,
    # until the test opens and closes the fifo `release`. `python script.py`: forked from the
    # tests' zygote (torch, which apparatus.results imports, already there), not a new Python.
    script, held, release = tmp_path / "holder.py", tmp_path / "held", tmp_path / "release"
    script.write_text(
        "import fcntl, os, sys; sys.path.insert(0, sys.argv[5]); from pathlib import Path\n"
        "from apparatus.results import claim_out; claim_out(Path(sys.argv[2]))\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "Path(sys.argv[3] + '.tmp').write_text(str(os.getpid())); os.replace(sys.argv[3] + '.tmp', sys.argv[3])\n"
        "with open(sys.argv[4]) as f: f.read()  # until the test opens and closes the fifo\n")
    os.mkfifo(release)
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(run, [sys.executable, script, tmp_path / ".ckpt.lock", tmp_path / "out", held,
                                   release, ROOT], timeout=120)
        try:
            deadline = time.monotonic() + 100
            while not held.exists() and not holder.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held.exists(), holder.result() if holder.done() else "the holder did not start"
            holder_pid = int(held.read_text())
            for flags, flag in (([tmp_path / "ckpt", "--out", tmp_path / "out2"], "--checkpoint"),
                                ([tmp_path / "ckpt2", "--out", tmp_path / "out"], "--out")):
                start = time.monotonic()
                proc = run_lesson("16", "--device", "cpu", "--checkpoint", *flags, check=False, timeout=60)
                line = one_error_line(proc)
                assert proc.returncode == 2 and f"{flag} {tmp_path}" in line and "is in use by another job" in line
                assert f"(pid {holder_pid})" in line and "Step 1" not in proc.stdout
                assert time.monotonic() - start < 30
        finally:  # opened for writing and closed: the holder reads the end, and exits
            deadline = time.monotonic() + 100
            while not holder.done() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):  # ENXIO: not reading yet, or gone
                    os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
                time.sleep(0.05)
        assert holder.result().returncode == 0  # it held both locks until released


# --- item 4: bad input, one line before any training -------------------------------------------

def test_checkpoint_folder_that_cannot_be_written_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for where, expected in ((afile, "is a file, not a folder"), ("/dev/full", "is a file, not a folder"),
                            ("/sys/ckpt", "cannot be written"),
                            (tmp_path / "mine", "holds files that are not a checkpoint's (notes.txt)")):
        line = refusal(["--checkpoint", where], tmp_path, monkeypatch, capsys)
        assert f"--checkpoint {where}" in line and expected in line, line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_bad_checkpoint_flag_from_the_command_line_stops_before_any_rank(tmp_path):
    proc = run_lesson("16", "--checkpoint", "/dev/full", "--out", tmp_path, check=False, timeout=60)
    assert "--checkpoint /dev/full is a file" in one_error_line(proc) and proc.returncode == 2
    assert proc.stdout == ""  # not even the title: nothing started


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file()}


@pytest.mark.parametrize("damage", ["missing", "truncated", "overwritten", "other model", "no manifest",
                                    "manifest is a folder", "manifest too long", "metadata is a folder",
                                    "a file"])
def test_bad_checkpoint_is_one_line_and_left_as_it_was(runs, tmp_path, monkeypatch, capsys, damage):
    folder = tmp_path / "ckpt"
    if damage == "other model":  # a DCP checkpoint with a manifest that fits, of a Linear
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": torch.nn.Linear(4, 4).state_dict(), "step": torch.tensor(1)},
                     checkpoint_id=folder, no_dist=True)
        checkpointing = import_lesson("16").checkpointing
        checkpointing.write_manifest(folder, {**checkpointing.made_by(SimpleNamespace(seed=0, strategy="fsdp")),
                                              "step": 1, "world_size": 1})
    elif damage == "a file":
        folder.write_text("x")
    else:
        shutil.copytree(runs["ckpt"], folder)
        shard = folder / "__1_0.distcp"
        if damage == "missing":
            shard.unlink()
        elif damage == "truncated":
            shard.write_bytes(runs["saved"]["__1_0.distcp"][:1000])
        elif damage == "overwritten":  # the same length, its first bytes overwritten
            shard.write_bytes(b"x" * 64 + runs["saved"]["__1_0.distcp"][64:])
        elif damage == "no manifest":  # a save that never finished, or a DCP folder from elsewhere
            (folder / "checkpoint.json").unlink()
        elif damage == "manifest too long":  # valid JSON, then 1 MiB of spaces: read no further
            with open(folder / "checkpoint.json", "a") as f:
                f.write(" " * (1 << 20))
        elif damage == "manifest is a folder":
            (folder / "checkpoint.json").unlink()
            (folder / "checkpoint.json").mkdir()
        else:
            (folder / ".metadata").unlink()
            (folder / ".metadata").mkdir()
    before = _digest(folder) if folder.is_dir() else None
    line = refusal(["--resume", folder], tmp_path, monkeypatch, capsys)
    expected = {"missing": "__1_0.distcp is missing", "truncated": "__1_0.distcp is 1,000 bytes, not the 876,445",
                "overwritten": "__1_0.distcp is not the file that was saved",
                "other model": "a checkpoint of another model",
                "no manifest": "has no checkpoint.json, so it is not a finished checkpoint",
                "manifest is a folder": "its checkpoint.json cannot be read (Is a directory)",
                "manifest too long": "its checkpoint.json cannot be read (it has more than 1,048,576 bytes",
                "metadata is a folder": ".metadata is missing", "a file": "is not a folder"}[damage]
    assert expected in line and f"--resume {folder}" in line, line
    if before is not None:
        assert _digest(folder) == before


def test_bad_checkpoint_from_the_command_line_has_no_traceback(runs, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    (folder / "__0_0.distcp").unlink()
    proc = run_lesson("16", "--resume", folder, "--checkpoint", tmp_path / "new", "--out", tmp_path / "out",
                      check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "__0_0.distcp is missing" in proc.stderr


@pytest.mark.parametrize("kind", ["a fifo", "a link to /dev/zero"])
def test_a_manifest_that_is_not_a_file_is_one_line_at_once(runs, tmp_path, kind):
    """checkpoint.json as a FIFO hung the resume (open waits for a writer); as a link to
    /dev/zero it was read until memory ran out. Only a regular file is read, and only up to a
    size no checkpoint.json reaches. A new Python, a time limit and a memory limit (8 GiB of
    address space), so that the code before the fix fails the test, not the machine."""
    import resource
    import subprocess

    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    (folder / "checkpoint.json").unlink()
    if kind == "a fifo":
        os.mkfifo(folder / "checkpoint.json")
    else:
        (folder / "checkpoint.json").symlink_to("/dev/zero")

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    start = time.monotonic()
    proc = subprocess.run([sys.executable, lesson_path("16"), "--resume", folder, "--checkpoint", tmp_path / "new",
                           "--out", tmp_path / "out"], cwd=ROOT, capture_output=True, text=True, timeout=90,
                          stdin=subprocess.DEVNULL, preexec_fn=limit_memory)
    line = one_error_line(proc)
    assert proc.returncode == 2 and f"--resume {folder}: its checkpoint.json cannot be read" in line, line
    assert "not a regular file" in line and time.monotonic() - start < 60


def test_unreadable_resume_folder_is_one_line(runs, tmp_path, monkeypatch, capsys):
    """chmod 000: a PermissionError traceback before. Root reads it anyway (the tests may run
    as root), so there the files of the folder answer stat() as they would anyone else."""
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], folder)
    folder.chmod(0)
    if os.geteuid() == 0:
        real_stat = Path.stat

        def stat(self, **kwargs):
            if self.parent == folder:
                raise PermissionError(13, "Permission denied", str(self))
            return real_stat(self, **kwargs)

        monkeypatch.setattr(Path, "stat", stat)
    try:
        line = refusal(["--resume", folder], tmp_path, monkeypatch, capsys)
    finally:
        folder.chmod(0o755)
    assert f"--resume {folder} cannot be read (Permission denied: checkpoint.json)" in line, line


def test_resume_after_the_stop_step_is_refused_before_any_rank(runs, tmp_path, monkeypatch, capsys):
    line = refusal(["--resume", runs["ckpt"], "--stop-at-step", 2], tmp_path, monkeypatch, capsys)
    assert f"was saved after step {STOP}, so --stop-at-step 2 has passed already" in line, line
    line = refusal(["--resume", runs["ckpt"], "--steps", STOP], tmp_path, monkeypatch, capsys)
    assert f"was saved after step {STOP}; pass --steps above {STOP}" in line, line


def test_stop_at_step_must_come_before_the_end(monkeypatch, capsys):
    line = parse_error(import_lesson("16"), ["--steps", "5", "--stop-at-step", "5"], monkeypatch, capsys)
    assert "--stop-at-step 5" in line


def test_world_size_follows_part_2s_rule(monkeypatch, capsys):
    line = parse_error(import_lesson("16"), ["--world-size", "5"], monkeypatch, capsys)
    assert "--world-size must divide the global batch of 48 rows" in line and "1, 2, 3, 4, 6, 8" in line
