"""The decoder's fast path: each plain decoder layer's forward with every per-call check made
once, for fp32 batches on a CPU.

At batch-1 decode the ~10 kernels of a SmolLM2 layer take ~8 us each, and the generic forward's
frames and per-call checks (module hooks, dtypes and strides, which native op) took ~1 ms of an
~8 ms step (2-core Zen 4, a Q4_K_M file). `plain_layer` binds, once the weights are final, a
function computing exactly what `DecoderLayer.forward` computes: the native layer ops called
directly, and each linear's bare kernel where its quantizer offers one (`fast_op()` -> (op, most
rows): lmstack-gguf's bound kernel), else its forward. `FastLayers` holds a stage's bound layers
and says per step whether they apply (tests/test_fast_layers.py holds them to the generic path's
bits).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from lmstack.model.layer_ops import half_tables, native

LayerCall = Callable[..., torch.Tensor]  # (x, rope tables, attention) -> the layer's output


def offered(linear: nn.Module, name: str) -> tuple | None:
    """What the linear's quantizer offers as `name()` ((op, most rows)), None where it has no
    such method or offers nothing for this layer."""
    offer = getattr(linear, name, None)
    return offer() if offer is not None else None


def fast_op(linear: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """A linear's bare op for fp32 CPU rows [T, in] with a contiguous last dim, and the most
    rows it takes: the quantizer's `fast_op()` where the linear has one, else its `forward`."""
    op = offered(linear, "fast_op")
    return op if op is not None else (linear.forward, sys.maxsize)


def plain_layer(layer: Any) -> tuple[LayerCall, int, tuple[dict, ...]] | None:
    """For a decoder layer whose family switches are all off (the caller checks them: the Llama
    ops) and one tp rank: (the bound forward, the most rows it takes, the hook dicts of its
    modules: it applies only while they are empty); None without the native ops or with norms
    that are not fp32 on the CPU."""
    ops = native()
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if ops is None or any(n.weight.dtype != torch.float32 or not n.weight.is_cpu for n in norms):
        return None
    linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    (qkv, q_max), (o_proj, o_max), (gate_up, gu_max), (down, d_max) = (fast_op(m) for m in linears)
    rms, rope_, silu = ops.rms_norm, ops.qkv_rope_, ops.silu_mul_
    # silu(gate) * up straight from the gate_up kernel where its quantizer fuses them
    # (`fast_swiglu_op()`: the same bits as silu_mul_ over its output), else the two calls.
    fused = offered(layer.gate_up_proj, "fast_swiglu_op")
    if fused is not None:
        mlp, gu_max = fused
    else:

        def mlp(h: torch.Tensor) -> torch.Tensor:
            return silu(gate_up(h))

    # The down projection's products added into the residual stream as its kernel stores them
    # where its quantizer offers that (`fast_add_op()`: the same bits as its output then add_).
    add_into = offered(layer.down_proj, "fast_add_op")
    if add_into is not None:
        down_add, d_max = add_into
    else:

        def down_add(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return down(y).add_(out)

    w_in, eps_in = norms[0].weight, norms[0].eps
    w_post, eps_post = norms[1].weight, norms[1].eps
    index, heads, kv_heads, q_size = layer.index, layer.num_heads, layer.num_kv_heads, layer.q_size

    def run(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Any) -> torch.Tensor:
        cos, sin = half_tables(*rope)
        q, k, v = rope_(qkv(rms(x, w_in, eps_in, None)), cos, sin, heads, kv_heads)
        o = o_proj(attn.attend(index, q, k, v).reshape(x.shape[0], q_size))
        h = rms(o, w_post, eps_post, x)  # o += x in place: the residual stream
        return down_add(mlp(h), o)

    hooks = tuple(d for m in (layer, *norms, *linears) for d in (m._forward_hooks, m._forward_pre_hooks))
    return run, min(q_max, o_max, gu_max, d_max), hooks


@dataclass
class FastLayers:
    """A stage's bound layers (`plain_layer`), run for a step's x while they apply (`for_step`)."""

    calls: tuple[LayerCall, ...]
    most_rows: int
    hooks: tuple[dict, ...]

    @classmethod
    def bind(cls, layers: Iterable[Any]) -> FastLayers | None:
        """Every layer's `fast_forward()`; None unless every one has it."""
        bound = [layer.fast_forward() for layer in layers]
        if not bound or any(b is None for b in bound):
            return None
        return cls(
            tuple(b[0] for b in bound), min(b[1] for b in bound), tuple(d for b in bound for d in b[2])
        )

    def for_step(self, x: torch.Tensor) -> Sequence[LayerCall] | None:
        """The calls, where they apply to x: fp32 CPU rows [T, hidden] within the row limit,
        under inference mode (no autograd), while no module has a hook (global ones included)."""
        if (
            x.shape[0] > self.most_rows
            or x.dtype is not torch.float32
            or not x.is_cpu
            or not x.is_contiguous()
            or not torch.is_inference_mode_enabled()
            or torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
            or any(self.hooks)
        ):
            return None
        return self.calls
