"""The embedding and LM head as int8 rows (the quantizer's `lm_head: int8`).

The model builds both dense (the head is not made through the quantizer's linear factory); on
SmolLM2-135M the tied 49152 x 576 table is 28 M of 135 M parameters, so after loading they are
replaced by one `Int8Linear` of the table: the head multiplies by it with the layers' kernel,
the embedding lookup dequantizes only the rows it gathers. A tied pair keeps one copy.
"""

from __future__ import annotations

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack_int8.linear import Int8Linear


class Int8Embedding(nn.Module):
    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, -1)


def int8_table(
    weight: torch.Tensor, exact_fp32: bool, use_native: bool = True, int8_activations: bool = False
) -> Int8Linear:
    """weight [rows, cols] (dense, the serving dtype) -> an Int8Linear cols -> rows."""
    rows, cols = weight.shape
    spec = LinearSpec(cols, rows, False, "lm_head", params_dtype=weight.dtype)
    with torch.device(weight.device):
        table = Int8Linear(spec, exact_fp32, use_native, int8_activations)
    table.weight.weight_loader(table.weight, weight, None)
    return table


def quantize_embedding_and_head(
    model: nn.Module, exact_fp32: bool, use_native: bool = True, int8_activations: bool = False
) -> list[str]:
    """Swap a plain `embed_tokens` (nn.Embedding) and `lm_head` (nn.Linear without bias) for
    int8 ones; returns the names swapped. Others (a tensor-parallel vocabulary shard, a head
    with a bias) stay as they are."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    embed_ok = isinstance(embed, nn.Embedding)
    head_ok = isinstance(head, nn.Linear) and head.bias is None
    swapped = []
    embed_table = None
    if embed_ok:
        embed_table = int8_table(embed.weight.data, exact_fp32, use_native, int8_activations)
        model.embed_tokens = Int8Embedding(embed_table, embed.weight.dtype)
        swapped.append("embed_tokens")
    if head_ok:
        tied = embed_ok and head.weight is embed.weight
        model.lm_head = (
            embed_table if tied else int8_table(head.weight.data, exact_fp32, use_native, int8_activations)
        )
        swapped.append("lm_head")
    return swapped
