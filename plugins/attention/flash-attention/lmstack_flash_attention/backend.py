"""`flash-attention`: the Triton FlashAttention kernel behind the core's AttentionBackend seam."""

from __future__ import annotations

import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.kernels.triton_support import enable_interpreter


class FlashAttention(AttentionBackend):
    """Prefill chunks (and, with the same kernel, decode tokens: a query of length 1 is a chunk
    of one) attend to their sequence's cached tokens through the block table.

    `interpret=True` runs the kernel in the Triton interpreter (CPU tensors; tests only)."""

    def __init__(self, *, interpret: bool = False) -> None:
        self.interpret = interpret
        if interpret:
            enable_interpreter("flash-attention")  # before the kernel module imports Triton
        from lmstack_flash_attention.kernel import flash_prefill

        self._flash_prefill = flash_prefill

    def prefill(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        *,
        scale,
        sliding_window,
        logit_softcap=None,
        k_scale=None,
        v_scale=None,
    ):
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, k_scale, v_scale)

    def decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        *,
        scale,
        sliding_window,
        logit_softcap=None,
        k_scale=None,
        v_scale=None,
    ):
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, k_scale, v_scale)

    def _attend(
        self, q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale
    ) -> torch.Tensor:
        return self._flash_prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            scale=scale,
            sliding_window=sliding_window,
            interpret=self.interpret,
            k_scale=k_scale,
            v_scale=v_scale,
            logit_softcap=softcap,
        )
