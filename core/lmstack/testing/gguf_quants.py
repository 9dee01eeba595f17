"""A small reference packer for the GGUF block types the gguf package cannot write: fp32 matrix
rows -> Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 or IQ4_NL block rows, written from the block
layouts (ggml's `block_q*` structs), for test fixtures (`gguf_writer`'s K-quant files).

Scales are chosen the simple way (a sub-block's max-abs, or its min and max, then the block's
largest scale sets the super-scale); llama.cpp searches harder for the error-minimising scales,
so its files are more accurate, but any choice is a valid block that every reader decodes alike.
`quantize(x, type)` returns the block bytes; `quantize_meant(x, type)` also the values the
packer meant them to decode to (each value's scale times its code, in fp32), which tests hold
`gguf.quants.dequantize` to.

    blocks = quantize(w, GGMLQuantizationType.Q4_K)   # uint8 [rows, row bytes]
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256  # values per K-quant super-block
# IQ4_NL's 16 code values (ggml's kvalues_iq4nl).
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _f16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [..., 2], the fp16 value back in fp32)."""
    h = a.astype(np.float16)
    return h[..., None].view(np.uint8).reshape(*a.shape, 2), h.astype(np.float32)


def _inv(s: np.ndarray) -> np.ndarray:
    out = np.zeros_like(s)
    np.divide(1.0, s, out=out, where=s != 0)
    return out


def _round(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(a), lo, hi)


def _affine_scales(x: np.ndarray, levels: int, scale_levels: int):
    """Sub-blocks x [B, S, n] as d * sc * q - dmin * m, q in [0, levels], sc and m in [0,
    scale_levels]: per sub-block scale (max - min) / levels and offset -min (min <= 0), then the
    super-scales d, dmin (fp16) over the block's largest. Returns (d bytes, dmin bytes, sc, m, q,
    meant values)."""
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / levels
    d_bytes, d = _f16(scale.max(-1) / scale_levels)
    dm_bytes, dmin = _f16((-lo).max(-1) / scale_levels)
    sc = _round(scale * _inv(d)[:, None], 0, scale_levels)
    m = _round(-lo * _inv(dmin)[:, None], 0, scale_levels)
    step = (d[:, None] * sc).astype(np.float32)
    off = (dmin[:, None] * m).astype(np.float32)
    q = _round((x + off[..., None]) * _inv(step)[..., None], 0, levels)
    meant = step[..., None] * q - off[..., None]
    return d_bytes, dm_bytes, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8), meant


def _pack_6bit_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes for 8 six-bit scales and mins (ggml's get_scale_min_k4 inverse)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 code bytes: per 64 values, byte l holds value l (low nibble) and value
    32 + l (high nibble)."""
    q = q.reshape(-1, 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray):
    d, dmin, sc, m, q, meant = _affine_scales(x.reshape(-1, 8, 32), 15, 63)
    return np.concatenate([d, dmin, _pack_6bit_scales(sc, m), _nibbles_k(q)], 1), meant


def _q5_k(x: np.ndarray):
    d, dmin, sc, m, q, meant = _affine_scales(x.reshape(-1, 8, 32), 31, 63)
    high = (q >> 4).reshape(-1, 8, 32).astype(np.uint8)  # bit j of byte l: sub-block j's value l
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d, dmin, _pack_6bit_scales(sc, m), qh, _nibbles_k(q)], 1), meant


def _q2_k(x: np.ndarray):
    d, dmin, sc, m, q, meant = _affine_scales(x.reshape(-1, 16, 16), 3, 15)
    # Per 128 values, byte l (of 32) holds values l, 32 + l, 64 + l, 96 + l in bit pairs 0-3.
    q4 = q.reshape(-1, 2, 4, 32)
    qs = q4[:, :, 0] | (q4[:, :, 1] << 2) | (q4[:, :, 2] << 4) | (q4[:, :, 3] << 6)
    return np.concatenate([sc | (m << 4), qs.reshape(-1, 64), d, dmin], 1), meant


def _symmetric(x: np.ndarray, lo: int, hi: int, scale_max: int):
    """Sub-blocks x [B, S, n] as d * sc * q, q in [lo, hi], sc in [0, scale_max]."""
    scale = np.abs(x).max(-1) / -lo
    d_bytes, d = _f16(scale.max(-1) / scale_max)
    sc = _round(scale * _inv(d)[:, None], 0, scale_max)
    step = (d[:, None] * sc).astype(np.float32)
    q = _round(x * _inv(step)[..., None], lo, hi)
    return d_bytes, sc, q.astype(np.int32), step[..., None] * q


def _q3_k(x: np.ndarray):
    d, sc, q, meant = _symmetric(x.reshape(-1, 16, 16), -4, 3, 31)
    u = (q + 4).astype(np.uint8).reshape(-1, 256)  # 3-bit codes: 2 low bits in qs, 1 in hmask
    # hmask: bit k of byte l is value 32k + l's high bit.
    hmask = np.zeros((u.shape[0], 32), np.uint8)
    for k in range(8):
        hmask |= (u[:, 32 * k : 32 * k + 32] >> 2) << k
    low = (u & 3).reshape(-1, 2, 4, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(-1, 64)
    s = (sc.astype(np.int32) + 32).astype(np.uint8)  # 6-bit scales stored + 32
    scales = np.zeros((s.shape[0], 12), np.uint8)
    scales[:, 0:8] = (s[:, 0:8] & 15) | ((s[:, 8:16] & 15) << 4)
    for i in range(4):  # high bit pairs of scales i, 4 + i, 8 + i, 12 + i
        scales[:, 8 + i] = sum(((s[:, i + 4 * k] >> 4) & 3) << (2 * k) for k in range(4))
    return np.concatenate([hmask, qs, scales, d], 1), meant


def _q6_k(x: np.ndarray):
    d, sc, q, meant = _symmetric(x.reshape(-1, 16, 16), -32, 31, 127)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # per 128 values, 4 runs of 32
    ql = np.concatenate(
        [u[:, :, 0] & 15 | (u[:, :, 2] & 15) << 4, u[:, :, 1] & 15 | (u[:, :, 3] & 15) << 4], 2
    )
    qh = sum((u[:, :, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), d], 1
    ), meant


def _five_bit(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 / Q5_1's (qh 4 bytes, qs 16 bytes) for 5-bit codes q [B, 32]: value j's low nibble in
    byte j % 16 (values 16-31 in the high nibbles), its high bit as bit j of the uint32 qh."""
    qs = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    bits = ((q.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    qh = bits.sum(1, dtype=np.uint32).astype("<u4")[:, None].view(np.uint8)
    return qh, qs.astype(np.uint8)


def _q5_0(x: np.ndarray):
    d_bytes, d = _f16(np.abs(x).max(-1) / 16)
    q = _round(x * _inv(d)[:, None], -16, 15)
    qh, qs = _five_bit((q + 16).astype(np.uint8))
    return np.concatenate([d_bytes, qh, qs], 1), d[:, None] * q


def _q5_1(x: np.ndarray):
    lo = x.min(-1)
    d_bytes, d = _f16((x.max(-1) - lo) / 31)
    m_bytes, m = _f16(lo)
    q = _round((x - m[:, None]) * _inv(d)[:, None], 0, 31)
    qh, qs = _five_bit(q.astype(np.uint8))
    return np.concatenate([d_bytes, m_bytes, qh, qs], 1), d[:, None] * q + m[:, None]


def _iq4_nl(x: np.ndarray):
    d_bytes, d = _f16(np.abs(x).max(-1) / 127)
    scaled = x * _inv(d)[:, None]
    idx = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d_bytes, qs], 1), d[:, None] * IQ4_NL_VALUES[idx]


_PACKERS = {
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.IQ4_NL: _iq4_nl,
}
TYPES = tuple(_PACKERS)


def quantize_meant(x: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 block rows [..., row bytes], fp32 values [..., k] the blocks stand for) of fp32 x
    [..., k]; k must be a whole number of `qtype`'s blocks."""
    qtype = T(qtype)
    if qtype not in _PACKERS:
        raise ValueError(f"no reference packer for {qtype.name}: one of {', '.join(t.name for t in TYPES)}")
    block, size = GGML_QUANT_SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"{qtype.name} rows must be a multiple of {block} values, not {x.shape[-1]}")
    blocks, meant = _PACKERS[qtype](x.reshape(-1, block))
    assert blocks.shape[1] == size, (qtype.name, blocks.shape)
    lead = x.shape[:-1]
    return (
        np.ascontiguousarray(blocks, dtype=np.uint8).reshape(*lead, x.shape[-1] // block * size),
        np.asarray(meant, dtype=np.float32).reshape(x.shape),
    )


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 block rows [..., row bytes] of fp32 x [..., k] in `qtype`."""
    return quantize_meant(x, qtype)[0]
