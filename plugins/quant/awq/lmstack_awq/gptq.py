"""GPTQ rounding (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", 2022) for the int4 group format, after AWQ's scaling.

Round-to-nearest rounds every weight on its own; GPTQ rounds one input column at a time and
moves each column's rounding error onto the columns not yet rounded, weighted by the inverse
of the inputs' second moment H = E[x x^T], so the layer's output error on the calibration
inputs (not the weight error) is what shrinks. Group parameters (scale, zero) are set from the
partly updated weights when the walk enters a group, as the reference implementation does;
columns go in their natural order (no act-order, so no g_idx in the checkpoint).
"""

from __future__ import annotations

import torch

from lmstack_awq.int4_math import QMAX, Int4Quantized, Int4Scheme, group_params, num_groups

DAMPING = 0.01  # added to H's diagonal, as a fraction of its mean (keeps the Cholesky stable)


@torch.no_grad()
def gptq_int4(
    weight: torch.Tensor,
    h: torch.Tensor,
    scheme: Int4Scheme,
    scale_dtype: torch.dtype,
    *,
    ranges_from: torch.Tensor | None = None,
    damping: float = DAMPING,
) -> Int4Quantized:
    """int4 codes of `weight` [out, in] chosen by GPTQ against inputs with second moment `h`
    [in, in]; the scales are rounded to `scale_dtype` (what the checkpoint stores) before use.
    `ranges_from` (e.g. the weight after a clipping search): every group's scale and zero are
    set from it beforehand ("static groups") instead of from the partly updated weights."""
    w = weight.float().clone()
    out_f, in_f = w.shape
    group = scheme.effective_group(in_f)
    h = h.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damping * torch.diag(h).mean() * torch.eye(in_f)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    groups = num_groups(in_f, group)
    scale = torch.zeros(out_f, groups)
    zero = torch.zeros(out_f, groups, dtype=torch.uint8)
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    # One block per group: the group's parameters come from the weights as updated by every
    # earlier block, before this block's own updates (the reference's order), or from
    # `ranges_from` (static groups).
    source = w if ranges_from is None else ranges_from.float()
    for g, start in enumerate(range(0, in_f, group)):
        end = min(start + group, in_f)
        s, z = group_params(source[:, start:end], Int4Scheme(end - start, scheme.symmetric), scale_dtype)
        scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
        s, zf = s[:, 0], z[:, 0].float()
        block = w[:, start:end].clone()
        err = torch.zeros_like(block)
        hb = hinv[start:end, start:end]
        for i in range(end - start):
            col = block[:, i]
            q = (col / s + zf).round().clamp(0, QMAX)
            codes[:, start + i] = q.to(torch.uint8)
            e = (col - (q - zf) * s) / hb[i, i]
            block[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, end:] -= err @ hinv[start:end, end:]
    return Int4Quantized(codes, scale, zero, group)
