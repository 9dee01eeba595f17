"""NVFP4 arithmetic, in compressed-tensors' nvfp4-pack-quantized layout.

A weight [out, in] is cut into groups of 16 consecutive inputs. Each value is an e2m1 code
(sign bit 3, magnitude index 0-7 into E2M1 below); two codes share a byte, the even column in
the low nibble. Each group has an e4m3 scale, and each tensor a global fp32 scale that the
group scales were multiplied by, so (as compressed-tensors' `dequantize` computes)

    weight = E2M1[code] * weight_scale / weight_global_scale

with weight_global_scale = 448 * 6 / absmax(tensor), which spreads the group scales over the
e4m3 range. An input size that is not a multiple of 16 ends in a partial group; our in-memory
layout pads it with zero codes so every row holds whole groups.
"""

from __future__ import annotations

import torch

GROUP = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MAX = 6.0
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
# Magnitudes halfway between neighbouring E2M1 values: a magnitude rounds to the index of the
# number of midpoints below it (ties to the even-mantissa neighbour, as compressed-tensors).
_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2


def padded_groups(in_features: int) -> int:
    return -(-in_features // GROUP)


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    """The tensor's global scale [1] (fp32): group scales then use e4m3's whole range."""
    amax = weight.float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return (E4M3_MAX * E2M1_MAX / amax).reshape(1)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0-15) of the E2M1 values nearest to `x` (already divided by its scale)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    mids = _MIDPOINTS.to(x.device)
    index = torch.bucketize(mag, mids)  # a midpoint itself gets the lower index
    # ... and goes to the even-index neighbour instead (round half to even mantissa).
    tie = (index < len(mids)) & (mag == mids[index.clamp(max=len(mids) - 1)]) & (index % 2 == 1)
    index = torch.where(tie, index + 1, index)
    return (index | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes."""
    c = codes.to(torch.int64)
    mag = E2M1.to(codes.device)[c & 7]
    return torch.where(c & 8 != 0, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] codes -> [rows, n] bytes, even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, n] bytes -> [rows, 2n] codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def group_view(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, groups, 16] fp32, the last group zero-padded."""
    out, inp = weight.shape
    pad = padded_groups(inp) * GROUP - inp
    return torch.nn.functional.pad(weight.float(), (0, pad)).reshape(out, -1, GROUP)


def quantize(
    weight: torch.Tensor, gscale: torch.Tensor | None = None, search: tuple[float, ...] = (1.0,)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [out, groups * 8], e4m3 scales [out, groups], global scale [1]) of a dense
    [out, in] weight, rounding to nearest. `search` lists multiples of each group's absmax-based
    scale to try; the one with the least squared error per group wins (1.0 alone: plain RTN)."""
    g = group_view(weight)
    gs = global_scale(weight) if gscale is None else gscale.float().reshape(1)
    amax = g.abs().amax(dim=-1, keepdim=True)
    best_err = best_codes = best_scale = None
    for factor in search:
        scale = (amax / E2M1_MAX * gs * factor).clamp(max=E4M3_MAX).to(E4M3)
        eff = scale.float() / gs
        codes = encode_e2m1(torch.where(eff > 0, g / eff, torch.zeros_like(g)))
        err = ((decode_e2m1(codes) * eff - g) ** 2).sum(dim=-1, keepdim=True)
        if best_err is None:
            best_err, best_codes, best_scale = err, codes, scale
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better, codes, best_codes)
        best_scale = torch.where(better, scale.view(torch.uint8), best_scale.view(torch.uint8)).view(E4M3)
    out = weight.shape[0]
    return pack(best_codes.reshape(out, -1)), best_scale.reshape(out, -1), gs


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, row_factor: torch.Tensor, in_features: int
) -> torch.Tensor:
    """fp32 [out, in_features] from packed codes, e4m3 group scales and a per-row factor
    (1 / the global scale of the row's tensor)."""
    out = packed.shape[0]
    # One gather per byte (its two values) instead of unpacking nibbles: this runs every call
    # on the CPU path.
    values = _byte_values(packed.device)[packed.long()].reshape(out, -1, GROUP)
    group_scale = scale.float() * row_factor.float().reshape(out, 1)
    return (values * group_scale.unsqueeze(-1)).reshape(out, -1)[:, :in_features]


_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def _byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the (low, high) nibble values of every byte."""
    if device not in _BYTE_VALUES:
        table = decode_e2m1(unpack(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]))
        _BYTE_VALUES[device] = table.to(device)
    return _BYTE_VALUES[device]


def fake_quantize(weight: torch.Tensor, search: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    packed, scale, gs = quantize(weight, search=search)
    factor = (1.0 / gs).expand(weight.shape[0])
    return dequantize(packed, scale, factor, weight.shape[1])
