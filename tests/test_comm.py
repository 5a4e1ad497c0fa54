"""apparatus/comm.py, the package's one collective counter, on 2 gloo ranks.

Its table (the share of S each kind sends), and what it sees: torch.distributed's calls,
blocking and async, with their bytes, group and phase (forward, backward, optimizer, between);
DDP's C++ reducer without any hook; and the collectives DTensor issues inside its own
dispatch. Lesson 17's DTensor sequence parallel leaves the LayerNorm gradients Partial after
backward, and AdamW's step all-reduces them: a dispatch mode that does not step aside for
DTensor (lesson 17's counter before this one) never sees those, torch's CommDebugMode does,
and so must ours, call for call.
"""
import pytest
import torch

from apparatus import comm
from common.distributed import run_ranks
from common import transformer as T
from conftest import import_lesson

WORLD = 2


def test_the_table_is_lesson_10s_ring():
    share = {kind: f(4) for kind, f in comm.SHARE.items()}
    assert share == {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75,
                     "broadcast": 0.75, "all_to_all": 0.75, "send": 1.0, "recv": 0.0}
    assert all(f(1) == 0 for kind, f in comm.SHARE.items() if kind != "send")  # one rank: nothing
    for op, (kind, _) in comm.OPS.items():  # every op is one torch has, of a kind with a formula
        namespace, name = op.split(".")
        assert kind in comm.SHARE and hasattr(getattr(torch.ops, namespace), name), op
    assert comm.RING["reduce_scatter_tensor"][0] == "reduce_scatter"  # dist's names -> kinds


def _plain_calls(rank: int, world: int) -> dict:
    """dist's own calls, one of each kind, in each phase; and torch's DDP with no hook."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Sum(torch.autograd.Function):  # all-reduces in backward, as lesson 17's f does
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad

    class Gathers(torch.nn.Module):  # all-gathers in forward
        def forward(self, x):
            out = x.new_empty(world * x.numel())
            dist.all_gather_into_tensor(out, x)
            return Sum.apply(out.requires_grad_())

    class Broadcasting(torch.optim.SGD):  # broadcasts in its step
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                dist.broadcast(p.detach(), src=0)
            return super().step(closure)

    log = comm.CommLog()
    x = torch.ones(1000, requires_grad=True)
    with log.recording():
        dist.all_reduce(torch.ones(1000))                                    # blocking
        dist.all_reduce(torch.ones(1000), async_op=True).wait()              # async
        dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))
        Gathers()(x).sum().backward()
        Broadcasting([x], lr=0.1).step()
    plain = [(c.kind, c.op, c.data_bytes, c.sent_bytes, c.group_size, c.async_op, c.phase,
              c.end is not None and c.end >= c.start) for c in log.calls]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ddp = DDP(model)  # no comm hook: the reducer calls the process group from C++
    sizes = []
    for _ in range(2):
        loss = ddp(torch.randn(4, 8)).sum()
        log = comm.CommLog()
        with log.recording():
            loss.backward()
        sizes.append([(c.kind, c.data_bytes, c.phase) for c in log.calls])
    del ddp
    return {"plain": plain, "ddp": sizes, "group": dist.group.WORLD.group_name, "log_group": log.calls[0].group}


def test_sees_dist_calls_and_ddps_reducer_with_bytes_group_and_phase():
    r0 = run_ranks(_plain_calls, WORLD, timeout_s=120)[0]
    n, S = WORLD, 4000
    assert r0["plain"] == [
        ("all_reduce", "c10d.allreduce_", S, 2 * (n - 1) / n * S, n, False, "between", True),
        ("all_reduce", "c10d.allreduce_", S, 2 * (n - 1) / n * S, n, True, "between", True),
        ("reduce_scatter", "c10d._reduce_scatter_base_", S, (n - 1) / n * S, n, False, "between", True),
        ("all_gather", "c10d._allgather_base_", n * S, (n - 1) * S, n, False, "forward", True),
        ("all_reduce", "c10d.allreduce_", n * S, 2 * (n - 1) * S, n, False, "backward", True),
        ("broadcast", "c10d.broadcast_", S, (n - 1) / n * S, n, False, "optimizer", True)]
    grads = 4 * (8 * 8 + 8 + 8 * 2 + 2)  # one bucket: every gradient, all-reduced in backward
    assert r0["ddp"] == [[("all_reduce", grads, "backward")]] * 2
    assert r0["log_group"] == r0["group"]


def _dtensor_step(rank: int, world: int) -> dict:
    """Lesson 17's DTensor tensor + sequence parallel: one warm-up step, then the same training
    step three times, counted by CommLog, by CommDebugMode, and by a dispatch mode that counts
    the same ops but does not step aside for DTensor (lesson 17's counter before CommLog)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    lesson = import_lesson("17")
    model = lesson.parallelize_dtensor(T.make_model(), rank, world, True)
    optimizer = T.make_optimizer(model)
    norms = sum(1 for name, _ in model.named_parameters() if "norm" in name)

    def step(s):
        x, y = T.batch(s)
        loss = T.loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        partial = sorted({str(p.grad.placements) for n, p in model.named_parameters() if "norm" in n})
        optimizer.step()
        return partial

    class NotSteppingAside(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            NotSteppingAside.calls += str(func._overloadpacket) in comm.OPS
            return func(*args, **(kwargs or {}))

    step(0)
    log = comm.CommLog()
    with log.recording():
        partial = step(1)
    with CommDebugMode() as debug:
        step(2)
    with NotSteppingAside():
        step(3)
    theirs: dict = {}
    for op, n in debug.get_comm_counts().items():  # c10d_functional.all_gather_into_tensor: 10 ...
        kind = next(k for k in ("all_reduce", "all_gather", "reduce_scatter") if k in str(op))
        theirs[kind] = theirs.get(kind, 0) + n
    ours = {k: v for k, v in log.tally(lambda c: "step")["step"].items() if k in comm.SHARE}
    return {"ours": ours, "theirs": theirs, "phases": log.tally(lambda c: c.phase),
            "norm_params": norms, "partial": partial, "not_stepping_aside": NotSteppingAside.calls,
            "groups": {c.group for c in log.calls}, "world_group": dist.group.WORLD.group_name}


def test_sees_dtensors_own_collectives_as_commdebugmode_does():
    for r in run_ranks(_dtensor_step, WORLD, timeout_s=240):
        assert r["ours"] == r["theirs"], (r["ours"], r["theirs"])
        # after backward the LayerNorm gradients are still sums to do (Partial) ...
        assert r["partial"] == ["(Partial(sum),)"]
        # ... and AdamW's step all-reduces each one: in lerp_, and twice in addcmul_(grad, grad)
        optimizer = r["phases"]["optimizer"]
        assert optimizer["all_reduce"] == optimizer["calls"] == 3 * r["norm_params"] > 0
        assert optimizer["sent_bytes"] == pytest.approx(3 * 2 * (WORLD - 1) / WORLD * 4 * T.DIM * r["norm_params"])
        # a mode that runs DTensor's ops itself never sees those
        total = sum(r["ours"].values())
        assert r["not_stepping_aside"] == total - optimizer["calls"]
        assert r["groups"] == {r["world_group"]}  # a 1-D mesh over the world: its one group


def test_compare_watches_the_gradients_before_the_wrapper_hooks_them():
    """A parameter's post-accumulate-grad hooks run in the order they were registered.
    compare() registers the log's before it wraps the model, so each gradient's arrival is
    noted before the wrapper's hook launches its all-reduce: registered after, the last
    launch's own time counted as backward (HandDDP with buckets: 88% "during backward" at world
    size 1 against torch's DDP's 78%; 80% once watched first)."""
    from apparatus.comm import compare

    watched_first = []

    def wrap(model):
        watched_first.append(all(p._post_accumulate_grad_hooks for p in model.parameters()))
        return model

    torch.manual_seed(0)
    compare({"plain": wrap}, lambda: torch.nn.Linear(3, 2), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            lambda s: (torch.randn(4, 3), torch.randn(4, 2)), torch.nn.functional.mse_loss, steps=2)
    assert watched_first == [True]
