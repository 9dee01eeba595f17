"""The embedding and LM head as the file's blocks.

The model builds them dense (outside the linear factory), so a GGUF's embedding / output tensor
arrives dequantized. `watch_tables` (before the weights load) notes the GGUF tensor each one was
loaded from; a table whose type a layer keeps (`kernel.kept_types()`: Q4_0 / Q4_1 / Q8_0, the
K-quants and Q5_x, F16 / BF16) then becomes a `GGUFLinear` of those very bytes — a Q4_K_M
file's Q4_K embedding and Q6_K head stay packed (the head multiplies by `kq_matmul_q8` at every
batch size with int8 activations, else a slab at a time; the embedding dequantizes the rows it
gathers). A table not seen as a GGUF tensor falls back to `quantize_q8_0_exact`, which rebuilds
Q8_0 blocks and keeps them only if they reproduce the dense table exactly, so the logits do not
change; any other table stays dense, and a GGUF type no layer keeps is reported with its cost.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import GGUFTensor
from lmstack_gguf.kernel import FLOAT_TYPES, NATIVE_MAX_ROWS, kept_types, quantize_q8_0_exact
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


def watch_tables(model: nn.Module, seen: dict[int, GGUFTensor]) -> None:
    """Before the weights load: wrap the weight loaders of `embed_tokens` and `lm_head` so that
    `seen[id(param)]` keeps the GGUF tensor each loads (a tied pair shares one parameter)."""
    for name in ("embed_tokens", "lm_head"):
        param = getattr(getattr(model, name, None), "weight", None)
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "watched", False):
            continue

        def capture(p, loaded, *args, _loader=loader):
            if isinstance(loaded, GGUFTensor):
                seen[id(p)] = loaded
            return _loader(p, loaded, *args)

        capture.watched = True  # type: ignore[attr-defined]
        param.weight_loader = capture


def block_table(
    weight: torch.Tensor,
    use_native: bool,
    int8_activations: bool = False,
    panels_from: int | None = None,
    stored: GGUFTensor | None = None,
    slab_dtype: torch.dtype = torch.float32,
) -> GGUFLinear | None:
    """weight [rows, cols] as a GGUFLinear cols -> rows: the bytes of `stored` (the GGUF tensor it
    was loaded from) where a layer keeps that type, else Q8_0 blocks if Q8_0 holds it exactly,
    else None. With int8 activations the kernel takes every batch size: for a head it beats
    dequantizing the table per call at every size measured (README); the fp32 kernel only up to
    32 rows. `panels_from`: batches from that many rows multiply a Q4_x / Q8_0 table by panels
    (`prefill: panels`)."""
    rows, cols = weight.shape
    if stored is not None and int(stored.ggml_type) in kept_types() and stored.shape == (rows, cols):
        ggml_type, blocks = int(stored.ggml_type), stored.raw()
        if ggml_type in FLOAT_TYPES:
            blocks = blocks.view(FLOAT_TYPES[ggml_type])
    else:
        ggml_type, blocks = Q8_0, quantize_q8_0_exact(weight)
        if blocks is None:
            return None
    spec = LinearSpec(cols, rows, False, "lm_head", params_dtype=torch.float32)
    limit = None if int8_activations else NATIVE_MAX_ROWS
    panels = panels_from is not None
    if panels:
        limit = panels_from - 1
    table = GGUFLinear(
        spec,
        use_native,
        int8_activations=int8_activations,
        kernel_max_rows=limit,
        panels=panels,
        kq_max_rows=None,
        slab_dtype=slab_dtype,
    )
    table.set_blocks(ggml_type, blocks)
    return table if table.ggml_type is not None else None


def keep_embedding_and_head_as_blocks(
    model: nn.Module,
    use_native: bool,
    int8_activations: bool = False,
    panels_from: int | None = None,
    seen: dict[int, GGUFTensor] | None = None,
    slab_dtype: torch.dtype = torch.float32,
) -> tuple[list[str], dict[str, int]]:
    """Swap a plain `embed_tokens` / bias-free `lm_head` for block tables (`block_table`; `seen`:
    what `watch_tables` noted). Returns the names swapped (others stay dense, with a log line
    saying why) and, for a table left dense whose GGUF type no layer keeps, type name -> the
    bytes it costs over the file's."""
    seen = seen or {}
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    swapped: list[str] = []
    table = None

    def make(weight: torch.Tensor) -> GGUFLinear | None:
        return block_table(
            weight.data, use_native, int8_activations, panels_from, seen.get(id(weight)), slab_dtype
        )

    if isinstance(embed, nn.Embedding):
        table = make(embed.weight)
        if table is not None:
            model.embed_tokens = BlockEmbedding(table, embed.weight.dtype)
            swapped.append("embed_tokens")
    if isinstance(head, nn.Linear) and head.bias is None:
        tied = isinstance(embed, nn.Embedding) and head.weight is embed.weight
        head_table = table if tied else make(head.weight)
        if head_table is not None:
            model.lm_head = head_table
            swapped.append("lm_head")
    dequantized: dict[str, int] = {}
    counted: set[int] = set()  # a tied pair's one parameter
    for name, module in (("embed_tokens", embed), ("lm_head", head)):
        weight = getattr(module, "weight", None)
        stored = seen.get(id(weight))
        if name in swapped or stored is None or stored.ggml_type.name == "F32" or id(weight) in counted:
            continue
        counted.add(id(weight))
        cost = weight.numel() * weight.element_size() - stored.data.nbytes
        dequantized[stored.ggml_type.name] = dequantized.get(stored.ggml_type.name, 0) + cost
    if len(swapped) < 2:
        log.info(
            "lmstack-gguf: kept dense (no kept GGUF type and not exactly Q8_0, or not plain modules): %s",
            sorted({"embed_tokens", "lm_head"} - set(swapped)),
        )
    return swapped, dequantized
