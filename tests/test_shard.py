"""The tensor-parallel shard arithmetic (`lmstack.model.shard`) and the loaders built on it."""

from __future__ import annotations

import pytest
import torch

from lmstack.interfaces import LinearSpec
from lmstack.model.linear import default_linear
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack.model.shard import Shard
from lmstack.model.tensor_parallel import attention_shard, expand_kv_heads
from lmstack.model.weight_loader import column_parallel_loader, fused_weight_loader, row_parallel_loader


def rows_of(shard: Shard) -> list[tuple[int, int, int, int]]:
    """(fused start, first kept row, rows kept, local offset) of every part."""
    return [(p.fused_start, p.start, p.rows, p.offset) for p in shard.parts]


def test_unsplit_layer_of_odd_sizes_keeps_everything():
    shard = Shard((5, 3), 7)
    assert rows_of(shard) == [(0, 0, 5, 0), (5, 0, 3, 5)]
    assert (shard.local_out_features, shard.local_in_features) == (8, 7)
    assert shard.columns == slice(0, 7)
    assert shard.column_slice(2) == slice(0, 4)  # the last, partial unit counts
    assert shard.keeps_bias


def test_column_split_cuts_every_fused_part():
    # A qkv of 6 query rows and 2 rows each of k and v, odd input width, over tp=2.
    for rank, want in [
        (0, [(0, 0, 3, 0), (6, 0, 1, 3), (8, 0, 1, 4)]),
        (1, [(0, 3, 3, 0), (6, 1, 1, 3), (8, 1, 1, 4)]),
    ]:
        shard = Shard((6, 2, 2), 9, "column", rank, 2)
        assert rows_of(shard) == want
        assert shard.local_output_sizes == (3, 1, 1)
        assert shard.columns == slice(0, 9) and shard.keeps_bias


def test_row_split_cuts_inputs_and_keeps_the_bias_on_rank_zero():
    shards = [Shard((5,), 12, "row", rank, 3) for rank in range(3)]
    assert [s.columns for s in shards] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert [s.keeps_bias for s in shards] == [True, False, False]
    assert all(rows_of(s) == [(0, 0, 5, 0)] for s in shards)
    assert shards[2].column_slice(2) == slice(4, 6)
    with pytest.raises(
        ValueError, match=r"linear o: .* keeps 4 per rank, not a multiple of 8 \(int4 groups\)"
    ):
        Shard((5,), 12, "row", 1, 3, "o").column_slice(8, "int4 groups")


@pytest.mark.parametrize("tp", [2, 4])
def test_gqa_kv_heads_land_on_the_ranks_that_read_them(tp):
    # 8 query heads, 2 KV heads of 3 dims: tp=2 splits the KV heads, tp=4 replicates each on 2 ranks.
    num_heads, num_kv, head_dim = 8, 2, 3
    heads = attention_shard(num_heads, num_kv, tp)
    k_rows = num_kv * heads.kv_replicas * head_dim
    k = expand_kv_heads(torch.arange(num_kv * head_dim).float()[:, None], num_kv, heads.kv_replicas)
    assert k.shape[0] == k_rows
    for rank in range(tp):
        shard = Shard((num_heads * head_dim, k_rows, k_rows), 4, "column", rank, tp)
        q, kp, _ = shard.parts
        assert q.rows == heads.num_heads * head_dim and q.start == rank * q.rows
        assert kp.rows == heads.num_kv_heads * head_dim
        # Query head h reads KV head h // (num_heads / num_kv): this rank's KV rows are those.
        first_q_head = rank * heads.num_heads
        kv_head = first_q_head // (num_heads // num_kv)
        assert k[kp.kept, 0].tolist() == list(
            range(kv_head * head_dim, (kv_head + heads.num_kv_heads) * head_dim)
        )


def test_a_degree_that_does_not_divide_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"linear layers\.0\.qkv_proj: output part 2 is not divisible by tp=4"
    ):
        Shard((8, 2, 2), 8, "column", 0, 4, "layers.0.qkv_proj")
    with pytest.raises(ValueError, match=r"linear down: input size 10 is not divisible by tp=4"):
        LinearSpec(10, 4, False, "down", parallel="row", tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank 2 outside tp_size 2"):
        Shard((4,), 4, "column", 2, 2)
    # What a split leaves whole may be any size.
    assert Shard((7,), 8, "row", 1, 4).local_out_features == 7
    assert Shard((8,), 7, "column", 1, 4).local_in_features == 7


def test_spec_local_sizes_are_the_shards():
    spec = LinearSpec(9, 10, True, "qkv", (6, 2, 2), "column", tp_rank=1, tp_size=2)
    assert spec.shard == Shard((6, 2, 2), 9, "column", 1, 2, "qkv")
    assert (spec.local_output_sizes, spec.local_out_features, spec.local_in_features) == ((3, 1, 1), 5, 9)


def whole_layer(in_features: int, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    out = sum(sizes)
    weight = torch.arange(out * in_features, dtype=torch.float32).reshape(out, in_features)
    return weight, torch.arange(out, dtype=torch.float32) + 100


@pytest.mark.parametrize("fused_whole", [False, True])
def test_column_ranks_together_hold_the_whole_fused_layer(fused_whole):
    sizes, tp = (6, 2, 2), 2
    weight, bias = whole_layer(5, sizes)
    parts_w, parts_b = weight.split(sizes), bias.split(sizes)
    ranks = []
    for rank in range(tp):
        layer = default_linear(LinearSpec(5, 10, True, "qkv", sizes, "column", torch.float32, rank, tp))
        for param, whole, parts in [(layer.weight, weight, parts_w), (layer.bias, bias, parts_b)]:
            if fused_whole:
                param.weight_loader(param, whole, None)
            else:
                for i, t in enumerate(parts):
                    param.weight_loader(param, t, i)
        ranks.append(layer)
    # Rank r's local output is its slice of every part, in part order.
    x = torch.randn(2, 5)
    got = [layer(x).split((3, 1, 1), dim=-1) for layer in ranks]
    full = torch.nn.functional.linear(x, weight, bias).split(sizes, dim=-1)
    for i in range(len(sizes)):
        torch.testing.assert_close(torch.cat([g[i] for g in got], dim=-1), full[i])


def test_row_ranks_sum_to_the_whole_layer():
    weight, bias = whole_layer(6, (4,))
    total = 0
    for rank in range(3):
        layer = default_linear(LinearSpec(6, 4, True, "o", (4,), "row", torch.float32, rank, 3))
        layer.weight.weight_loader(layer.weight, weight, None)
        layer.bias.weight_loader(layer.bias, bias, None)
        assert bool(layer.bias.any()) == (rank == 0)
        total = total + layer(torch.ones(1, 2) * torch.arange(2 * rank, 2 * rank + 2))
    torch.testing.assert_close(total, torch.nn.functional.linear(torch.arange(6.0)[None], weight, bias))


def test_loaders_name_wrong_shapes_and_parts():
    layer = default_linear(LinearSpec(4, 6, True, "gate_up", (3, 3), "column", torch.float32, 0, 1))
    with pytest.raises(ValueError, match=r"part 1: expected shape \(3, 4\), got \(3, 5\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 5), 1)
    with pytest.raises(ValueError, match="shard 2 out of range"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match=r"expected 6 rows"):
        layer.bias.weight_loader(layer.bias, torch.zeros(5), None)


class Rows(QuantizedLinear):
    """The smallest quantized layer: int16 codes of its shard, cut by the base's helpers."""

    def __init__(self, spec: LinearSpec) -> None:
        super().__init__(spec)
        self.codes = self.loaded_parameter(
            torch.zeros(self.out_features, self.in_features, dtype=torch.int16), self.load
        )

    def load(self, param, loaded, shard_id):
        for part, tensor in self.parts(loaded, shard_id):
            param.data[part.local] = self.shard.cut(tensor, part).to(torch.int16)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_quantized_linear_base_keeps_the_same_shard_as_the_dense_layer(parallel):
    sizes, tp = (4, 2, 2), 2
    weight, bias = whole_layer(6, sizes)
    for rank in range(tp):
        spec = LinearSpec(6, 8, True, "qkv", sizes, parallel, torch.float32, rank, tp)
        dense, rows = default_linear(spec), Rows(spec)
        for layer, param in [(dense, dense.weight), (rows, rows.codes)]:
            param.weight_loader(param, weight, None)
            layer.bias.weight_loader(layer.bias, bias, None)
        assert torch.equal(rows.codes.float(), dense.weight) and torch.equal(rows.bias, dense.bias)
        assert (rows.in_features, rows.out_features) == tuple(dense.weight.shape)[::-1]
    with pytest.raises(ValueError, match="one tensor per part"):
        Rows(LinearSpec(6, 8, False, "qkv", sizes)).part(None)


def test_plugin_api_1_1_loaders_keep_what_the_shard_loader_keeps():
    weight, bias = whole_layer(6, (4, 2))
    for spec, legacy_w, legacy_b in [
        (
            LinearSpec(6, 6, True, "gate_up", (4, 2), "column", torch.float32, 1, 2),
            column_parallel_loader((4, 2), 1, 2),
            column_parallel_loader((4, 2), 1, 2),
        ),
        (
            LinearSpec(6, 6, True, "down", (6,), "row", torch.float32, 1, 3),
            row_parallel_loader(6, 1, 3, bias=False),
            row_parallel_loader(6, 1, 3, bias=True),
        ),
        (LinearSpec(6, 6, True, "qkv", (4, 2)), fused_weight_loader((4, 2)), fused_weight_loader((4, 2))),
    ]:
        ours, theirs = default_linear(spec), default_linear(spec)
        for layer, (load_w, load_b) in [
            (ours, (ours.weight.weight_loader, ours.bias.weight_loader)),
            (theirs, (legacy_w, legacy_b)),
        ]:
            load_w(layer.weight, weight, None)
            load_b(layer.bias, bias + 1, None)
        assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
