"""Lesson 14: DDP by hand. One 2-rank run of the lesson through its real launcher feeds most
assertions; HandDDP is also run on its own (tied weight, frozen layer, buffer) against
torch's DDP, and on the transformer at 3 and 4 ranks against lesson 13's reference."""
import re

import pytest
import torch

from common import transformer as T
from conftest import ROOT, import_lesson, load_run, make_lesson, max_abs_diff, parse_error, weights_line

from common.distributed import run_ranks

WORLD = 2
STEPS = 30  # of lesson 13's 120: the same claims, compared with lesson 13 run as long


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lesson14")
    proc = make_lesson("14", "--world-size", WORLD, "--device", "cpu", "--steps", STEPS,
                       "--out", folder, timeout=300)
    state, metrics = load_run(folder)
    return proc.stdout, state, metrics


def test_ends_with_lesson_13s_weights_and_torch_ddps(lesson):
    out, state, metrics = lesson
    reference_13 = T.train_reference(steps=STEPS)
    diff = max_abs_diff(state, reference_13["state"])
    floor = max_abs_diff(T.train_reference(steps=STEPS, chunks=WORLD)["state"], reference_13["state"])
    assert diff <= 1e-3, diff
    assert metrics["max_abs_diff_vs_single_device"] == pytest.approx(diff, abs=1e-12)
    assert metrics["max_abs_diff_floor"] == pytest.approx(floor, abs=1e-12)
    assert metrics["max_abs_diff_vs_torch_ddp"] <= 1e-5  # same sums, same order of steps
    assert f"same weights as lesson 13? {weights_line(diff, floor, WORLD)}" in out
    assert (metrics["world_size"], metrics["backend"], metrics["lesson"]) == (WORLD, "gloo", "14")
    # the losses are the whole batch's (the mean over ranks), so they follow lesson 13's
    reference_losses = reference_13["losses"].tolist()
    assert max(abs(a - b) for a, b in zip(metrics["losses"], reference_losses)) < 1e-2


def expected_buckets(cap_mib: float) -> int:
    """The bucket count by the rule, computed again: reverse order, fill up to the cap."""
    sizes = [p.numel() * 4 for p in T.make_model().parameters()][::-1]
    buckets, used = 0, None
    for size in sizes:
        if used is None or used + size > cap_mib * 2**20:
            buckets, used = buckets + 1, 0
        used += size
    return buckets


def test_counts_the_all_reduces_and_their_bytes(lesson):
    _, state, metrics = lesson
    comm = metrics["comm"]
    per_param, bucketed = comm["HandDDP per parameter"], comm["HandDDP 0.1 MiB"]
    torch_ddp = comm["torch DDP 0.1 MiB"]
    n_tensors = len(state)  # the transformer has no buffers: every entry is a parameter
    assert per_param["calls_per_step"] == n_tensors
    assert bucketed["calls_per_step"] == expected_buckets(0.1) < n_tensors
    assert 1 < torch_ddp["calls_per_step"] < n_tensors
    data = 4 * sum(t.numel() for t in state.values())  # every gradient, once per step
    for s in (per_param, bucketed, torch_ddp):
        assert s["data_bytes_per_step"] == data
        assert s["sent_bytes_per_step"] == pytest.approx(2 * (WORLD - 1) / WORLD * data)
        assert s["launched_during_backward"] == 1.0  # all start inside loss.backward()
        assert s["async_fraction"] == 1.0
        assert 0 < s["overlapped_fraction"] <= 1  # some communication hid behind backward
    assert torch_ddp["backward_windows"] == STEPS - 1  # all but its warm-up step


def test_prints_the_table_and_its_own_steps_in_order(lesson):
    """The steps the code marks, printed in order; lesson 13's memory demonstrations
    (activations, checkpointing, bf16) stay in lesson 13, and so do their metrics."""
    out, _, metrics = lesson
    assert "All-reduces per step, on rank 0" in out and "HandDDP per parameter" in out
    marked = re.findall(r"^\s*# Step (\d+): (.+?)\s*$", (ROOT / "lessons" / "14_ddp_by_hand.py").read_text(), re.M)
    printed = re.findall(r"^Step (\d+): (.+?)\s*$", out, re.M)
    assert printed == marked and [int(n) for n, _ in printed] == list(range(1, len(marked) + 1))
    assert "HandDDP" in printed[2][1] and "all-reduc" in printed[3][1]  # the titles name the idea
    assert not {"Measure the activations", "Activation checkpointing", "bf16 autocast"} & {t for _, t in printed}
    assert not {"memory_bytes", "activations_checkpointed_bytes", "checkpointed_losses"} & set(metrics)


def test_reports_every_ranks_peak_of_one_step_beside_what_it_holds(lesson):
    """metrics.json's peak_memory_bytes (rank 0) and peak_memory_bytes_all (issue 23): torch's
    MemTracker around the last step on every rank. Every rank holds what lesson 13's one
    device held (16 bytes per parameter); the step's activations, of its own rows, come on top."""
    out, state, metrics = lesson
    held = 16 * sum(t.numel() for t in state.values())
    peaks, at_rest = metrics["peak_memory_bytes_all"], metrics["at_rest_bytes_all"]
    assert len(peaks) == len(at_rest) == WORLD and metrics["peak_memory_bytes"] == peaks[0]
    assert at_rest == [held] * WORLD and metrics["peak_memory_step"] == STEPS
    for peak, rest in zip(peaks, at_rest):
        assert type(peak) is int and peak > rest
    assert metrics["peak_memory_breakdown"]["ACT"] > 0
    table = out.split(f"Peak of training step {STEPS}, per rank")[1].split("Step 5")[0]
    for rank, peak in enumerate(peaks):
        assert re.search(rf"{rank}\s+\S\s+{held:,}\s+\S\s+{peak:,}\s", table), table


# --- HandDDP on its own -----------------------------------------------------------------

def _tied_model(seed: int):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(12, 16)
            self.mid = torch.nn.Linear(16, 16)
            self.frozen = torch.nn.Linear(16, 16).requires_grad_(False)
            self.head = torch.nn.Linear(16, 12, bias=False)
            self.head.weight = self.emb.weight  # one tensor, two layers
            self.register_buffer("scale", torch.full((1,), 1.0 + seed))

        def forward(self, x):
            return self.head(self.frozen(torch.tanh(self.mid(self.emb(x))))) * self.scale

    torch.manual_seed(seed)
    return Tied()


def _train_tied(rank: int, world: int) -> dict:
    """Different initial weights on every rank: HandDDP must broadcast rank 0's; then 3 AdamW
    steps on per-rank batches, per parameter and in buckets, against torch's DDP."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from apparatus.comm import CommLog

    HandDDP = import_lesson("14").HandDDP
    results = {}
    for name, bucket_mb in (("per parameter", None), ("buckets", 0.0011), ("torch", None)):
        model = _tied_model(rank if name != "torch" else 0)
        wrapped = DDP(model) if name == "torch" else HandDDP(model, bucket_mb)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        log = CommLog()
        with log.recording():
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randint(0, 12, (6, 5), generator=g), torch.randint(0, 12, (6, 5), generator=g)
                loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if name != "torch":
                    wrapped.finish_gradient_synchronization()
                optimizer.step()
        results[name] = {"start": start, "end": {k: v.clone() for k, v in model.state_dict().items()},
                         "frozen_grad": model.frozen.weight.grad is None,
                         "all_reduces": sum(c.kind == "all_reduce" for c in log.calls) / 3}
        del wrapped
    return results


def _three_ranks(rank: int, world: int) -> dict:
    """One 3-rank world feeds two tests: the tied model, then the transformer."""
    return {"tied": _train_tied(rank, world), "transformer": _train_transformer(rank, world)}


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(_three_ranks, 3, ())


def test_hand_ddp_broadcasts_skips_frozen_and_reduces_tied_weights_once(three_ranks):
    ranks = [r["tied"] for r in three_ranks]
    for mode in ("per parameter", "buckets"):
        for r in ranks:
            assert max_abs_diff(r[mode]["start"], ranks[0][mode]["start"]) == 0.0  # rank 0's
            assert max_abs_diff(r[mode]["end"], r["torch"]["end"]) <= 1e-6, mode
            assert r[mode]["frozen_grad"]
    # 3 trainable tensors (the tied emb/head weight once, mid.weight, mid.bias): one
    # all-reduce each; or 2 buckets of up to 1153 bytes: mid's 1088 bytes, then the 768 tied
    assert ranks[0]["per parameter"]["all_reduces"] == 3
    assert ranks[0]["buckets"]["all_reduces"] == 2


def _train_transformer(rank: int, world: int) -> dict:
    HandDDP = import_lesson("14").HandDDP
    model = T.make_model()
    ddp_model = HandDDP(model, 0.1)
    optimizer = T.make_optimizer(model)
    for step in range(STEPS):
        x, y = (T.shard(t, rank, world) for t in T.batch(step))
        loss = T.loss_fn(ddp_model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ddp_model.finish_gradient_synchronization()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_three_and_four_ranks_end_with_lesson_13s_weights(three_ranks):
    four = run_ranks(_train_transformer, 4, ())
    reference_13 = T.train_reference(steps=STEPS)
    for ranks in ([r["transformer"] for r in three_ranks], four):
        assert all(max_abs_diff(r, ranks[0]) == 0.0 for r in ranks)  # the same steps everywhere
        assert max_abs_diff(ranks[0], reference_13["state"]) <= 1e-3  # Part 2's bound


def test_bad_flags_are_one_clear_line(monkeypatch, capsys):
    """Before any rank starts; the world size by Part 2's one rule (common/transformer.py)."""
    module = import_lesson("14")
    for flags, expect in ((["--bucket-mb", "0"], "--bucket-mb"), (["--world-size", "0"], "--world-size"),
                          (["--steps", "0"], "--steps")):
        assert expect in parse_error(module, flags, monkeypatch, capsys)
    for n in ("5", "16"):  # 5 does not divide the 48 rows; 16 does, but is more than 8
        line = parse_error(module, ["--world-size", n], monkeypatch, capsys)
        assert line.startswith("error: --world-size must divide the global batch of 48 rows"), line
        assert line.endswith("use one of 1, 2, 3, 4, 6, 8"), line


def test_comm_log_formulas_and_overlap_arithmetic():
    """apparatus/comm.py: lesson 10's ring shares, and the interval arithmetic of the overlap."""
    from apparatus import comm

    share = {name: f(4) for name, (_, f) in comm.RING.items()}
    assert share["all_reduce"] == 1.5 and share["reduce_scatter_tensor"] == 0.75
    assert share["all_gather_into_tensor"] == 0.75 and comm.RING["all_reduce"][1](1) == 0
    busy = comm._union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    assert busy == [(0.0, 3.0), (5.0, 6.0)]
    assert comm._intersection(busy, [(2.0, 5.5)]) == pytest.approx(1.5)


def _average_with_avg(rank: int, world: int) -> list[float]:
    import torch.distributed as dist
    t = torch.tensor([float(rank), 10.0 * rank])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.tolist()


def test_gloo_has_reduce_op_avg_and_no_page_says_otherwise():
    """The lesson once said "gloo has no ReduceOp.AVG" (issue 23): on torch 2.14.1 a gloo
    all-reduce with AVG averages, as FSDP2 relies on there."""
    from common.distributed import run_ranks
    got = run_ranks(_average_with_avg, 3)
    assert got == [[1.0, 10.0]] * 3
    pages = [*(ROOT / "lessons").rglob("*.py"), *(ROOT / "docs").rglob("*.md")]
    wrong = [p.name for p in pages if re.search(r"gloo (has no|没有) `?ReduceOp\.AVG", p.read_text())]
    assert not wrong, f"still claims gloo has no ReduceOp.AVG: {wrong}"
