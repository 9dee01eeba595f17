"""The `gguf` quantizer: linears keep the checkpoint's GGUF blocks; the embedding and LM head
keep the file's blocks too, or become Q8_0 blocks where that is exact (`lm_head: blocks`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.kernels.hardware import native_bf16_cpu
from lmstack.quant.formats import GGUF, checkpoint_format_id
from lmstack_gguf.head import keep_embedding_and_head_as_blocks, watch_tables
from lmstack_gguf.kernel import KQ_MAX_ROWS, KQ_MAX_ROWS_FP32_SLABS, QK, native_kernel
from lmstack_gguf.linear import GGUFLinear

log = logging.getLogger(__name__)

# With the bfloat16 copy, batches from this many rows multiply by it: on a native-bf16 CPU (AMD
# EPYC, AVX-512 BF16) the copy overtook the int8-activation kernel between 16 and 24 rows of a
# decode step's layers (README).
BF16_COPY_MIN_ROWS = 17


# The block kernel was faster than the panels below this many rows for the Q8_0 LM head where
# AVX2 is the widest code (one row on a Zen 3: 1.1 vs 1.3 ms), and for the layers on a Zen 5
# before the panel kernel prefetched its stream (benchmarks/ab/panels_from_ab.py's baseline).
PANELS_MIN_ROWS = 6


def head_panels_min_rows() -> int:
    """From how many rows the Q8_0 LM head multiplies by its panels: every batch, on every ISA.
    With AVX-512 VNNI the panels are faster at any batch (Zen 5, with the prefetch: 351 vs 455 us
    at one row, 584 vs 772 at five, README); with AVX2 only the block kernel was ~0.2 ms faster
    at one row, but it sums in another order than the panels, so a row's logits (and on a near
    tie its greedy token) depended on how many rows shared the step."""
    return 1


# Decoder layers take the panels for every batch wherever the panel kernel runs (AVX2 or AVX-512
# VNNI), which also makes a row's result the same bits in any batch. Measured with
# benchmarks/ab/panels_from_ab.py (a decode step, panels from one row against from PANELS_MIN_ROWS):
# AVX2-only Zen 3 0.88-0.99x at batch 1, 0.73x at 4; Zen 5 (AVX-512, with the panels' prefetch)
# 0.87-1.005x at batch 1, 0.88x at 3-5, the awq stack 0.94-0.95x at 1 and 0.82x at 3-5 (README).
LAYER_PANELS_MIN_ROWS = 1


def layer_panels_min_rows() -> int:
    """From how many rows a decoder layer's linears multiply by their panels (where they run)."""
    return LAYER_PANELS_MIN_ROWS


# With `prefill: panels+bf16`, batches from this many rows multiply by the bfloat16 copy (oneDNN
# runs them on AMX tiles): measured over a step's layers on a 2-core Intel Xeon with AMX, the
# copy was level with the panels at 128-256 rows and ahead from 512 (0.73-0.85x, README). Opt-in
# only: a row then rounds differently in a large step than in a small one, so the prefix cache,
# chunked prefill and batch-mates changed greedy tokens (2 of 6 prompts with a shared prefix).
AMX_COPY_MIN_ROWS = 256


def panels_cpu() -> bool:
    """Whether the panel kernel runs here (the kernels built, AVX2 at least)."""
    ext = native_kernel()
    return ext is not None and ext.best_isa() >= 1


def wide_panels_cpu() -> bool:
    """Whether the panels run with AVX-512 VNNI here (Q5_K / Q6_K batches from 64 rows widened
    once per call, `wide_pair`): the K-quants' panels then beat bfloat16 slabs at every batch. (AVX2
    CPUs keep the slabs, fp32 there, under `auto`: panels against them not measured on one.)"""
    ext = native_kernel()
    return ext is not None and ext.best_isa() >= 2


def prefill_mode(prefill: str, int8_activations: bool) -> str:
    """`GGUFOptions.prefill` resolved: "auto" becomes "panels" where activations are int8 and the
    kernels run (AVX2 or AVX-512, AMX CPUs too: the panels compute a row alike in any batch, so
    greedy output does not depend on batch-mates, the prefix cache or chunking), else
    "dense-bf16" where the CPU computes bfloat16 natively and activations are int8, else
    "dense-copy" (both switch to their copy from a batch size, so they are not batch-invariant).
    "panels" or "panels+bf16" where it cannot run is a ConfigError."""
    if prefill in ("panels", "panels+bf16"):
        if not int8_activations:
            raise ConfigError(f"gguf: prefill: {prefill} multiplies int8 activations; set activations: int8")
        if not panels_cpu():
            raise ConfigError(
                f"gguf: prefill: {prefill} needs AVX2 and the built kernels, which this machine lacks; "
                "use prefill: auto"
            )
    if prefill != "auto":
        return prefill
    if int8_activations and panels_cpu():
        return "panels"
    return "dense-bf16" if int8_activations and native_bf16_cpu() else "dense-copy"


class GGUFQuantizer(Quantizer):
    kv_cache_dtype = None

    def __init__(self, options: Any, ctx: Any) -> None:
        self.options = options
        model_config = getattr(ctx, "model_config", None)
        fmt = checkpoint_format_id(model_config.quantization if model_config is not None else None)
        if fmt != GGUF:
            raise ConfigError(
                f"gguf serves GGUF checkpoints as stored; this checkpoint is {fmt} (use quant.weights: auto)"
            )
        self.use_native = options.kernel == "auto"
        self.int8_activations = options.activations == "int8"
        self.prefill = prefill_mode(options.prefill, self.int8_activations)
        self.dense_copy = self.prefill in ("dense-copy", "dense-bf16", "panels+bf16")
        self.panels = self.prefill in ("panels", "panels+bf16")
        # K-quant / BF16 batches the kq kernel does not take are rebuilt a slab at a time in
        # bfloat16 on a CPU that multiplies it natively (int8 activations accept x's rounding).
        self.slab_dtype = torch.bfloat16 if self.int8_activations and native_bf16_cpu() else torch.float32
        # The checkpoint's GGML types (ModelConfig.quantization, from the file's tensor index):
        # row-parallel layers split on the largest block among them.
        types = (model_config.quantization or {}).get("tensor_types", {}) if model_config else {}
        self.block = max(
            [
                QK,
                *(
                    GGML_QUANT_SIZES[GGMLQuantizationType[n]][0]
                    for n in types
                    if n in GGMLQuantizationType.__members__
                ),
            ]
        )
        self._tables: dict[int, Any] = {}  # the GGUF tensors the embedding / head load (watch_tables)
        # GGML type name -> bytes it costs dequantized at load over the file's bytes (process_model).
        self.dequantized: dict[str, int] = {}

    def linear_factory(self) -> LinearFactory:
        extra = {}
        if self.prefill == "dense-bf16":
            extra = {"copy_dtype": torch.bfloat16, "kernel_max_rows": BF16_COPY_MIN_ROWS - 1}
        elif self.panels:
            extra = {"panels": True, "kernel_max_rows": layer_panels_min_rows() - 1}
            if self.prefill == "panels+bf16":
                extra.update(copy_dtype=torch.bfloat16, copy_min_rows=AMX_COPY_MIN_ROWS)

        bf16_slabs = self.slab_dtype == torch.bfloat16
        kq_max_rows = KQ_MAX_ROWS if bf16_slabs else KQ_MAX_ROWS_FP32_SLABS
        if self.options.kquant_batches == "int8":
            kq_max_rows = None  # the kq kernel at every batch size
        extra.update(kq_max_rows=kq_max_rows, slab_dtype=self.slab_dtype)
        if self.options.kquant_batches == "auto" and self.panels and wide_panels_cpu():
            extra.update(kq_panels_every_batch=True)

        def make(spec: LinearSpec) -> nn.Module:
            return GGUFLinear(
                spec, self.use_native, self.dense_copy, int8_activations=self.int8_activations, **extra
            )

        return make

    def prepare_model(self, model: nn.Module) -> None:
        """Before the weights load (`ModelRunner`): note the GGUF tensors the embedding and the
        head load, so that `process_model` can keep their bytes."""
        if self.options.lm_head == "blocks":
            watch_tables(model, self._tables)

    def process_model(self, model: nn.Module) -> None:
        dequantized: dict[str, int] = {}
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                module.finalize()
                for name, cost in module.dequantized.items():
                    dequantized[name] = dequantized.get(name, 0) + cost
        if self.options.lm_head == "blocks":
            _, tables = keep_embedding_and_head_as_blocks(
                model,
                self.use_native,
                self.int8_activations,
                head_panels_min_rows() if self.panels else None,
                self._tables,
                self.slab_dtype,
            )
            for name, cost in tables.items():
                dequantized[name] = dequantized.get(name, 0) + cost
        self._tables = {}
        for name, cost in sorted(dequantized.items()):
            log.warning(
                "lmstack-gguf: %s tensors are not kept packed: dequantized to fp32 at load, %.1f MB more "
                "than the file's bytes",
                name,
                cost / 1e6,
            )
        self.dequantized = dequantized

    def dequantized_at_load(self) -> dict[str, int]:
        """GGML type name -> bytes its tensors cost dequantized at load beyond the file's bytes
        (`lmstack check --memory` lists them)."""
        return dict(self.dequantized)

    def shard_alignment(self, spec: LinearSpec) -> int:
        # Blocks run along a row: a split of the input columns (row-parallel) keeps whole blocks,
        # 256 values where the file holds a K-quant (a cut inside one would dequantize the layer).
        return self.block if spec.parallel == "row" else 1
