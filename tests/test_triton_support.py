"""`lmstack.kernels.triton_support.split_k`: how many programs share a quantized GEMM's K range."""

from __future__ import annotations

import torch

from lmstack.kernels.triton_support import SPLIT_K_TARGET_PROGRAMS, reduce_splits, split_k, split_k_output


def test_splits_fill_the_grid_and_keep_two_steps_each():
    # Llama-3-8B's layers at decode sizes, 128-row tiles (the H200 sweep's best split counts).
    assert split_k(32, 32) == 16  # 4096 x 4096: 32 tiles, 32 steps of 128 columns
    assert split_k(224, 32) == 4  # 28672 x 4096
    assert split_k(32, 112) == 16  # 4096 x 14336
    assert split_k(SPLIT_K_TARGET_PROGRAMS, 100) == 1  # a full grid is not split
    assert split_k(1, 3) == 1  # too short to split into two-step pieces
    assert split_k(1, 4) == 2
    for tiles in range(1, 600, 7):
        for steps in range(1, 200, 11):
            s = split_k(tiles, steps)
            assert s & (s - 1) == 0 and (s == 1 or steps // s >= 2)
            assert tiles * s >= SPLIT_K_TARGET_PROGRAMS or steps // (2 * s) < 2


def test_split_output_covers_k_in_whole_steps_and_reduces():
    per_split, splits, out = split_k_output(2048, 16, 64, 3, 5, torch.bfloat16, "cpu")
    assert (per_split, splits, out.shape, out.dtype) == (128, 16, (16, 3, 5), torch.float32)
    per_split, splits, _ = split_k_output(300, 4, 64, 1, 2, torch.bfloat16, "cpu")
    assert (per_split, splits) == (128, 3)  # 75 columns a piece round up to two steps: 3 pieces
    per_split, splits, out = split_k_output(100, 1, 32, 2, 2, torch.float16, "cpu")
    assert (per_split, splits, out.shape, out.dtype) == (128, 1, (2, 2), torch.float16)
    parts = torch.randn(3, 2, 4)
    assert torch.equal(reduce_splits(parts, torch.bfloat16), parts.sum(0).bfloat16())
    assert reduce_splits(out, torch.float16) is out
