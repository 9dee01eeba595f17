"""The FP8 linear layer: e4m3 weights with one fp32 scale per output row, filled either from a
float-quantized checkpoint (`weight`, `weight_scale`, maybe `input_scale`) or by quantizing a
dense checkpoint's weights as they load.

Three kernels compute it:
- `scaled_mm` (the CUDA default), W8A8 as the checkpoint's scheme says: activations quantized to
  e4m3 (per token, or with the static input scale) and `torch._scaled_mm` with row-wise scales,
  accumulated in fp32 by the fp8 tensor cores.
- `emulate`: the same W8A8 arithmetic without an fp8 matmul (activations rounded through e4m3,
  weight widened and scaled per row, a plain matmul): the reference `scaled_mm` is tested
  against, and a way to measure W8A8 quality on the CPU.
- `dequant` (the CPU default): weight-only. The weight is widened to the model dtype and scaled
  per row; activations stay in the model dtype, as vLLM serves FP8 checkpoints on GPUs without
  FP8 matmuls. The CPU has none either, and on SmolLM2 the activations' rounding costs more
  perplexity than the weights' (README).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_fp8 import fp8
from lmstack_fp8.scheme import Fp8Scheme


class Fp8Linear(QuantizedLinear):
    def __init__(self, spec: LinearSpec, scheme: Fp8Scheme, from_checkpoint: bool, kernel: str) -> None:
        super().__init__(spec)
        self.scheme, self.from_checkpoint, self.kernel = scheme, from_checkpoint, kernel
        out, inp, parts = self.out_features, self.in_features, len(spec.output_sizes)
        self.weight = self.loaded_parameter(torch.empty(out, inp, dtype=fp8.FP8), self._load_weight)
        scale = torch.ones(out, dtype=torch.float32)
        if from_checkpoint:
            self.weight_scale = self.loaded_parameter(scale, self._load_weight_scale)
        else:
            self.register_buffer("weight_scale", scale)  # computed while `weight` loads
        self.input_scale: nn.Parameter | None = None
        if from_checkpoint and scheme.activations == "static":
            # One calibrated scale per part; the parts share their input, so the largest serves all.
            self.input_scale = self.loaded_parameter(torch.zeros(parts), self._load_input_scale)

    # --- loading ------------------------------------------------------------------------------

    def _load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        part = self.part(shard_id)
        want = (part.size, self.spec.in_features)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expected shape {want}, got {tuple(loaded.shape)}")
        if self.from_checkpoint:
            if isinstance(loaded, GGUFTensor) or loaded.dtype != fp8.FP8:
                raise ValueError(f"expected float8_e4m3fn weights, got {getattr(loaded, 'dtype', loaded)}")
            value = loaded
        else:
            # Scales come from whole rows, so every tensor-parallel split quantizes alike.
            value, scale = fp8.quantize_weight(to_dense(loaded, torch.float32), per_channel=True)
            self.weight_scale[part.local] = scale[part.kept, 0]
        param.data[part.local] = self.shard.cut(value, part)

    def _load_weight_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        part = self.part(shard_id)
        scale = to_dense(loaded, torch.float32).reshape(-1)
        want = part.size if self.scheme.per_channel_weights else 1
        if scale.numel() != want:
            kind = "per-channel" if want > 1 else "per-tensor"
            raise ValueError(
                f"expected {want} {kind} scales (as the config says), got shape {tuple(loaded.shape)}"
            )
        param.data[part.local] = scale[part.kept] if want > 1 else scale.expand(part.rows)

    def _load_input_scale(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        part = self.part(shard_id)
        scale = to_dense(loaded, torch.float32).reshape(-1)
        if scale.numel() != 1:
            raise ValueError(f"expected one per-tensor input scale, got shape {tuple(loaded.shape)}")
        param.data[part.index] = scale[0]

    # --- computing ----------------------------------------------------------------------------

    def _activation_scales(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            return self.input_scale.max().expand(x.shape[0], 1)
        return fp8.token_scales(x)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        # _scaled_mm wants both matmul sizes in multiples of 16; other layers take the reference.
        n, k = self.weight.shape
        return (
            self.kernel == "scaled_mm" and self.scheme.activations != "none" and n % 16 == 0 and k % 16 == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self._use_scaled_mm(x2):
            if x2.is_cuda and self.input_scale is None and x2.stride(1) == 1:
                # Dynamic scales on the GPU: one fused kernel instead of nine torch ops.
                from lmstack_fp8.quantize_kernel import quantize_tokens

                qx, sx = quantize_tokens(x2)
            else:
                sx = self._activation_scales(x2)
                qx = fp8.to_fp8(x2, sx)
            # Row-wise scaling on CUDA needs a bf16 result; the cast back is exact for bf16.
            out_dtype = torch.bfloat16 if x2.is_cuda else x2.dtype
            out = torch._scaled_mm(
                qx,
                self.weight.t(),
                scale_a=sx.contiguous(),
                scale_b=self.weight_scale.reshape(1, -1),
                out_dtype=out_dtype,
            ).to(x.dtype)
        else:
            if self.kernel == "emulate" and self.scheme.activations != "none":
                x2 = fp8.fake_quantize_activations(
                    x2, None if self.input_scale is None else self.input_scale.max()
                )
            out = F.linear(x2, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, -1)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.local_in_features} -> {s.local_out_features}, fp8 e4m3, activations={self.scheme.activations}, kernel={self.kernel}"
