"""`cpu-paged`: the C++ kernels behind the core's AttentionBackend seam."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmstack.batch import AttentionMetadata
from lmstack.interfaces import AttentionBackend
from lmstack_cpu_paged.build import load

ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
_NATIVE_SOURCE = (torch.float32, torch.bfloat16)  # K/V dtypes the native write_kv takes
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # caches it writes with their per-head scales


class CpuPagedAttention(AttentionBackend):
    """Prefill and decode in one kernel: decode is the case of one query token per sequence.

    `isa` forces a code path ("scalar", "avx2", "avx512"); "auto" takes the widest the CPU has.
    `min_part`: the fewest keys a decode split may hold (splits happen only when the batch has
    too few (sequence, KV head) items to occupy every thread)."""

    def __init__(self, *, isa: str = "auto", min_part: int = 256) -> None:
        self._ext = load()  # BuildError, one line, if this machine cannot build it
        self.isa = ISAS[isa]
        self.min_part = min_part

    # Picklable (a multi-process layout sends the backends to its workers): the extension
    # module is left out and loaded again on the other side (built once per machine, cached).
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_ext"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._ext = load()

    def _run(self, q, k_cache, v_cache, meta, rows, scale, window, softcap, k_scale, v_scale) -> torch.Tensor:
        """rows: (query_start [B + 1], context_lens [B]) int32, the batch's query rows."""
        return self._ext.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            *rows,
            float(scale),
            0 if window is None else int(window),
            k_scale,
            v_scale,
            self.isa,
            self.min_part,
            float(softcap) if softcap else 0.0,
        )

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        # One native call for K and V: the two index_copy_ of the base class cost ~10 us each
        # per layer at decode, and a scaled fp8 cache's quantization several torch ops more.
        fits = k_cache.dtype in _FP8 if k_scale is not None else k_cache.dtype in _NATIVE_SOURCE
        if fits and k.dtype in _NATIVE_SOURCE:
            self._ext.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        else:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

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
    ) -> torch.Tensor:
        # This step's K/V are in the cache already (write_kv ran first): the kernel reads every
        # key from there, so `k` and `v` are not needed.
        rows = (meta.query_start_loc, meta.context_lens)
        return self._run(
            q, k_cache, v_cache, meta, rows, scale, sliding_window, logit_softcap, k_scale, v_scale
        )

    def bind_decode(self, meta: AttentionMetadata) -> Callable[..., torch.Tensor]:
        """`write_kv` then `decode` for one layer of a decode-only step, the step's query rows
        derived here once and the attention kernel called directly (what `decode` calls)."""
        ext, isa, min_part = self._ext, self.isa, self.min_part
        tables, slots = meta.block_tables, meta.slot_mapping
        starts, contexts = self._decode_rows(meta, meta.num_seqs)

        def call(q, k, v, k_cache, v_cache, write_kw, kw) -> torch.Tensor:
            self.write_kv(k, v, k_cache, v_cache, slots, **write_kw)
            window, softcap = kw["sliding_window"], kw.get("logit_softcap")
            return ext.paged_attention(
                q,
                k_cache,
                v_cache,
                tables,
                starts,
                contexts,
                float(kw["scale"]),
                0 if window is None else int(window),
                kw.get("k_scale"),
                kw.get("v_scale"),
                isa,
                min_part,
                float(softcap) if softcap else 0.0,
            )

        return call

    @staticmethod
    def _decode_rows(meta: AttentionMetadata, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per sequence at position seq_len - 1: the kernel's query_start 0..B and
        context seq_len - 1, derived once per step and shared by every layer."""
        rows = meta.scratch.get("cpu-paged.decode")
        if rows is None:
            rows = meta.scratch["cpu-paged.decode"] = (
                torch.arange(b + 1, dtype=torch.int32),
                (meta.seq_lens[:b] - 1).to(torch.int32),
            )
        return rows

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
        rows = self._decode_rows(meta, q.shape[0])
        return self._run(
            q, k_cache, v_cache, meta, rows, scale, sliding_window, logit_softcap, k_scale, v_scale
        )
