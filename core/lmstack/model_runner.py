"""Runs the model on one flattened batch: KV-cache tensors, block copies, the attention split."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmstack.batch import AttentionMetadata, ModelInput, ModelOutput
from lmstack.interfaces import AttentionBackend, Quantizer
from lmstack.model.architecture import ModelArchitecture
from lmstack.model.checkpoint import CheckpointTensor
from lmstack.model.config import ModelConfig


class ForwardContext:
    """What the model's attention layers call: writes the new K/V into the paged cache, then
    runs the decode kernel on the leading query-length-1 sequences and the prefill kernel on
    the rest (prefill chunks and multi-token verification)."""

    def __init__(
        self,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        prefill: AttentionBackend,
        decode: AttentionBackend,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        self.meta = meta
        self.kv_caches = kv_caches
        self.prefill_backend, self.decode_backend = prefill, decode
        self.scale, self.sliding_window = scale, sliding_window
        nd = meta.num_decode_seqs
        self.num_decode = nd
        self.decode_meta = meta.select(0, nd) if 0 < nd < meta.num_seqs else meta
        self.prefill_meta = meta.select(nd, meta.num_seqs) if 0 < nd < meta.num_seqs else meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        meta, nd = self.meta, self.num_decode
        self.prefill_backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kw = {"scale": self.scale, "sliding_window": self.sliding_window}
        if nd == meta.num_seqs:
            return self.decode_backend.decode(q, k_cache, v_cache, meta, **kw)
        if nd == 0:
            return self.prefill_backend.prefill(q, k, v, k_cache, v_cache, meta, **kw)
        out = torch.empty_like(q)
        out[:nd] = self.decode_backend.decode(q[:nd], k_cache, v_cache, self.decode_meta, **kw)
        out[nd:] = self.prefill_backend.prefill(
            q[nd:], k[nd:], v[nd:], k_cache, v_cache, self.prefill_meta, **kw
        )
        return out


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        architecture: ModelArchitecture,
        weights: Iterable[tuple[str, CheckpointTensor]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        quantizer: Quantizer,
        prefill: AttentionBackend,
        decode: AttentionBackend,
        kv_cache_dtype: torch.dtype,
        max_positions: int,
    ) -> None:
        """Builds `architecture`'s model in `dtype` directly on `device` (parameters allocated,
        never randomly initialised) and streams `weights` into it, one checkpoint tensor at a
        time, through the parameters' weight loaders."""
        self.config = config
        self.dtype, self.device, self.kv_cache_dtype = dtype, device, kv_cache_dtype
        self.prefill_backend, self.decode_backend = prefill, decode
        with torch.device(device):
            model = architecture.build(
                config, quantizer.linear_factory(), dtype=dtype, max_positions=max_positions
            )
        model.load_weights(weights)
        quantizer.process_model(model)
        self.model = model.eval()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scale = config.head_dim**-0.5

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput:
        if inp.blocks_to_copy:
            src = torch.tensor([s for s, _ in inp.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in inp.blocks_to_copy], device=self.device)
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        ctx = ForwardContext(
            inp.attn,
            self.kv_caches,
            self.prefill_backend,
            self.decode_backend,
            self.scale,
            self.config.sliding_window,
        )
        logits, hidden = self.model(
            inp.input_ids, inp.positions, ctx, inp.logits_indices, inp.hidden_state_layers
        )
        return ModelOutput(logits=logits, hidden_states=hidden)
