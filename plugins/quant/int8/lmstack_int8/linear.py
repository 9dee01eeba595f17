"""`Int8Linear`: a linear layer holding `weight` as int8 [out, in] (this rank's shard) and
`weight_scale` fp32 [out], one symmetric scale per output row (`kernel.quantize_rows`).

Its weight loader takes a dense or GGUF checkpoint tensor (one part of a fused projection, or
a whole one), decodes this rank's rows to fp32 and quantizes them as they arrive, so a
dense copy of the layer never exists. Scales come from whole rows before a row-parallel rank
keeps its input columns: every tensor-parallel split holds exactly the whole layer's values.
"""

from __future__ import annotations

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, to_dense
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_int8.kernel import Int8Matmul, dequantize_rows, native_kernel, quantize_rows


class Int8Linear(QuantizedLinear):
    def __init__(
        self,
        spec: LinearSpec,
        exact_fp32: bool = False,
        use_native: bool = True,
        int8_activations: bool = False,
    ) -> None:
        super().__init__(spec)
        self.weight = self.loaded_parameter(
            torch.zeros(self.out_features, self.in_features, dtype=torch.int8), self._load_weight
        )
        self.register_buffer("weight_scale", torch.zeros(self.out_features, dtype=torch.float32))
        self.matmul = Int8Matmul(exact_fp32, use_native, int8_activations)
        # (kernel, weight, scales, most rows) bound at the first call after loading, or False
        # without the kernel: a module's parameter / buffer lookups and `Int8Matmul.path`'s checks cost
        # ~30 us a call, more than the kernel itself for a small layer at batch 1.
        self._fast: tuple | bool | None = None

    # --- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        self.matmul.reset()
        self._fast = None
        for part, tensor in self.parts(loaded, shard_id):
            want = (part.size, self.spec.in_features)
            if tuple(tensor.shape) != want:
                raise ValueError(f"expected shape {want}, got {tuple(tensor.shape)}")
            q, scale = quantize_rows(to_dense(self.kept_rows(tensor, part), torch.float32))
            param.data[part.local] = q[:, self.shard.columns].to(param.device)
            self.weight_scale[part.local] = scale.to(self.weight_scale.device)

    # --- computing ----------------------------------------------------------------------------

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Output rows `ids` of the weight, dequantized (the embedding lookup of an int8 table)."""
        return dequantize_rows(self.weight[ids], self.weight_scale[ids], dtype)

    def _bind(self) -> tuple | bool:
        ext = native_kernel() if self.matmul.use_native and self.weight.device.type == "cpu" else None
        if ext is None:
            self._fast = False
        else:
            k = self.in_features
            self._fast = (
                self.matmul.native_fn(ext, k),
                self.weight.data,
                self.weight_scale,
                self.matmul.native_max_rows(k),
            )
        return self._fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast if self._fast is not None else self._bind()
        if (
            fast
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.stride(1) == 1
            and x.shape[0] <= fast[3]
            and self.bias is None
        ):
            return fast[0](x, fast[1], fast[2])  # the "native" path of `Int8Matmul`, without its checks
        lead = x.shape[:-1]
        out = self.matmul(x.reshape(-1, self.in_features), self.weight, self.weight_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-row scales"
