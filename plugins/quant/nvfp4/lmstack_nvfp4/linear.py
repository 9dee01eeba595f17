"""The NVFP4 linear layer: packed e2m1 codes, e4m3 scales per 16 inputs and a global scale per
checkpoint tensor (part of a fused projection), filled from an nvfp4-pack-quantized checkpoint
or by quantizing a dense one as it loads.

Stored (local shard): codes [out, groups * 8] uint8 (the last group zero-padded), scales
[out, groups] e4m3, global scales [parts] fp32. Kernels: `dequant` widens the weight to the
model dtype for each call and runs a plain matmul (the CPU path, and the reference); `triton`
is the dequantizing GEMM of `lmstack_nvfp4.kernel` (CUDA, or the Triton interpreter in tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.tp_shard import bias_rows, input_columns, part_rows
from lmstack.model.weight_loader import set_weight_loader
from lmstack_nvfp4 import nvfp4


def _shape(t: CheckpointTensor) -> tuple[int, ...]:
    return tuple(t.shape)


class Nvfp4Linear(nn.Module):
    def __init__(
        self,
        spec: LinearSpec,
        from_checkpoint: bool,
        kernel: str,
        search: tuple[float, ...],
        input_scales: bool = False,
        interpret: bool = False,
    ) -> None:
        super().__init__()
        self.spec, self.from_checkpoint, self.kernel = spec, from_checkpoint, kernel
        self.search, self.interpret = search, interpret
        out, parts = spec.local_out_features, len(spec.output_sizes)
        if spec.parallel == "row" and spec.tp_size > 1 and spec.local_in_features % nvfp4.GROUP:
            raise ValueError(
                f"linear {spec.name}: nvfp4 splits inputs in groups of {nvfp4.GROUP}, and "
                f"{spec.local_in_features} inputs per rank is not a multiple"
            )
        groups = nvfp4.padded_groups(spec.local_in_features)
        packed = nn.Parameter(
            torch.zeros(out, groups * nvfp4.GROUP // 2, dtype=torch.uint8), requires_grad=False
        )
        scale = torch.zeros(out, groups, dtype=nvfp4.E4M3)
        gscale = torch.ones(parts, dtype=torch.float32)
        if from_checkpoint:
            self.weight_packed = set_weight_loader(packed, self._load_packed, parts)
            self.weight_scale = set_weight_loader(
                nn.Parameter(scale, requires_grad=False), self._load_scale, parts
            )
            self.weight_global_scale = set_weight_loader(
                nn.Parameter(gscale, requires_grad=False), self._load_global_scale, parts
            )
            if input_scales:
                # W4A4 checkpoints calibrate activation scales; without FP4 tensor cores we keep
                # activations in the model dtype (as vLLM does on Hopper), so these go unused.
                self.input_global_scale = set_weight_loader(
                    nn.Parameter(torch.ones(parts), requires_grad=False), self._load_global_scale, parts
                )
        else:
            # A dense checkpoint's `weight` is quantized as it loads; its scales are buffers.
            self.weight = set_weight_loader(packed, self._quantize_dense, parts)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("weight_global_scale", gscale)
        self.bias: nn.Parameter | None = None
        if spec.bias:
            self.bias = nn.Parameter(torch.empty(out, dtype=spec.params_dtype), requires_grad=False)
            set_weight_loader(self.bias, self._load_bias, num_shards=parts)

    @property
    def packed(self) -> torch.Tensor:
        return self.weight_packed if self.from_checkpoint else self.weight

    # --- loading ------------------------------------------------------------------------------

    def _part(self, shard_id: int | None) -> tuple[int, int, int, int]:
        """(local offset, first checkpoint row, rows, the part's whole size)."""
        if shard_id is None and len(self.spec.output_sizes) > 1:
            raise ValueError("expected one tensor per part of the fused projection")
        offset, start, rows = part_rows(self.spec, shard_id)
        return offset, start, rows, self.spec.output_sizes[shard_id or 0]

    def _store(self, shard_id: int | None, packed: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """Keep this rank's rows and input groups of a whole part's codes / scales."""
        offset, start, rows, _ = self._part(shard_id)
        col, cols = input_columns(self.spec)
        g0, g = col // nvfp4.GROUP, nvfp4.padded_groups(cols)
        if packed is not None:
            full = F.pad(packed, (0, nvfp4.padded_groups(self.spec.in_features) * 8 - packed.shape[1]))
            self.packed.data[offset : offset + rows] = full[start : start + rows, g0 * 8 : (g0 + g) * 8]
        if scale is not None:
            self.weight_scale.data[offset : offset + rows] = scale[start : start + rows, g0 : g0 + g]

    def _quantize_dense(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        _, _, _, size = self._part(shard_id)
        want = (size, self.spec.in_features)
        if _shape(loaded) != want:
            raise ValueError(f"expected shape {want}, got {_shape(loaded)}")
        # The global and group scales come from the whole part: every tp split quantizes alike.
        packed, scale, gs = nvfp4.quantize(to_dense(loaded, torch.float32), search=self.search)
        self._store(shard_id, packed, scale)
        self.weight_global_scale[shard_id or 0] = gs[0]

    def _load_packed(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        _, _, _, size = self._part(shard_id)
        want = (size, -(-self.spec.in_features // 2))
        if _shape(loaded) != want:
            raise ValueError(f"expected shape {want} (two e2m1 codes per byte), got {_shape(loaded)}")
        if isinstance(loaded, GGUFTensor) or loaded.dtype != torch.uint8:
            raise ValueError(f"expected uint8 packed codes, got {getattr(loaded, 'dtype', loaded)}")
        self._store(shard_id, loaded, None)

    def _load_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        _, _, _, size = self._part(shard_id)
        want = (size, nvfp4.padded_groups(self.spec.in_features))
        if _shape(loaded) != want:
            raise ValueError(
                f"expected shape {want} (one scale per {nvfp4.GROUP} inputs), got {_shape(loaded)}"
            )
        scale = loaded if loaded.dtype == nvfp4.E4M3 else to_dense(loaded, torch.float32).to(nvfp4.E4M3)
        self._store(shard_id, None, scale)

    def _load_global_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        self._part(shard_id)
        value = to_dense(loaded, torch.float32).reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"expected one global scale, got shape {_shape(loaded)}")
        param.data[shard_id or 0] = value[0]

    def _load_bias(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        offset, start, rows, size = self._part(shard_id)
        param.data[offset : offset + rows] = bias_rows(
            self.spec, to_dense(loaded, param.dtype), size, start, rows
        )

    # --- computing ----------------------------------------------------------------------------

    def row_factors(self) -> torch.Tensor:
        """1 / global scale of each local output row's part."""
        sizes = torch.tensor(self.spec.local_output_sizes, device=self.weight_global_scale.device)
        return torch.repeat_interleave(1.0 / self.weight_global_scale, sizes)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        w = nvfp4.dequantize(self.packed, self.weight_scale, self.row_factors(), self.spec.local_in_features)
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.kernel == "triton":
            from lmstack_nvfp4.kernel import nvfp4_matmul

            out = nvfp4_matmul(x2, self.packed, self.weight_scale, self.row_factors(), self.interpret)
        else:
            out = F.linear(x2, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, -1)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.local_in_features} -> {s.local_out_features}, nvfp4 (e2m1, e4m3/16), kernel={self.kernel}"
