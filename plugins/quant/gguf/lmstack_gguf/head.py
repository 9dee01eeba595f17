"""The embedding and LM head as Q8_0 blocks.

The model builds them dense (outside the linear factory), so a GGUF's Q8_0 embedding arrives
dequantized. `quantize_q8_0_exact` rebuilds its blocks and keeps them only if they reproduce the
dense table exactly (they do for a table that came from Q8_0), so the logits do not change.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack_gguf.kernel import NATIVE_MAX_ROWS, quantize_q8_0_exact
from lmstack_gguf.linear import GGUFLinear

log = logging.getLogger(__name__)
Q8_0 = 8  # GGML type id


class BlockEmbedding(nn.Module):
    """An embedding lookup reading rows of a block table (shared with the tied head)."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, -1)


def block_table(
    weight: torch.Tensor, use_native: bool, int8_activations: bool = False, panels_from: int | None = None
) -> GGUFLinear | None:
    """weight [rows, cols] as a Q8_0 GGUFLinear cols -> rows, or None if Q8_0 cannot hold it exactly.
    With int8 activations the kernel takes every batch size: for a head it beats dequantizing the
    table per call at every size measured (README); the fp32 kernel only up to 32 rows.
    `panels_from`: batches from that many rows multiply by panels (`prefill: panels`)."""
    blocks = quantize_q8_0_exact(weight)
    if blocks is None:
        return None
    rows, cols = weight.shape
    spec = LinearSpec(cols, rows, False, "lm_head", params_dtype=torch.float32)
    limit = None if int8_activations else NATIVE_MAX_ROWS
    panels = panels_from is not None
    if panels:
        limit = panels_from - 1
    table = GGUFLinear(
        spec, use_native, int8_activations=int8_activations, kernel_max_rows=limit, panels=panels
    )
    table.set_blocks(Q8_0, blocks)
    return table if table.ggml_type is not None else None


def keep_embedding_and_head_as_blocks(
    model: nn.Module, use_native: bool, int8_activations: bool = False, panels_from: int | None = None
) -> list[str]:
    """Swap a plain `embed_tokens` / bias-free `lm_head` for Q8_0 block tables where that is
    exact; returns the names swapped (others stay dense, with a log line saying why)."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    swapped = []
    table = None
    if isinstance(embed, nn.Embedding):
        table = block_table(embed.weight.data, use_native, int8_activations, panels_from)
        if table is not None:
            model.embed_tokens = BlockEmbedding(table, embed.weight.dtype)
            swapped.append("embed_tokens")
    if isinstance(head, nn.Linear) and head.bias is None:
        tied = isinstance(embed, nn.Embedding) and head.weight is embed.weight
        head_table = (
            table if tied else block_table(head.weight.data, use_native, int8_activations, panels_from)
        )
        if head_table is not None:
            model.lm_head = head_table
            swapped.append("lm_head")
    if len(swapped) < 2:
        log.info(
            "lmstack-gguf: kept dense (not exactly Q8_0, or not plain modules): %s",
            sorted({"embed_tokens", "lm_head"} - set(swapped)),
        )
    return swapped
