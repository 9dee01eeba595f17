"""Runs the model on one flattened batch: turns the engine's step plan into device tensors,
owns the KV-cache tensors, applies block copies and splits attention into decode and prefill."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lmstack.batch import AttentionMetadata, ModelInput, ModelOutput, StepPlan
from lmstack.interfaces import AttentionBackend, Quantizer
from lmstack.kernels.huge_pages import zeros_in_huge_pages
from lmstack.model.architecture import ModelArchitecture
from lmstack.model.checkpoint import CheckpointTensor
from lmstack.model.config import ModelConfig
from lmstack.quant.kv import calibrate_kv_scales, is_scaled


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
        layer_kwargs: list[tuple[dict[str, Any], dict[str, Any]]],
    ) -> None:
        """`layer_kwargs[layer]`: the keywords of that layer's `write_kv` and of its kernels
        (`scale`, `sliding_window`, `logit_softcap` where the kernel declares it, and a scaled
        float8 cache's `k_scale` / `v_scale`), made once by the model runner."""
        self.meta = meta
        self.kv_caches = kv_caches
        self.layer_kwargs = layer_kwargs
        self.prefill_backend, self.decode_backend = prefill, decode
        nd = meta.num_decode_seqs
        self.num_decode = nd
        self.decode_meta = meta.select(0, nd) if 0 < nd < meta.num_seqs else meta
        self.prefill_meta = meta.select(nd, meta.num_seqs) if 0 < nd < meta.num_seqs else meta
        # A step of decodes only: the backend's optional per-step call, fn(q, k, v, k_cache,
        # v_cache, write_kwargs, kwargs) doing `write_kv` then `decode` for one layer with this
        # step's metadata derived once (a few Python frames a layer are ~5 % of a CPU's batch-1
        # step); None, or no `bind_decode`: the two calls.
        bind = getattr(decode, "bind_decode", None) if 0 < nd == meta.num_seqs else None
        self.decode_call = bind(meta) if bind is not None else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.decode_call is not None:
            return self.decode_call(q, k, v, *self.kv_caches[layer], *self.layer_kwargs[layer])
        k_cache, v_cache = self.kv_caches[layer]
        meta, nd = self.meta, self.num_decode
        write_kw, kw = self.layer_kwargs[layer]
        self.prefill_backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **write_kw)
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
        # An optional quantizer hook before the weights load (lmstack-gguf notes which GGUF
        # tensors the embedding and head load, to keep their bytes packed).
        prepare = getattr(quantizer, "prepare_model", None)
        if prepare is not None:
            prepare(model)
        model.load_weights(weights)
        quantizer.process_model(model)
        bind = getattr(model, "bind_fast_layers", None)
        if bind is not None:  # the weights are final: bind the decoder's fast path (llama.py)
            bind()
        self.model = model.eval()
        # A tensor-parallel rank caches only its KV heads.
        self.num_kv_heads: int = getattr(model, "local_num_kv_heads", config.num_kv_heads)
        # A pipeline stage's model holds only some decoder layers: KV tensors for those alone.
        stage = getattr(model, "stage", None)
        self.layers = range(stage.start, stage.end) if stage is not None else range(config.num_layers)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.scale = config.attn_scale if config.attn_scale is not None else config.head_dim**-0.5
        # A float8 KV cache stores K/V divided by per-layer, per-KV-head scales fixed here.
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if is_scaled(kv_cache_dtype):
            self.kv_scales = calibrate_kv_scales(
                self.model, config.vocab_size, config.num_layers, kv_cache_dtype, device
            )
        # Each layer's kernel keywords, made once rather than per layer per step: its window
        # (Gemma alternates local and global layers) and scale. Scales reach only backends that
        # declare a float8 KV dtype, `logit_softcap` only backends that declare it (resolution
        # refused a soft-capping model with any other: `lmstack.stack.checks.check_model`).
        # (A kernel without the keyword would fail on the call, never compute uncapped scores.)
        cap = config.attn_logit_softcap
        softcap = {"logit_softcap": float(cap)} if cap else {}
        self.layer_kwargs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for layer in range(config.num_layers):
            scales = self.kv_scales[layer] if self.kv_scales is not None else None
            write_kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
            kernel_kw = {
                "scale": self.scale,
                "sliding_window": config.layer_window(layer),
                **softcap,
                **write_kw,
            }
            self.layer_kwargs.append((write_kw, kernel_kw))

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        self.block_size = block_size
        shape = (num_blocks, block_size, self.num_kv_heads, c.head_dim)

        # Indexed by global layer; layers another pipeline stage holds get empty placeholders.
        # Host caches in huge pages where the OS has them (`lmstack.kernels.huge_pages`: decode
        # attention reads them scattered, block by block).
        def layer_cache(i: int) -> torch.Tensor:
            size = shape if i in self.layers else (0,)
            if self.device.type == "cpu":
                return zeros_in_huge_pages(size, self.kv_cache_dtype)
            return torch.zeros(size, dtype=self.kv_cache_dtype, device=self.device)

        self.kv_caches = [(layer_cache(i), layer_cache(i)) for i in range(c.num_layers)]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """K and V of one block, all layers, as this process caches them (a stage: its layers)."""
        c = self.config
        return (
            2 * len(self.layers) * block_size * self.num_kv_heads * c.head_dim * self.kv_cache_dtype.itemsize
        )

    def prepare(self, plan: StepPlan) -> ModelInput:
        """The plan's host lists as tensors on this runner's device: token ids and positions
        flattened in plan order, slot mapping and padded block tables from the block tables."""
        if not self.block_size:
            raise RuntimeError("init_kv_cache() must run before the first step")
        ids: list[int] = []
        positions: list[int] = []
        for s in plan.seqs:
            ids += s.token_ids
            positions += range(s.context_len, s.context_len + len(s.token_ids))
        attn = AttentionMetadata.build(
            [len(s.token_ids) for s in plan.seqs],
            [s.context_len for s in plan.seqs],
            [s.block_table for s in plan.seqs],
            self.block_size,
            device=self.device,
        )

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=self.device)

        return ModelInput(
            input_ids=t(ids),
            positions=t(positions),
            attn=attn,
            logits_indices=t(plan.logits_indices),
            hidden_state_layers=tuple(plan.hidden_state_layers),
            hidden_state_rows=None if plan.hidden_state_rows is None else t(plan.hidden_state_rows),
            blocks_to_copy=list(plan.blocks_to_copy),
        )

    def swap_in(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Write blocks' KV ([layers, 2, block_size, heads, dim] each) into the device cache."""
        for block, data in blocks:
            data = data.to(self.device, self.kv_cache_dtype, non_blocking=True)
            for layer in self.layers:
                k_cache, v_cache = self.kv_caches[layer]
                k_cache[block].copy_(data[layer, 0])
                v_cache[block].copy_(data[layer, 1])

    def swap_out(self, blocks: list[int]) -> list[torch.Tensor]:
        """The blocks' KV as host tensors of shape [layers, 2, block_size, heads, dim]."""
        if not blocks:
            return []
        index = torch.tensor(blocks, device=self.device)
        # [layers, 2, n, bs, H, D] gathered in one copy per layer, then split per block.
        stacked = torch.stack([torch.stack((k[index], v[index])) for k, v in self._held_caches()])
        host = stacked.to("cpu")
        return [host[:, :, i].clone() for i in range(len(blocks))]

    def _held_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.kv_caches[i] for i in self.layers]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, *, hidden_in: torch.Tensor | None = None) -> ModelOutput:
        """One step. A pipeline stage after the first passes the previous stage's output as
        `hidden_in`; on a stage before the last, `logits` holds this stage's output [T, hidden]."""
        if plan.swap_in:  # blocks a cache loads from a lower tier, before anything reads them
            self.swap_in(plan.swap_in)
        inp = self.prepare(plan)
        if inp.blocks_to_copy:
            src = torch.tensor([s for s, _ in inp.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in inp.blocks_to_copy], device=self.device)
            for k_cache, v_cache in self._held_caches():
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        ctx = ForwardContext(
            inp.attn,
            self.kv_caches,
            self.prefill_backend,
            self.decode_backend,
            self.layer_kwargs,
        )
        stage_kw: dict[str, torch.Tensor] = {} if hidden_in is None else {"hidden_in": hidden_in}
        if inp.hidden_state_rows is not None:
            stage_kw["hidden_rows"] = inp.hidden_state_rows
        logits, hidden = self.model(
            inp.input_ids, inp.positions, ctx, inp.logits_indices, inp.hidden_state_layers, **stage_kw
        )
        return ModelOutput(logits=logits, hidden_states=hidden, swapped_out=self.swap_out(plan.swap_out))
