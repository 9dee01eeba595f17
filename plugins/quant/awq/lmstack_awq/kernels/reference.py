"""The reference int4 kernel: dequantize the whole weight, then one dense matmul."""

from __future__ import annotations

import torch

from lmstack_awq.int4_math import dequantize_int4, unpack_nibbles


def dequantize_layer(layer, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_nibbles(layer.w_packed, layer.in_features)
    return dequantize_int4(codes, layer.w_scales, layer.w_zeros, layer.group_size, dtype)


class ReferenceKernel:
    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        return x @ dequantize_layer(layer, x.dtype).t()

    def codes(self, layer) -> torch.Tensor:
        return unpack_nibbles(layer.w_packed, layer.in_features)
