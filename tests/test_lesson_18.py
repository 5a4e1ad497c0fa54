"""Lesson 18: pipeline schedules. One 2-rank run of the lesson (1F1B, the default) and one
4-rank run (zero-bubble, two steps: its pass-through stages), started together through its
launcher, feed most assertions; every schedule is also run for one batch on 4 ranks, its gradients against one
process's. The timeline arithmetic of lessons/18_pipeline_schedules/pipeline.py is checked
against the formulas on its own, and against torch's own plans (schedules built on stub stages:
a constructor needs no process group)."""
import functools
import json
import re
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, make_lesson, max_abs_diff, parse_error, weights_line

from common.distributed import run_ranks

import pipeline as P  # noqa: E402

M = 4  # the lesson's default --microbatches
P4_STEPS = 2  # the 4-rank run is there for its stages and timelines; two AdamW steps still must match
STEPS = 12  # of lesson 13's 120: the same claims, compared with lesson 13 run as long


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both lesson runs at once (threads; each waits on its own processes): the 2-rank default
    and the 4-rank zero-bubble one. {name: (stdout, final state, metrics, folder)}"""
    flags = {"p2": ["--steps", STEPS], "p4": ["--world-size", 4, "--schedule", "zero-bubble", "--steps", P4_STEPS]}
    folders = {name: tmp_path_factory.mktemp(f"lesson18{name}") for name in flags}
    done, failed = {}, {}

    def one(name):
        try:
            proc = make_lesson("18", "--device", "cpu", *flags[name], "--out", folders[name], timeout=300)
            done[name] = (proc.stdout, *load_run(folders[name]), folders[name])
        except BaseException as exc:  # pytest.fail included: re-raised below, in the test's thread
            failed[name] = exc

    threads = [threading.Thread(target=one, args=(name,)) for name in flags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in failed.values():
        raise exc
    return done


@pytest.fixture(scope="module")
def lesson(runs):
    return runs["p2"]


@pytest.fixture(scope="module")
def lesson_p4(runs):
    return runs["p4"][:3]


def test_ends_with_lesson_13s_weights_beside_the_floor(lesson):
    out, state, metrics, _ = lesson
    reference_13 = T.train_reference(steps=STEPS)
    diff = max_abs_diff(state, reference_13["state"])
    floor = max_abs_diff(T.train_reference(steps=STEPS, chunks=M)["state"], reference_13["state"])
    assert diff <= 1e-3, diff
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert metrics["max_abs_diff_floor"] == pytest.approx(floor, abs=1e-12)
    assert weights_line(diff, floor, M) in out
    assert (metrics["world_size"], metrics["backend"], metrics["lesson"]) == (2, "gloo", "18")
    # the loss of a step is the mean of its micro-batches' losses: the whole batch's, as lesson 13's
    assert max(abs(a - b) for a, b in zip(metrics["losses"], reference_13["losses"].tolist())) < 1e-3


def test_final_pt_loads_into_a_plain_model_under_lesson_13s_names(lesson):
    _, state, _, _ = lesson
    model = T.make_model()
    assert list(state) == list(model.state_dict())  # same names, same order
    model.load_state_dict(state)  # strict: nothing missing, nothing extra


def test_four_ranks_zero_bubble_end_with_lesson_13s_weights(lesson_p4):
    out, state, metrics = lesson_p4
    reference = T.train_reference(steps=P4_STEPS)["state"]
    assert max_abs_diff(state, reference) <= 1e-3
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(max_abs_diff(state, reference), abs=1e-12)
    assert (metrics["world_size"], metrics["schedule"]) == (4, "zero-bubble")
    # 8 stages for 4 pieces: every rank holds one piece, some stages hold nothing
    assert "[rank 3] stage 3: nothing (passes its input on); stage 7: norm, head" in out
    assert metrics["bubble_formula"] is None  # zero-bubble: no formula beside it
    s = metrics["schedules"]
    for name in ("gpipe", "1f1b"):  # 4 stages, one piece each: the formula holds
        assert s[name]["bubble_fraction"] == pytest.approx(3 / 7)
        assert s[name]["bubble_formula"] == pytest.approx(3 / 7)
        assert s[name]["pass_through_stages"] == []
    assert s["gpipe"]["peak_inflight_microbatches"] == [M] * 4
    assert s["1f1b"]["peak_inflight_microbatches"] == [4, 3, 2, 1]  # P - stage: at most P
    # The pass-through stages 1, 3, 4, 6 take no time: each rank has one real stage, run in
    # interleaved's order, and waits longer than under 1F1B. Rank 0's 4F and 4B (12 units)
    # span 27 units: (4 x 27 - 4 x 12) / (4 x 27) = 5/9; zero-bubble 23 units: 11/23.
    assert s["interleaved"]["pass_through_stages"] == s["zero-bubble"]["pass_through_stages"] == [1, 3, 4, 6]
    assert s["interleaved"]["bubble_fraction"] == pytest.approx(5 / 9)
    assert s["interleaved"]["bubble_formula"] == pytest.approx(3 / 11)  # shown, and shown not to hold
    assert metrics["bubble_fraction"] == pytest.approx(11 / 23)
    assert s["zero-bubble"]["bubble_fraction"] == pytest.approx(11 / 23)
    assert "│ interleaved │ 55.6%           │ 27.3% = (p-1)/(2m+p-1) │" in out
    assert "stages 1, 3, 4, 6 hold nothing (they pass their input on, in no time)" in out
    assert re.search(r"rank 1 \| \.\.\. \.\.\. \.\.\. \.\.\. 5F0", out)  # stage 1's F0 took no time


def test_metrics_hold_the_schedules_measurements(lesson):
    _, _, metrics, _ = lesson
    assert (metrics["schedule"], metrics["microbatches"]) == ("1f1b", M)
    assert metrics["bubble_formula"] == pytest.approx(1 / (M + 1))
    assert metrics["bubble_fraction"] == pytest.approx(1 / (M + 1))
    assert metrics["peak_inflight_microbatches"] == [2, 1]  # about P, not M
    s = metrics["schedules"]
    assert s["gpipe"]["bubble_fraction"] == pytest.approx(1 / (M + 1)) and s["gpipe"]["peak_inflight_microbatches"] == [M, M]
    # the timeline the lesson drew, kept for the docs' picture (lessons/18_pipeline_schedules/timeline_pictures.py)
    assert s["1f1b"]["timeline"][:3] == [[0, 0, 1, "0F0"], [0, 1, 2, "0F1"], [1, 1, 2, "1F0"]]
    assert len(s["interleaved"]["peak_inflight_microbatches"]) == 4  # two stages per rank
    # Interleaving shrinks the bubble to (p-1)/(v*m+p-1) with v = 2 stages per rank: the
    # formula the table shows, and what torch's own actions gave (the Recorder's)
    assert s["interleaved"]["bubble_fraction"] == pytest.approx(1 / (2 * M + 1))
    assert s["interleaved"]["bubble_formula"] == pytest.approx(1 / (2 * M + 1))
    assert all(s[n]["pass_through_stages"] == [] for n in s)  # 2 ranks: every stage holds a piece
    assert s["zero-bubble"]["bubble_fraction"] < s["interleaved"]["bubble_fraction"]
    json.dumps(metrics)  # plain JSON
    # lesson 13's memory demonstrations stay in lesson 13: none of their numbers is kept here
    assert not {"memory_bytes", "activations_checkpointed_bytes", "checkpointed_losses"} & set(metrics)


def test_prints_every_schedules_timeline_and_the_table(lesson):
    out, _, metrics, folder = lesson
    assert "[rank 0] stage 0: tok_emb, pos_emb, blocks.0" in out
    assert "[rank 1] stage 1: blocks.1, norm, head" in out
    # GPipe: all forwards, then all backwards (2 cells each); 1F1B alternates
    assert "rank 0 | 0F0 0F1 0F2 0F3 ... ... ... 0B0 0B0 0B1 0B1" in out
    assert "rank 1 | ... 1F0 1B0 1B0 1F1 1B1 1B1" in out
    assert re.search(r"rank 1 \| .*3I0.*3W0", out)  # zero-bubble splits the backward in I and W
    for name in ("gpipe", "1f1b", "interleaved", "zero-bubble"):
        assert f"\n{name}: " in out
        png = folder / f"timeline-{name}.png"
        try:
            import matplotlib  # noqa: F401
            assert png.is_file() and png.stat().st_size > 1000
        except ImportError:
            assert not png.exists() and "matplotlib is not installed, so no PNG" in out
    assert "│ 1f1b        │ 20.0%           │ 20.0% = (p-1)/(m+p-1)  │ 2 1" in out
    assert "│ interleaved │ 11.1%           │ 11.1% = (p-1)/(2m+p-1) │ 4 3 2 1" in out
    assert "│ zero-bubble │ 4.0%            │ -                      │" in out
    assert "hold nothing" not in out


def test_docs_picture_is_drawn_from_the_lessons_own_run(lesson, tmp_path):
    """timeline_pictures.py draws docs/img/18_timelines_p2.png from a run's metrics.json; both docs show it."""
    _, _, _, folder = lesson
    pytest.importorskip("matplotlib")
    import timeline_pictures  # lessons/18_pipeline_schedules/ (`--from RUN --to PNG` calls draw)
    png = tmp_path / "timelines.png"
    assert timeline_pictures.draw(folder, png) == f"wrote {png}" and png.stat().st_size > 10_000
    for doc, img in (("docs/18_pipeline_schedules.md", "img"), ("docs/zh/18_pipeline_schedules.md", "../img")):
        text = (ROOT / doc).read_text()
        assert f"]({img}/18_timelines_p2.png)" in text and f"]({img}/18_timelines_p4.png)" in text, doc
        assert "lessons/18_pipeline_schedules/timeline_pictures.py" in text, doc
    for p in (2, 4):
        assert (ROOT / "docs" / "img" / f"18_timelines_p{p}.png").stat().st_size > 10_000


def _grads_of_one_batch(rank: int, world: int) -> dict:
    """Every schedule, one batch: this rank's gradients (under lesson 13's names)."""
    lesson = import_lesson("18")
    model = T.make_model()
    x, y = T.batch(0)
    out = {}
    for name in lesson.SCHEDULES:
        schedule, stages, parts = lesson.build_pipeline(name, model, rank, world, M, torch.device("cpu"))
        losses = []
        with P.Recorder(stages) as rec:
            schedule.step(x, target=y, losses=losses)
        out[name] = {k: p.grad.clone() for part in parts for k, p in part.named_parameters()}
        out[name + " losses"] = torch.stack(losses) if losses else torch.zeros(0)
        out[name + " ran"] = [f"{s}{k}{i}" for s, k, i in rec.actions]
        out[name + " planned"] = [str(a) for a in schedule.pipeline_order[rank] if a is not None
                                  and a.computation_type.value in ("F", "B", "I", "W")]
    return out


def test_every_schedule_gives_one_processs_gradients():
    """The schedule divides the summed micro-batch gradients by M: the whole batch's mean. On 4
    ranks (8 stages for the interleaved ones, some of them empty); the 2-rank lesson run trains."""
    ranks = run_ranks(_grads_of_one_batch, 4, ())
    model = T.make_model()
    x, y = T.batch(0)
    loss = T.loss_fn(model(x), y)
    loss.backward()
    for name in ("gpipe", "1f1b", "interleaved", "zero-bubble"):
        grads = {k: g for r in ranks for k, g in r[name].items()}
        assert sorted(grads) == sorted(k for k, _ in model.named_parameters()), name
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, atol=1e-6, rtol=1e-4, msg=f"{name}: {k}")
        losses = ranks[-1][name + " losses"]  # the last rank holds the loss of every micro-batch
        assert len(losses) == M and losses.mean().item() == pytest.approx(loss.item(), abs=1e-5)
        # what the Recorder saw is the schedule's own plan (pipeline_order), action for action ...
        for rank, r in enumerate(ranks):
            if (name, rank) != ("1f1b", 3):
                assert r[name + " ran"] == r[name + " planned"], (name, rank)
    # ... except where torch 2.14.1's plan for 1F1B numbers the last rank's micro-batches from 1
    # (docs/18, Going further); what runs starts at 0
    ran, planned = ranks[3]["1f1b ran"], ranks[3]["1f1b planned"]
    assert [a for a in ran if "F" in a] == [f"3F{i}" for i in range(M)]
    assert [a for a in planned if "F" in a] == [f"3F{i}" for i in range(1, M + 1)]


def _gpipe(p, m):
    return {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}


def _one_f_one_b(p, m):
    actions = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [(r, "F", warm + i), (r, "B", i)]
        actions[r] = acts + [(r, "B", i) for i in range(m - warm, m)]
    return actions


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_timeline_idle_time_is_the_formula(p, m):
    for actions in (_gpipe(p, m), _one_f_one_b(p, m)):
        tl = P.timeline(actions)
        assert max(end for _, _, end, _ in tl) == 3 * (m + p - 1)
        assert P.idle_fraction(tl) == pytest.approx(P.bubble_formula(p, m))
    lines = P.draw(P.timeline(_gpipe(p, m)))
    assert len(lines) == p and lines[-1].startswith(f"rank {p - 1} | " + "... " * (p - 1) + f"{p - 1}F0")


def _stub(stage: int, stages: int, world: int):
    """What a schedule's constructor reads of a PipelineStage: no process group needed."""
    return SimpleNamespace(stage_index=stage, num_stages=stages, group_size=world, group_rank=stage % world,
                           submod=None)


def _schedule(name: str, p: int, m: int):
    """torch's own schedule for rank 0 of p, built as lesson 18 builds it (v = 1 or 2)."""
    lesson = import_lesson("18")
    v = 1 if name in ("gpipe", "1f1b") else 2
    stages = [_stub(k * p, v * p, p) for k in range(v)]
    return lesson.SCHEDULES[name](stages if v > 1 else stages[0], m, loss_fn=T.loss_fn)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_interleaved_idle_time_is_the_megatron_formula(p):
    """torch's ScheduleInterleaved1F1B plan (all ranks), through the timeline: (p-1)/(2m+p-1),
    also where m is not a multiple of p (torch's rounds of m // p micro-batches)."""
    for m in sorted({p, p + 1, p + 2, 2 * p, 3 * p, 4 * p}):
        if m % max(1, m // p):
            continue  # torch refuses it, and so does lesson 18's flag rule
        plan = _schedule("interleaved", p, m).pipeline_order
        actions = {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts if a]
                   for r, acts in plan.items()}
        assert P.idle_fraction(P.timeline(actions)) == pytest.approx(P.bubble_formula(p, m, 2)), (p, m)


def test_a_pass_through_stage_takes_no_time():
    """Three stages where the middle one holds nothing: the timeline of a two-stage 1F1B, and
    rank 1 idle throughout (its actions are there, of zero length)."""
    m = 4
    tl = P.timeline(_one_f_one_b(3, m), empty={1})
    assert max(end for _, _, end, _ in tl) == 3 * (m + 2 - 1)
    assert all(start == end for rank, start, end, _ in tl if rank == 1) and len(tl) == 3 * 2 * m
    assert P.idle_fraction(tl) == pytest.approx(1 - 2 * 3 * m / (3 * 3 * (m + 1)))
    assert P.draw(tl)[1] == "rank 1 | " + " ".join(["..."] * 3 * (m + 1))
    assert P.idle_fraction(P.timeline(_one_f_one_b(3, m))) == pytest.approx(P.bubble_formula(3, m))


def test_timeline_refuses_actions_that_wait_forever():
    with pytest.raises(RuntimeError, match="wait on each other forever"):
        P.timeline({0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "B", 0), (1, "F", 0)]})


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    module = import_lesson("18")
    for flags, expect in ((["--schedule", "dualpipe"], "--schedule"), (["--microbatches", "0"], "--microbatches"),
                          (["--world-size", "0"], "--world-size")):
        assert expect in parse_error(module, flags, monkeypatch, capsys)
    for flags, expect in ((["--world-size", "3"], "--world-size 3 must divide the 4 pieces of the model (embeddings, 2 blocks, head) and be at most 8 "
                           "on one machine: use one of 1, 2, 4"),
                          (["--world-size", "8"], "use one of 1, 2, 4"),
                          (["--microbatches", "5"], "--microbatches must divide the 48 rows"),
                          (["--world-size", "4", "--microbatches", "2"], "fewer than the 4 stages")):
        monkeypatch.setattr(sys, "argv", ["18_pipeline_schedules.py", *flags])
        with pytest.raises(SystemExit) as exit_info:
            module.main()
        assert exit_info.value.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], lines
    for world in (1, 2, 4):  # one rank is a pipeline of 1 (or 2 interleaved) stages: no bubble
        P.check_flags(world, 4, T.GLOBAL_BATCH)


def test_flag_rule_is_torchs_own_for_every_combination():
    """flag_error lets (p, m) through exactly when m splits the batch into equal micro-batches
    and torch 2.14.1 builds all four schedules for it (torch's own checks: 1F1B wants m >= p,
    the interleaved ones m a multiple of their rounds, m // p). A batch of 72 rows too, where
    the rounds rule bites (p=4, m=9: rounds of 2) as it never does for 48."""
    @functools.cache
    def torch_builds(p, m):
        try:
            for name in ("1f1b", "interleaved", "zero-bubble", "gpipe"):  # the refusing ones first
                _schedule(name, p, m)
        except ValueError:
            return False
        return True

    for rows in (T.GLOBAL_BATCH, 72):
        for p in (1, 2, 4):
            for m in range(1, rows + 1):
                ours = P.flag_error(p, m, rows) is None
                assert ours == (rows % m == 0 and torch_builds(p, m)), (rows, p, m, P.flag_error(p, m, rows))
    assert not torch_builds(4, 9) and "multiple of 2" in P.flag_error(4, 9, 72)
    assert not torch_builds(4, 2) and "fewer than the 4 stages" in P.flag_error(4, 2, 48)

