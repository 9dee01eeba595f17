"""`flash-decoding`: the Triton split-KV decode kernel behind the core's AttentionBackend seam."""

from __future__ import annotations

import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack.kernels.triton_support import enable_interpreter


class FlashDecoding(AttentionBackend):
    """Decode only (one query token per sequence); resolution keeps it out of the prefill phase.

    `interpret=True` runs the kernels in the Triton interpreter (CPU tensors; tests only).
    `num_splits` fixes the number of KV splits per sequence instead of choosing it from the
    context length and the SM count."""

    def __init__(self, *, interpret: bool = False, num_splits: int | None = None) -> None:
        self.interpret = interpret
        self.num_splits = num_splits
        if interpret:
            enable_interpreter("flash-decoding")  # before the kernel module imports Triton
        from lmstack_flash_decoding.kernel import flash_decode

        self._flash_decode = flash_decode

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window, **kwargs):
        raise NotImplementedError(
            "flash-decoding handles decode only; pick a prefill kernel with attention.prefill"
        )

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
    ) -> torch.Tensor:
        return self._flash_decode(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.max_seq_len,
            scale=scale,
            sliding_window=sliding_window,
            interpret=self.interpret,
            num_splits=self.num_splits,
            k_scale=k_scale,
            v_scale=v_scale,
            logit_softcap=logit_softcap,
        )
