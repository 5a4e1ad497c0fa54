"""The Part 2 recipe (common/transformer.py): the properties lessons 14-20 rely on."""
import torch
import torch.nn as nn

from common import transformer as T
from conftest import ROOT


def test_batch_is_a_function_of_step_and_seed_and_splits_into_equal_shards():
    x, y = T.batch(3, seed=0)
    assert x.shape == y.shape == (T.GLOBAL_BATCH, T.SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(x, T.batch(3, seed=0)[0])
    assert not torch.equal(x, T.batch(4, seed=0)[0]) and not torch.equal(x, T.batch(3, seed=1)[0])
    for world in (1, 2, 3, 4):
        shards = [T.shard(x, r, world) for r in range(world)]
        assert all(s.shape[0] == T.GLOBAL_BATCH // world for s in shards)
        assert torch.equal(torch.cat(shards), x)  # contiguous rows, in rank order


def test_mean_of_equal_shard_means_is_the_global_mean():
    model = T.make_model(0)
    x, y = T.batch(0)
    whole = T.loss_fn(model(x), y)
    for world in (2, 3, 4):
        parts = [T.loss_fn(model(T.shard(x, r, world)), T.shard(y, r, world)) for r in range(world)]
        torch.testing.assert_close(sum(parts) / world, whole)


def test_model_shape_for_every_kind_of_parallelism():
    model = T.make_model(0)
    assert not [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # not tied
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == T.N_BLOCKS
    for block in model.blocks:
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.attn.proj, block.mlp.fc,
                    block.mlp.proj):
            assert isinstance(lin, nn.Linear) and lin.weight.shape[0] % 4 == 0
    assert T.N_HEADS % 4 == 0 and T.SEQ % 4 == 0 and T.GLOBAL_BATCH % 12 == 0
    assert not list(model.buffers())
    assert torch.equal(T.make_model(0).head.weight, model.head.weight)
    assert not torch.equal(T.make_model(1).head.weight, model.head.weight)


def test_pipeline_stages_compose_to_the_whole_model():
    """Stage 0 keeps the embeddings and block 0, stage 1 the rest and the head."""
    model = T.make_model(0)
    x, _ = T.batch(0)
    first, last = T.make_model(0), T.make_model(0)
    first.blocks, first.norm, first.head = nn.ModuleList(first.blocks[:1]), nn.Identity(), None
    last.tok_emb = last.pos_emb = None
    last.blocks = nn.ModuleList(last.blocks[1:])
    torch.testing.assert_close(last(first(x)), model(x))


def test_fewer_heads_per_rank_work_unchanged():
    """Tensor parallelism gives each rank N_HEADS / tp heads: attention infers the count."""
    attn = T.make_model(0).blocks[0].attn
    x = torch.randn(2, T.SEQ, T.DIM)
    half = T.DIM // 2
    for name in ("q", "k", "v"):  # keep the first half of the heads, as rank 0 of 2 would
        lin = getattr(attn, name)
        small = nn.Linear(T.DIM, half)
        small.weight.data, small.bias.data = lin.weight[:half].clone(), lin.bias[:half].clone()
        setattr(attn, name, small)
    attn.proj = nn.Linear(half, T.DIM)
    assert attn(x).shape == x.shape


def test_reference_is_cached_and_a_damaged_cache_is_computed_again():
    first = T.train_reference(seed=5, steps=2)
    cached = sorted((ROOT / "runs" / "reference-13").glob("seed5-steps2-chunks1-*.pt"))
    assert len(cached) == 1
    cached[0].write_bytes(b"not a torch file")
    again = T.train_reference(seed=5, steps=2)
    assert all(torch.equal(first["state"][k], again["state"][k]) for k in first["state"])
    assert torch.load(cached[0], weights_only=True)["losses"].shape == (2,)


def test_chunked_reference_is_the_rounding_floor_far_below_the_tolerance(reference_13):
    """Summing each batch in 2 chunks only moves the weights by rounding: Part 2's 1e-3 holds."""
    from apparatus.results import max_abs_diff
    chunked = T.train_reference(chunks=2)
    assert 0 < max_abs_diff(chunked["state"], reference_13["state"]) < 1e-4
    torch.testing.assert_close(chunked["losses"], reference_13["losses"], rtol=0, atol=1e-4)
