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
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_nvfp4 import nvfp4


class Nvfp4Linear(QuantizedLinear):
    def __init__(
        self,
        spec: LinearSpec,
        from_checkpoint: bool,
        kernel: str,
        search: tuple[float, ...],
        input_scales: bool = False,
        interpret: bool = False,
    ) -> None:
        super().__init__(spec)
        self.from_checkpoint, self.kernel = from_checkpoint, kernel
        self.search, self.interpret = search, interpret
        out, parts = self.out_features, len(spec.output_sizes)
        # This rank's scale groups (ValueError where a row split cuts one).
        self.local_groups = self.shard.column_slice(nvfp4.GROUP, "nvfp4 groups")
        groups = self.local_groups.stop - self.local_groups.start
        packed = torch.zeros(out, groups * nvfp4.GROUP // 2, dtype=torch.uint8)
        scale = torch.zeros(out, groups, dtype=nvfp4.E4M3)
        gscale = torch.ones(parts, dtype=torch.float32)
        if from_checkpoint:
            self.weight_packed = self.loaded_parameter(packed, self._load_packed)
            self.weight_scale = self.loaded_parameter(scale, self._load_scale)
            self.weight_global_scale = self.loaded_parameter(gscale, self._load_global_scale)
            if input_scales:
                # W4A4 checkpoints calibrate activation scales; without FP4 tensor cores we keep
                # activations in the model dtype (as vLLM does on Hopper), so these go unused.
                self.input_global_scale = self.loaded_parameter(torch.ones(parts), self._load_global_scale)
        else:
            # A dense checkpoint's `weight` is quantized as it loads; its scales are buffers.
            self.weight = self.loaded_parameter(packed, self._quantize_dense)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("weight_global_scale", gscale)

    @property
    def packed(self) -> torch.Tensor:
        return self.weight_packed if self.from_checkpoint else self.weight

    # --- loading ------------------------------------------------------------------------------

    def _store(self, shard_id: int | None, packed: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """Keep this rank's rows and input groups of a whole part's codes / scales."""
        part, groups = self.part(shard_id), self.local_groups
        if packed is not None:
            # Eight bytes of codes a group; the last group's are zero-padded to whole.
            full = F.pad(packed, (0, nvfp4.padded_groups(self.spec.in_features) * 8 - packed.shape[1]))
            self.packed.data[part.local] = full[part.kept, groups.start * 8 : groups.stop * 8]
        if scale is not None:
            self.weight_scale.data[part.local] = scale[part.kept, groups]

    def _quantize_dense(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        part = self.part(shard_id)
        want = (part.size, self.spec.in_features)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expected shape {want}, got {tuple(loaded.shape)}")
        # The global and group scales come from the whole part: every tp split quantizes alike.
        packed, scale, gs = nvfp4.quantize(to_dense(loaded, torch.float32), search=self.search)
        self._store(shard_id, packed, scale)
        self.weight_global_scale[part.index] = gs[0]

    def _load_packed(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        want = (self.part(shard_id).size, -(-self.spec.in_features // 2))
        if tuple(loaded.shape) != want:
            raise ValueError(f"expected shape {want} (two e2m1 codes per byte), got {tuple(loaded.shape)}")
        if isinstance(loaded, GGUFTensor) or loaded.dtype != torch.uint8:
            raise ValueError(f"expected uint8 packed codes, got {getattr(loaded, 'dtype', loaded)}")
        self._store(shard_id, loaded, None)

    def _load_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        want = (self.part(shard_id).size, nvfp4.padded_groups(self.spec.in_features))
        if tuple(loaded.shape) != want:
            raise ValueError(
                f"expected shape {want} (one scale per {nvfp4.GROUP} inputs), got {tuple(loaded.shape)}"
            )
        scale = loaded if loaded.dtype == nvfp4.E4M3 else to_dense(loaded, torch.float32).to(nvfp4.E4M3)
        self._store(shard_id, None, scale)

    def _load_global_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        part = self.part(shard_id)
        value = to_dense(loaded, torch.float32).reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"expected one global scale, got shape {tuple(loaded.shape)}")
        param.data[part.index] = value[0]

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
