"""`Int4Linear`: a linear layer whose weight stays int4 in memory.

Storage (this rank's shard): `w_packed` uint8 [out, ceil(in / 8) * 4] (two codes per byte, even
column in the low nibble: `int4_math.pack_nibbles`), `w_scales` float16 [out, groups], `w_zeros` uint8
[out, groups]; w = (code - zero) * scale. A kernel may re-lay `w_packed` out once before its first
use (`lmstack_awq.kernels`), so the module never holds two copies of the weight; one whose layout
holds the scales and zeros too (the CPU blocks) empties `w_scales` / `w_zeros`.

The weight loaders take whatever the checkpoint stores and write rows of these buffers:

- "dense" (rtn-int4): `weight` as a dense or GGUF tensor, quantized on arrival;
- "ct": compressed-tensors `weight_packed` / `weight_scale` / `weight_zero_point` / `weight_shape`;
- "autoawq": AutoAWQ GEMM `qweight` / `qzeros` / `scales`.

Each loader's parameter is an empty placeholder whose only job is to carry the loader, so the
model's completeness check names a missing tensor (e.g. `weight_scale`) before serving.
Under tensor parallelism the loaders receive whole tensors and keep this rank's rows (column)
or input columns (row; the split must fall on group boundaries).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, to_dense
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_awq import kernels
from lmstack_awq.autoawq import unpack_autoawq
from lmstack_awq.int4_format import SCALE_DTYPE, decode_ct_codes, decode_ct_zero
from lmstack_awq.int4_math import SYMMETRIC_ZERO, Int4Scheme, num_groups, pack_nibbles, quantize_int4

Source = Literal["dense", "ct", "autoawq"]

_SOURCE_PARAMS: dict[str, tuple[str, ...]] = {
    "dense": ("weight",),
    "ct": ("weight_packed", "weight_scale", "weight_shape"),
    "autoawq": ("qweight", "qzeros", "scales"),
}


class Int4Linear(QuantizedLinear):
    def __init__(self, spec: LinearSpec, scheme: Int4Scheme, source: Source) -> None:
        super().__init__(spec)
        self.scheme, self.source = scheme, source
        self.group_size = scheme.effective_group(spec.in_features)
        self.shard.column_slice(self.group_size, "int4 groups")  # ValueError where a row split cuts a group
        self.groups = num_groups(self.in_features, self.group_size)
        out = self.out_features
        self.register_buffer("w_packed", torch.zeros(out, -(-self.in_features // 8) * 4, dtype=torch.uint8))
        self.register_buffer("w_scales", torch.zeros(out, self.groups, dtype=SCALE_DTYPE))
        self.register_buffer("w_zeros", torch.full((out, self.groups), SYMMETRIC_ZERO, dtype=torch.uint8))
        names = _SOURCE_PARAMS[source]
        if source == "ct" and not scheme.symmetric:
            names = (*names, "weight_zero_point")
        for name in names:
            setattr(self, name, self.loaded_parameter(torch.empty(0), self._loader(name)))
        self._kernel: kernels.Int4Kernel | None = None
        # ((op, args) fp32, (op, args) int8, most rows): decode rows straight to the kernel's
        # C++ op, set with the kernel (`Int4Kernel.direct`).
        self._direct: tuple | None = None
        # fp32 activations on the CPU computed exactly (else small batches run the op in bf16):
        # the quantizer's `fp32_activations` option.
        self.exact_fp32 = False
        # fp32 decode batches through lmstack-gguf's kernel with x rounded to int8 per 32 values
        # (`fp32_activations: int8`; kernels/gguf_blocks.py).
        self.int8_activations = False
        # On a native-bf16 CPU, keep a bf16 copy for batches over 16 rows (`cpu_bf16_copy`).
        self.bf16_copy = False

    # --- where a part's rows and this rank's columns go ---------------------------------------

    def _put(self, buffer: torch.Tensor, shard_id: int | None, value: torch.Tensor, per: int) -> None:
        """Write `value` (what one loader call got, decoded to [rows, columns]: a part, or a whole
        fused tensor) into `buffer`'s rows of its part(s), keeping this rank's rows and columns;
        `per` input columns per value column (1 for codes, group_size for scales and zeros)."""
        rows = self._rows_loaded(shard_id)
        if value.shape[0] != rows:
            raise ValueError(f"expected {rows} output rows, got {value.shape[0]}")
        for part, whole in self.parts(value, shard_id):
            mine = self.shard.cut(whole, part, per)
            if per == 1:
                mine = pack_nibbles(mine)
            buffer[part.local].copy_(mine.to(buffer.device, buffer.dtype))

    def _rows_loaded(self, shard_id: int | None) -> int:
        """Output rows of the tensor one loader call gets: a part's, or a whole fused layer's."""
        return self.spec.out_features if shard_id is None else self.shard.part(shard_id).size

    def _store_quantized(self, shard_id: int | None, codes, scale, zero) -> None:
        total_groups = num_groups(self.spec.in_features, self.group_size)
        if codes.shape[1] != self.spec.in_features or scale.shape[1] != total_groups:
            raise ValueError(
                f"expected [*, {self.spec.in_features}] weights in {total_groups} groups, "
                f"got {tuple(codes.shape)} with {scale.shape[1]} groups"
            )
        self._put(self.w_packed, shard_id, codes, 1)
        self._put(self.w_scales, shard_id, scale, self.group_size)
        self._put(self.w_zeros, shard_id, zero, self.group_size)

    # --- loaders ----------------------------------------------------------------------------------

    def _loader(self, name: str):
        def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
            self.kernel = None  # new data: any re-laid copy is stale
            if name == "weight":
                w = to_dense(loaded, torch.float32)
                if w.dim() != 2:
                    raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
                qw = quantize_int4(w, self.scheme, SCALE_DTYPE)
                self._store_quantized(shard_id, qw.q, qw.scale, qw.zero)
            elif name in ("qweight", "qzeros", "scales"):
                self._load_autoawq(name, loaded, shard_id)
            else:
                self._load_ct(name, loaded, shard_id)

        return load

    def _load_ct(self, name: str, loaded: CheckpointTensor, shard_id: int | None) -> None:
        t = to_dense(loaded, torch.float32) if name == "weight_scale" else loaded
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a safetensors tensor")
        full = self._rows_loaded(shard_id)
        total_groups = num_groups(self.spec.in_features, self.group_size)
        if name == "weight_shape":
            want = [full, self.spec.in_features]
            if t.tolist() != want:
                raise ValueError(f"weight_shape {t.tolist()} does not match config.json's {want}")
        elif name == "weight_packed":
            words = -(-self.spec.in_features // 8)
            if t.dtype != torch.int32 or tuple(t.shape) != (full, words):
                raise ValueError(f"expected int32 [{full}, {words}], got {t.dtype} {list(t.shape)}")
            self._put(self.w_packed, shard_id, decode_ct_codes(t, (full, self.spec.in_features)), 1)
        elif name == "weight_scale":
            if tuple(t.shape) != (full, total_groups):
                raise ValueError(
                    f"expected [{full}, {total_groups}] (group {self.group_size}), got {list(t.shape)}"
                )
            self._put(self.w_scales, shard_id, t, self.group_size)
        elif name == "weight_zero_point":
            if t.dtype != torch.int32 or tuple(t.shape) != (-(-full // 8), total_groups):
                raise ValueError(
                    f"expected int32 [{-(-full // 8)}, {total_groups}], got {t.dtype} {list(t.shape)}"
                )
            self._put(self.w_zeros, shard_id, decode_ct_zero(t, full, total_groups), self.group_size)

    def _load_autoawq(self, name: str, loaded: CheckpointTensor, shard_id: int | None) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{name} must be a safetensors tensor")
        full = self._rows_loaded(shard_id)
        codes, per = unpack_autoawq(name, loaded, full, self.spec.in_features, self.group_size)
        buffer = {"qweight": self.w_packed, "qzeros": self.w_zeros, "scales": self.w_scales}[name]
        self._put(buffer, shard_id, codes, per)

    # --- compute ----------------------------------------------------------------------------------

    def codes(self) -> torch.Tensor:
        """uint8 codes [out, in] of this rank's shard (from whatever layout the kernel keeps)."""
        if self.kernel is not None:
            return self.kernel.codes(self)
        return kernels.unpack_codes(self.w_packed, self.in_features)

    def row_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 codes [len(ids), in] of output rows `ids` (the embedding lookup of an int4 head)."""
        if self.kernel is None:
            self.kernel = kernels.select(self, torch.empty(0, device=self.w_packed.device))
        if hasattr(self.kernel, "row_codes"):
            return self.kernel.row_codes(self, ids)
        return kernels.unpack_codes(self.w_packed[ids], self.in_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from lmstack_awq.int4_math import dequantize_int4

        if self.kernel is not None and hasattr(self.kernel, "dequantized"):
            return self.kernel.dequantized(self).to(dtype)  # the layout it keeps may hold the scales
        return dequantize_int4(self.codes(), self.w_scales, self.w_zeros, self.group_size, dtype)

    @property
    def kernel(self) -> kernels.Int4Kernel | None:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: kernels.Int4Kernel | None) -> None:
        self._kernel = kernel
        direct = getattr(kernel, "direct", None)
        self._direct = direct(self) if direct is not None else None

    def prepare(self) -> None:
        """Pick the kernel (and let it re-lay the weight out) now, at load, for the serving dtype.
        An all-zero bias is dropped: a bias-corrected folder gives q/k/v and gate/up zero biases
        (a Llama config biases all of a kind), which would only cost an add per call."""
        if self.bias is not None and not bool(self.bias.any()):
            self.bias = None
        if self.kernel is None:
            probe = torch.empty(
                0, self.in_features, dtype=self.spec.params_dtype, device=self.w_packed.device
            )
            self.kernel = kernels.select(self, probe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if (
            direct is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.stride(1) == 1
            and x.shape[0] <= direct[2]
        ):
            # Decode rows: the generic path below (reshapes, the kernel object's checks) cost
            # ~8 us a call, ~10 % of a batch-1 token at 120 linears (measured on Zen 4).
            op, args = direct[self.int8_activations]
            out = op(x, *args)
            return out if self.bias is None else out + self.bias
        if self.kernel is None:
            self.kernel = kernels.select(self, x)
        lead = x.shape[:-1]
        out = self.kernel(self, x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
            f"symmetric={self.scheme.symmetric}, source={self.source}"
        )
