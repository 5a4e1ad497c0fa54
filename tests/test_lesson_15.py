"""Lesson 15: ZeRO and FSDP2, run as a learner would; ShardedOptimizer checked on its own.

Two short runs on 2 ranks share the module, fsdp and ddp (their peaks side by side): each
must end with lesson 13's weights for the same steps (within 1e-3), hold what the formula
says on every rank, peak above that, and send what the ring formulas say. Starting a run is
most of its cost, so the rest is checked in one world of 3 ranks: ShardedOptimizer as a
drop-in, and on the recipe, lesson 15's zero1 (lesson 13's weights, bytes held and sent
beside the formulas) and FSDP2's padding. (The doc's output blocks also run zero1 and
zero1-torch; tools/doc_output.py regenerates them.)
"""
import contextlib
import functools
import math
import re
import sys

import pytest
import torch

from common import transformer as T
from apparatus.state_dicts import load_into
from conftest import ROOT, import_lesson, load_run, make_lesson, max_abs_diff, parse_error, weights_line

STEPS = 4
RUNS = {"fsdp": (2, []), "ddp": (2, ["--strategy", "ddp"])}
PSI = sum(p.numel() for p in T.make_model().parameters())  # parameters of the recipe
SHAPES = [tuple(p.shape) for p in T.make_model().parameters()]
NAMES = [n for n, _ in T.make_model().named_parameters()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once: each is mostly start-up (imports, the fork server, the ranks joining),
    which overlaps well; each has its own --out and its own free port."""
    from concurrent.futures import ThreadPoolExecutor

    folders = {name: tmp_path_factory.mktemp(f"lesson15-{name}") for name in RUNS}

    def launch(name):
        world, flags = RUNS[name]
        return make_lesson("15", "--device", "cpu", "--world-size", world, "--steps", STEPS,
                           *flags, "--out", folders[name], timeout=240)
    with ThreadPoolExecutor(len(RUNS)) as pool:
        procs = dict(zip(RUNS, pool.map(launch, RUNS)))
    return {name: (procs[name].stdout, *load_run(folders[name]), RUNS[name][0]) for name in RUNS}


@pytest.fixture(scope="module")
def reference():
    return T.train_reference(T.SEED, STEPS)


@pytest.mark.parametrize("name", list(RUNS))
def test_same_weights_as_lesson_13_within_the_floor(runs, reference, name):
    out, state, metrics, world = runs[name]
    diff = max_abs_diff(state, reference["state"])
    assert diff <= 1e-3 and metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff)
    assert metrics["strategy"] == name and metrics["world_size"] == world
    floor = max_abs_diff(T.train_reference(T.SEED, STEPS, chunks=world)["state"], reference["state"])
    assert metrics["max_abs_diff_floor"] == pytest.approx(floor) and metrics["floor_chunks"] == world
    assert weights_line(diff, floor, world) in out
    # the losses are the global batch's (the mean of the ranks'), close to one process's
    assert metrics["losses"] == pytest.approx(reference["losses"].tolist(), abs=1e-4)


@pytest.mark.parametrize("name", list(RUNS))
def test_final_pt_is_the_full_state_dict_a_plain_model_loads(runs, name, tmp_path):
    _, state, _, _ = runs[name]
    assert set(state) == set(T.make_model().state_dict())  # no wrapper prefix, nothing sharded
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in state.values())
    model = T.make_model(seed=1)
    torch.save(state, tmp_path / "final.pt")
    load_into(model, tmp_path / "final.pt")
    assert max_abs_diff(model.state_dict(), state) == 0.0


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_holds_what_the_formula_says(runs, name):
    out, _, metrics, world = runs[name]
    ranks = metrics["per_rank_bytes_all"]
    assert len(ranks) == world and metrics["per_rank_bytes"] == ranks[0]["measured"]
    for r in ranks:
        assert r["measured"] == r["formula"], r
    held = sum(ranks[0]["measured"].values())  # printed beside one device's 16 bytes per parameter
    assert f"rank 0 holds {held:,} bytes, {held / PSI:.1f} per parameter: {held / (16 * PSI):.0%}" in out
    if name == "fsdp":  # everything sharded: the shards of each tensor add up to it
        _fsdp_holds_padded_shards(ranks, world)
    else:  # ddp: everything everywhere, lesson 13's 16 bytes per parameter (zero1: in the 3-rank world)
        assert all(r["measured"] == {"parameters": 4 * PSI, "gradients": 4 * PSI,
                                     "optimizer_state": 8 * PSI} for r in ranks)


def _fsdp_holds_padded_shards(ranks, world):
    """Every rank stores ceil(rows / N) rows of each tensor (torch.chunk's first piece)."""
    assert sum(r["measured"]["optimizer_state"] for r in ranks) == 8 * PSI
    padded = 4 * sum(len(torch.arange(s[0]).chunk(world)[0]) * math.prod(s[1:]) for s in SHAPES)
    assert all(r["measured"]["parameters"] == r["measured"]["gradients"] == padded for r in ranks)
    assert 4 * PSI / world <= padded < 4 * PSI / world * 1.1  # 3 does not divide 64 or 8 rows
    assert sum(ranks[0]["measured"].values()) < 16 * PSI / world * 1.1  # 1/N of one device
    return padded


def test_peak_of_a_step_is_measured_on_every_rank_and_fsdp_peaks_below_ddp(runs):
    """MemTracker's peak of one step (metrics.json's peak_memory_bytes: rank 0's; every
    rank's in peak_memory_bytes_all) is above what the rank holds at rest (the activations
    come on top), and on 2 ranks FSDP's is below DDP's on every rank."""
    for name, (out, _, metrics, world) in runs.items():
        peaks, rest = metrics["peak_memory_bytes_all"], metrics["per_rank_bytes_all"]
        assert len(peaks) == world and metrics["peak_memory_bytes"] == peaks[0], name
        assert metrics["peak_memory_step"] == STEPS  # the last step, the last printed
        for peak, r in zip(peaks, rest):
            assert peak >= sum(r["measured"].values()), (name, peak, r)
        assert f"{peaks[0]:,}" in out and f"Peak of training step {STEPS}, per rank" in out, name
        assert metrics["at_rest_bytes_all"] == [sum(r["measured"].values()) for r in rest], name
    fsdp, ddp = runs["fsdp"][2]["peak_memory_bytes_all"], runs["ddp"][2]["peak_memory_bytes_all"]
    assert all(f < d for f, d in zip(fsdp, ddp)), (fsdp, ddp)


def test_fsdp_padding_matches_torch_chunk():
    sys.path.insert(0, str(ROOT))
    from apparatus.sharding import fsdp_local_rows
    for rows, world in ((8, 3), (64, 3), (32, 3), (1, 4), (64, 4)):
        chunks = torch.arange(rows).chunk(world)
        padded = len(chunks[0])
        for rank in range(world):
            mine = len(chunks[rank]) if rank < len(chunks) else 0
            assert fsdp_local_rows(rows, world, rank) == (mine, padded)


def test_communication_is_counted_and_matches_the_ring_formulas(runs):
    ddp = lambda n: 2 * (n - 1) / n * 4 * PSI  # noqa: E731 - DDP's all-reduce, per rank
    out, _, fsdp, world = runs["fsdp"]
    assert fsdp["comm_bytes_per_step"] == pytest.approx(fsdp["comm_formula_bytes"])
    assert fsdp["ddp_comm_bytes"] == pytest.approx(ddp(world))
    # ZeRO-3: each block all-gathered in forward, again in backward, reduce-scattered (1.5x
    # DDP); the root (FSDP2's default for it) gathered once and kept for backward
    blocks = 4 * sum(math.prod(s) for n, s in zip(NAMES, SHAPES) if n.startswith("blocks."))
    share = (world - 1) / world
    assert fsdp["comm_bytes_per_step"] == pytest.approx(share * (3 * blocks + 2 * (4 * PSI - blocks)))
    assert 1.45 < fsdp["comm_bytes_per_step"] / ddp(world) < 1.5
    assert fsdp["comm_calls_per_step"] == 3 * T.N_BLOCKS + 2
    assert "pre_backward" in out and "reduce-scatter" in out and "S(0)" in out
    # the story: the root is not gathered again in backward; each group's pre_backward
    # prefetches the group before it, and that gather is shown under the group it is for
    story = out[out.index("What FSDP2 did"):]
    assert re.search(r"pre_backward\s+│ root\s+│ -", story), story
    assert re.search(r"prefetch in root's\s+│ blocks\.1\s+│ all-gather", story), story
    assert re.search(r"prefetch in blocks\.1's\s+│ blocks\.0\s+│ all-gather", story), story
    assert re.search(r"pre_backward\s+│ blocks\.[01]\s+│ -", story), story
    _, _, ddp_run, _ = runs["ddp"]
    # torch's DDP adds two small broadcasts in its second step (its rebuilt buckets)
    assert ddp_run["comm_bytes_per_step"] == pytest.approx(ddp(2), rel=1e-4)


@functools.cache
def _lesson_15():
    """The lesson as a module, once per rank (its module body imports a good deal)."""
    return import_lesson("15")


def _sharded_vs_one_process(rank, world, make_model, optimizer_class, defaults, steps):
    """ShardedOptimizer on `world` ranks against optimizer_class in one process, both under an
    LR scheduler, ShardedOptimizer stepped with a closure; then its state_dict against the
    plain optimizer's, and loaded back into a fresh ShardedOptimizer and a plain optimizer."""
    import torch.distributed as dist

    lesson = _lesson_15()
    torch.manual_seed(0)
    model, single = make_model(), make_model()
    single.load_state_dict(model.state_dict())
    sharded = lesson.ShardedOptimizer(model.parameters(), optimizer_class, **defaults)
    plain = optimizer_class(single.parameters(), **defaults)
    # halving the lr every step: if it never reached the inner optimizer, the weights part
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (sharded, plain)]
    g, used, expected_lr = torch.Generator().manual_seed(1), [], []
    for _ in range(steps):
        x = torch.randn(world * 4, 6, generator=g)

        def closure():
            sharded.zero_grad()
            loss = model(x[rank * 4:(rank + 1) * 4]).square().mean()
            loss.backward()
            return loss
        loss = sharded.step(closure)
        plain.zero_grad()
        sum(single(x[r * 4:(r + 1) * 4]).square().mean() for r in range(world)).div(world).backward()
        plain.step()
        used.append(sharded.optim.param_groups[0]["lr"])  # the lr the inner optimizer stepped with
        expected_lr.append(plain.param_groups[0]["lr"])
        for scheduler in schedulers:
            scheduler.step()
    owned = sum(p.numel() for p in sharded.optim.param_groups[0]["params"])
    total = torch.tensor([owned])
    dist.all_reduce(total)
    full, expected = sharded.state_dict(), plain.state_dict()  # a collective: every rank's
    fresh = lesson.ShardedOptimizer(model.parameters(), optimizer_class, **defaults)
    fresh.load_state_dict(expected)  # one process's state: each rank keeps its part
    optimizer_class(single.parameters(), **defaults).load_state_dict(full)  # and the other way

    def state_diff(a, b):
        assert set(a) == set(b), (set(a), set(b))
        return max([(x[k] - y[k]).abs().max().item() for i in a for x, y in [(a[i], b[i])]
                    for k in x if torch.is_tensor(x[k])], default=0.0)
    return {"diff": max((a - b).abs().max().item() for a, b in
                        zip(model.state_dict().values(), single.state_dict().values())),
            "owned": owned, "total_owned": int(total), "unique": sum(p.numel() for p in model.parameters()),
            "loss": isinstance(loss, torch.Tensor), "lr": used, "expected_lr": expected_lr, "state_diff": state_diff(full["state"], expected["state"]),
            "loaded_diff": state_diff(fresh.state_dict()["state"], expected["state"]),
            "loaded_lr": fresh.param_groups[0]["lr"] == plain.param_groups[0]["lr"], "groups": full["param_groups"] == expected["param_groups"]}


class Tied(torch.nn.Module):
    """A tied weight (used twice), a frozen layer, and a layer that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.frozen, self.unused = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(self.a(x))))


def _one_world_of_three(rank, world, steps):
    """AdamW on Tied, SGD with momentum on one Linear (two parameters: on 3 ranks, one rank
    owns nothing), in one world of ranks (starting ranks is the slow part); then lesson 15's
    zero1 on the recipe, and what the recipe holds under its fully_shard, padded on 3."""
    return [_sharded_vs_one_process(rank, world, make_model, cls, defaults, steps)
            for make_model, cls, defaults in ((Tied, torch.optim.AdamW, {"lr": 1e-2}),
                                              (lambda: torch.nn.Linear(6, 6), torch.optim.SGD,
                                               {"lr": 0.1, "momentum": 0.9}))
            ] + [_zero1_recipe(rank, world), _fsdp_held(rank, world)]


ZERO1_STEPS = 1


def _zero1_recipe(rank, world):
    """Lesson 15's zero1 on the recipe: ZERO1_STEPS steps on this rank's rows, the last one
    recorded by CommLog; the weights, what the rank holds and sends, and the formulas."""
    import torch.distributed as dist

    from apparatus import sharding
    from apparatus.comm import CommLog
    lesson = _lesson_15()
    model = T.make_model(T.SEED)
    optimizer = lesson.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=T.LR, eps=T.EPS)
    log = CommLog()
    for step in range(ZERO1_STEPS):
        x, y = T.batch(step, T.SEED)
        with log.recording() if step == ZERO1_STEPS - 1 else contextlib.nullcontext():
            loss = T.loss_fn(model(T.shard(x, rank, world)), T.shard(y, rank, world))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    shapes = sharding.recipe_shapes()
    comm = log.summary(1)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None,
            "measured": sharding.held_bytes(model, optimizer),
            "formula": sharding.formula_bytes("zero1", shapes, world, rank, sharding.owned_numel(optimizer)),
            "sent": comm["sent_bytes_per_step"], "calls": comm["calls_per_step"],
            "sent_formula": sharding.comm_formula("zero1", shapes, world, optimizer.size, True),
            "world": dist.get_world_size()}


def _fsdp_held(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from apparatus import sharding
    model = T.make_model(T.SEED)
    mesh = dist.init_device_mesh("cpu", (world,))
    for block in model.blocks:  # as lesson 15's Step 3
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = T.make_optimizer(model)
    x, y = T.batch(0, T.SEED)
    T.loss_fn(model(T.shard(x, rank, world)), T.shard(y, rank, world)).backward()
    optimizer.step()
    return {"measured": sharding.held_bytes(model, optimizer),
            "formula": sharding.formula_bytes("fsdp", sharding.recipe_shapes(), world, rank,
                                              sharding.owned_numel(optimizer))}


def test_sharded_optimizer_is_a_drop_in_that_matches_one_process():
    """Tied weights, a scheduler, step(closure), state_dict both ways, a rank with nothing;
    then on the recipe, lesson 15's zero1 (weights, bytes held and sent) and FSDP2's padded
    shards on 3 ranks, measured beside the formulas."""
    from common.distributed import run_ranks
    ranks = run_ranks(_one_world_of_three, 3, (4,))
    fsdp = [r.pop() for r in ranks]  # FSDP2 on 3 ranks: 3 does not divide 64 or 8 rows
    assert all(r["measured"] == r["formula"] for r in fsdp), fsdp
    assert _fsdp_holds_padded_shards(fsdp, 3) > 4 * PSI / 3
    zero1 = [r.pop() for r in ranks]  # lesson 15's zero1 on the recipe, 3 ranks
    reference = T.train_reference(T.SEED, ZERO1_STEPS)["state"]
    assert max_abs_diff(zero1[0]["state"], reference) <= 1e-3  # lesson 13's weights
    assert all(r["measured"] == r["formula"] for r in zero1), zero1
    assert sum(r["measured"]["optimizer_state"] for r in zero1) == 8 * PSI  # each element once
    assert all(r["measured"]["parameters"] == r["measured"]["gradients"] == 4 * PSI for r in zero1)
    ddp = 2 * 2 / 3 * 4 * PSI  # DDP's all-reduce on 3 ranks
    assert all(r["sent"] == pytest.approx(r["sent_formula"]) and r["calls"] == 2 for r in zero1), zero1
    assert 1.0 <= zero1[0]["sent"] / ddp < 1.1  # a reduce-scatter and an all-gather: DDP's volume
    for results in zip(*ranks):  # per model and optimizer class: every rank's report
        assert all(r["diff"] < 1e-6 for r in results), results
        assert all(r["loss"] and r["lr"] == r["expected_lr"] and r["loaded_lr"] for r in results), results
        assert all(r["state_diff"] < 1e-6 and r["loaded_diff"] < 1e-6 and r["groups"] for r in results), results
    tied = [r[0] for r in ranks]
    # every element's state lives on exactly one rank: the tied weight is counted once
    assert tied[0]["total_owned"] == tied[0]["unique"] == 3 * 42 + 6  # b.weight is a.weight
    assert all(r["owned"] < r["unique"] for r in tied)
    linear = [r[1] for r in ranks]  # 36 + 6 elements in two tensors, on 3 ranks
    assert sorted(r["owned"] for r in linear) == [0, 6, 36]


def test_prints_its_own_steps_and_not_lesson_13s_demonstrations(runs):
    """The steps the code marks, printed in order by rank 0, titled by sharding; lesson 13's
    activation steps (and their metrics) stay in lesson 13: sharding does not change them."""
    marked = re.findall(r"^\s*# Step (\d+): (.+?)\s*$", (ROOT / "lessons" / "15_zero_fsdp.py").read_text(), re.M)
    assert [int(n) for n, _ in marked] == list(range(1, len(marked) + 1))
    assert "shard" in marked[2][1] and "holds and sends" in marked[5][1] and "lesson 13" in marked[6][1]
    for name, (out, _, metrics, _) in runs.items():
        assert re.findall(r"^Step (\d+): (.+?)\s*$", out, re.M) == marked, name
        # (the peak table's "of it: activations" column is the peak's measurement, not a demonstration)
        assert "Measure the activations" not in out and "checkpoint" not in out.lower(), name
        assert not {"memory_bytes", "activations_checkpointed_bytes", "loss_bf16"} & set(metrics), name


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    """Before any rank starts; the world size by Part 2's one rule (common/transformer.py)."""
    lesson = import_lesson("15")
    for n in ("5", "16"):  # 5 does not divide the 48 rows; 16 does, but is more than 8
        line = parse_error(lesson, ["--world-size", n], monkeypatch, capsys)
        assert line.startswith("error: --world-size must divide the global batch of 48 rows"), line
    assert "--strategy" in parse_error(lesson, ["--strategy", "zero3"], monkeypatch, capsys)
