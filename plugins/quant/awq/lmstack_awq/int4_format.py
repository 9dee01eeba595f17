"""The checkpoint format of lmstack-awq: compressed-tensors `pack-quantized` int4.

`Int4WeightFormat` is what `lmstack quantize --method rtn-int4` and `--method awq` write (the
AWQ search calls `fake_quantize` / `encode` with its scaled weights). Tensors per linear:

- `weight_packed` int32 [out, ceil(in / 8)]: eight codes per word along the input, stored as
  signed values + 8 (compressed-tensors' `pack_to_int32`), element i in bits 4i..4i+3;
- `weight_scale` [out, groups] (float16);
- `weight_zero_point` int32 [ceil(out / 8), groups] (asymmetric only): zero points as signed
  values + 8, packed along the output dimension (`pack_to_int32(..., packed_dim=0)`);
- `weight_shape` int64 [2] = (out, in).

The dequantized weight is (code - zero) * scale with the partial-last-group rule of
`lmstack_awq.int4_math`.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from lmstack.errors import ConfigError
from lmstack.quant.formats import WeightFormat
from lmstack_awq.int4_math import (
    SYMMETRIC_ZERO,
    Int4Quantized,
    Int4Scheme,
    expand_groups,
    pack_nibbles,
    quantize_int4,
)

SCALE_DTYPE = torch.float16


def encode_ct(qw: Int4Quantized, symmetric: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors of a quantized weight."""
    out, cols = qw.q.shape
    signed = (qw.q.to(torch.int16) - SYMMETRIC_ZERO).to(torch.int8)
    tensors = {
        "weight_packed": pack_to_int32(signed, 4),
        "weight_scale": qw.scale.to(SCALE_DTYPE).contiguous(),
        "weight_shape": torch.tensor([out, cols], dtype=torch.int64),
    }
    if not symmetric:
        zero = (qw.zero.to(torch.int16) - SYMMETRIC_ZERO).to(torch.int8)
        tensors["weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    return tensors


def decode_ct_codes(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """`weight_packed` -> uint8 codes [out, in] (0..15)."""
    signed = unpack_from_int32(packed, 4, torch.Size(shape))
    return (signed.to(torch.int16) + SYMMETRIC_ZERO).to(torch.uint8)


def decode_ct_zero(zero_point: torch.Tensor, out: int, groups: int) -> torch.Tensor:
    """`weight_zero_point` -> uint8 zeros [out, groups] (0..15)."""
    # Unpacked along dim 1 of the transpose, copied into fresh strides: compressed-tensors'
    # own packed_dim=0 path views a transposed [1, groups] tensor as bytes and fails.
    words = torch.empty(zero_point.shape[1], zero_point.shape[0], dtype=torch.int32)
    words.copy_(zero_point.t())
    signed = unpack_from_int32(words, 4, torch.Size((groups, out)))
    return (signed.t().to(torch.int16) + SYMMETRIC_ZERO).to(torch.uint8)


def ct_packed_as_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`weight_packed` int32 [out, words] -> the in-memory uint8 nibble layout [out, words * 4]
    (`int4_math.pack_nibbles`): stored code = signed + 8 = our unsigned code, and on a
    little-endian host each word's bytes are already in column order."""
    return packed.contiguous().view(torch.uint8)


class Int4WeightFormat(WeightFormat):
    """int4 with group scales, written as compressed-tensors pack-quantized."""

    def __init__(self, method: str = "rtn-int4", scheme: Int4Scheme | None = None) -> None:
        self.method = method
        self.scheme = scheme or Int4Scheme()
        # Linears a calibrating search already rounded (GPTQ): module name -> its codes and
        # group parameters, which `encode` writes as they are (re-deriving the parameters from
        # the rounded weight would not give them back).
        self.rounded: dict[str, Int4Quantized] = {}

    def quantize(self, weight: torch.Tensor) -> Int4Quantized:
        return quantize_int4(weight, self.scheme, SCALE_DTYPE)

    def gptq(self, name: str, weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Round linear `name` by GPTQ against input second moment `h` [in, in]; keep the
        result for `encode` and return the rounded weight (fp32)."""
        from lmstack_awq.gptq import gptq_int4

        qw = gptq_int4(weight, h, self.scheme, SCALE_DTYPE)
        self.rounded[name] = qw
        return qw.dequantize(torch.float32)

    def tune_start(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`lmstack_calibrate.scale_tuning.ScaleTunable`: linear `name`'s codes less zero points (as GPTQ
        left them, else rounded to nearest now), scales and group size."""
        qw = self.rounded.get(name) or self.quantize(weight)
        self.rounded[name] = qw
        zero = expand_groups(qw.zero.float(), qw.q.shape[1], qw.group_size)
        return qw.q.float() - zero, qw.scale.float(), qw.group_size

    def tune_finish(self, name: str, scales: torch.Tensor) -> torch.Tensor:
        """Keep tuned `scales` (rounded to the stored fp16) with linear `name`'s frozen codes for
        `encode`; the served weight (fp32)."""
        qw = self.rounded[name]
        scale = scales.detach().to(SCALE_DTYPE).float()
        self.rounded[name] = Int4Quantized(qw.q, scale, qw.zero, qw.group_size)
        return self.rounded[name].dequantize(torch.float32)

    def encode(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if weight.dim() != 2:
            raise ConfigError(f"{name}: int4 encodes 2-D linear weights, got shape {tuple(weight.shape)}")
        qw = self.rounded.get(name)
        return encode_ct(qw if qw is not None else self.quantize(weight), self.scheme.symmetric)

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return self.quantize(weight).dequantize(torch.float32)

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        return ct_quantization_config(self.scheme, ignore)


def ct_quantization_config(scheme: Int4Scheme, ignore: list[str]) -> dict[str, Any]:
    grouped = scheme.group_size > 0
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "group" if grouped else "channel",
        "group_size": scheme.group_size if grouped else None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def ct_scheme(quantization: dict[str, Any]) -> Int4Scheme:
    """The int4 scheme of a compressed-tensors pack-quantized `quantization_config`; a
    ConfigError naming the scheme for what this plugin does not serve (other bit widths,
    float types, activation quantization, act-order, several different groups)."""
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for gname, group in groups.items():
        w = group.get("weights") or {}
        where = f"compressed-tensors config group {gname!r}"
        if group.get("input_activations") or group.get("output_activations"):
            raise ConfigError(f"{where} quantizes activations; lmstack-awq serves weight-only int4 (W4A16)")
        if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) != 4:
            raise ConfigError(
                f"{where}: {w.get('num_bits')}-bit {w.get('type')} weights; lmstack-awq serves 4-bit int"
            )
        if w.get("actorder") not in (None, False, "static", "weight"):
            raise ConfigError(f"{where}: actorder {w.get('actorder')!r} (g_idx) is not supported")
        strategy = w.get("strategy")
        if strategy == "group":
            size = int(w.get("group_size") or 0)
            if size <= 0 or size % 8:
                raise ConfigError(
                    f"{where}: group_size {w.get('group_size')!r} (want a positive multiple of 8)"
                )
        elif strategy == "channel":
            size = 0
        else:
            raise ConfigError(
                f"{where}: weight strategy {strategy!r}; lmstack-awq serves 'group' and 'channel'"
            )
        schemes.add(Int4Scheme(size, bool(w.get("symmetric", True))))
    if len(schemes) != 1:
        raise ConfigError(f"compressed-tensors checkpoint mixes int4 schemes {sorted(map(str, schemes))}")
    return schemes.pop()


__all__ = ["Int4WeightFormat", "ct_scheme", "pack_nibbles"]
