"""The embedding and LM head held compactly (the `lm_head` option of both quantizers).

SmolLM2-135M ties its 49152 x 576 embedding to the LM head: 28 M of its 135 M parameters. With
the linears in int4 a dense head alone would keep the model above 0.3x its bf16 bytes, so after
loading, `process_model` swaps `embed_tokens` and `lm_head` for modules sharing one compact
copy: "int8" (one scale per vocabulary row) or "int4" (an `Int4Linear` of the head, groups of
`group_size`). The embedding lookup dequantizes only the rows it gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack_awq.int4_math import Int4Scheme, dequantize_int4
from lmstack_awq.linear import Int4Linear


class Int8Rows(nn.Module):
    """A [rows, cols] matrix as int8 with one fp32 scale per row (symmetric, max|w| / 127)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("q", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.q[ids].float() * self.scale[ids, None]).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, cols] @ W^T -> [M, rows] in x's dtype."""
        # torch's CPU int8 op: its bf16 loops step 8 / 16 columns with no tail (a width that is
        # not a multiple of 16 crashes it on AVX2), and its fp32 path is ~3-60x slower than a
        # dense fp32 matmul (lmstack-int8's measurements), so fp32 decode rows run it in bf16.
        if (
            x.device.type == "cpu"
            and self.q.shape[1] % 16 == 0
            and x.dtype in (torch.float32, torch.bfloat16)
        ):
            if x.dtype == torch.bfloat16:
                return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale.to(x.dtype))
            if x.shape[0] < 16:
                xb = x.to(torch.bfloat16).contiguous()
                return torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale.to(torch.bfloat16)).float()
        # Elsewhere: dequantize a slab of rows at a time (bounded temporary memory).
        out = torch.empty(x.shape[0], self.q.shape[0], dtype=x.dtype, device=x.device)
        step = 8192
        for r in range(0, self.q.shape[0], step):
            w = self.q[r : r + step].to(x.dtype) * self.scale[r : r + step, None].to(x.dtype)
            out[:, r : r + step] = x @ w.t()
        return out


class Int4Rows(nn.Module):
    """A [rows, cols] matrix as an `Int4Linear` (its CPU / Triton kernels for the head)."""

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        super().__init__()
        rows, cols = weight.shape
        spec = LinearSpec(cols, rows, False, "lm_head", params_dtype=torch.float32)
        with torch.device(weight.device):
            self.linear = Int4Linear(spec, Int4Scheme(group_size, symmetric=False), "dense")
        self.linear.weight.weight_loader(self.linear.weight, weight, None)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lin = self.linear
        if lin.kernel is None:
            lin.prepare()  # the kernel says how its rows read back (as the head multiplies by them)
        row_values = getattr(lin.kernel, "row_values", None)
        if row_values is not None:
            return row_values(lin, ids, dtype)
        codes = lin.row_codes(ids)
        return dequantize_int4(codes, lin.w_scales[ids], lin.w_zeros[ids], lin.group_size, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class CompactEmbedding(nn.Module):
    def __init__(self, table: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, -1)


class CompactHead(nn.Module):
    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self.table.matmul(x.reshape(-1, x.shape[-1]))
        return out.reshape(*lead, -1)


def compact_table(weight: torch.Tensor, mode: str, group_size: int) -> nn.Module:
    return Int8Rows(weight) if mode == "int8" else Int4Rows(weight, group_size)


def compact_embedding_and_head(model: nn.Module, mode: str, group_size: int) -> bool:
    """Swap `model.embed_tokens` / `model.lm_head` for compact ones; False (nothing changed) when
    the model does not have them as a plain full-vocabulary embedding and linear (e.g. a
    tensor-parallel head)."""
    if mode == "dense":
        return False
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
        return False
    if head.weight.shape != embed.weight.shape:
        return False
    dtype = embed.weight.dtype
    tied = head.weight is embed.weight
    table = compact_table(embed.weight.data, mode, group_size)
    head_table = table if tied else compact_table(head.weight.data, mode, group_size)
    model.embed_tokens = CompactEmbedding(table, dtype)
    model.lm_head = CompactHead(head_table)
    return True
