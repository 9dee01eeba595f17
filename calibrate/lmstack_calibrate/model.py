"""The model a calibrating search works on: a checkpoint's dense fp32 weights by Hugging Face
name, computed by the core's own model classes.

`DenseModel.weights` is a plain dict that a search rewrites freely (scales folded into norms and
rows, clipped linears, added biases, tensors that require grad while scales are tuned); the
forward is the architecture's own model (`lmstack.model.llama.LlamaModel` and its decoder layers),
built on the meta device so that it holds no weights: each call passes the current ones in
(`torch.func.functional_call`), the fused projections (q/k/v, gate/up) assembled from their
Hugging Face parts as the model's checkpoint-name mapping says. The inputs of a layer's linears
are captured with forward pre-hooks; the attention block and the MLP run alone through the
layer's `attention` and `mlp` methods.

Samples are [B, L] token ids of equal length, run as B * L tokens with causal attention inside
each sample; hidden states are [B, L, H]. Only the Llama architecture (Llama, Mistral without
sliding window, SmolLM2) is supported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lmstack.errors import ConfigError
from lmstack.exec.distributed import ParallelRanks
from lmstack.model.config import ModelConfig
from lmstack.model.linear import default_linear
from lmstack.model.llama import LlamaModel, llama_checkpoint_name
from lmstack.model.rope import RotaryEmbedding


@dataclass
class ScaleGroup:
    """Linears of one decoder layer that read the same input, for a per-input-channel scale
    search: `linears` (weight names, [out, in] each) read `input` (a key of the layer's captured
    inputs); dividing `prev`'s output channels by s (an RMSNorm weight, or the rows of the linear
    that produced the input) and multiplying the linears' input columns by s leaves the function
    unchanged. `prev` None: no exact fold exists (e.g. an input produced by a non-linear op);
    search nothing. `inspect(x, weights)` is the block whose output error the search minimises,
    given the input and replacement weights for some linears."""

    input: str
    linears: list[str]
    prev: str | None
    inspect: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    clip: list[str] = field(default_factory=list)  # the linears whose clipping is searched
    # `prev`'s output channels feed `share` input channels each (o_proj under grouped-query
    # attention: one V head serves `share` query heads): a scale is searched per `prev`
    # channel and repeated over the query heads, which keeps the fold exact.
    share: int = 1
    share_width: int = 0  # channels per shared unit (the head dimension); 0 when share == 1

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """A scale over `prev`'s channels -> the linears' input channels."""
        if self.share == 1:
            return s
        return s.view(-1, 1, self.share_width).expand(-1, self.share, -1).reshape(-1)

    def reduce(self, stat: torch.Tensor) -> torch.Tensor:
        """A per-input-channel statistic -> one per `prev` channel (the mean over shares)."""
        if self.share == 1:
            return stat
        return stat.view(-1, self.share, self.share_width).mean(1)


def token_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over every token of t [..., H] (summed in float64: a bias is a small difference
    of large sums), [H] float32."""
    return t.reshape(-1, t.shape[-1]).double().mean(0).float()


# The captured inputs of a layer (`DenseModel.layer_forward(capture=True)`, `ScaleGroup.input`):
# key -> the decoder layer's module that reads it.
CAPTURED = {"attn_in": "qkv_proj", "o_in": "o_proj", "mlp_in": "gate_up_proj", "down_in": "down_proj"}


class DenseModel:
    """A Llama-family model's dense fp32 weights by Hugging Face name (`weights`), with the
    forward pieces a calibrating search needs, each computed by the core's model."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        if config.sliding_window:
            raise ConfigError("lmstack quantize does not support sliding-window attention models yet")
        self.config = config
        self.weights = weights
        # No bias slots: a bias is passed in wherever `weights` holds one (a search may add some).
        unbiased = dataclasses.replace(config, attention_bias=False, mlp_bias=False)
        with torch.device("meta"):
            self.model = LlamaModel(unbiased, default_linear, dtype=torch.float32, ranks=ParallelRanks())
        # The rotary tables are no weights: computed here, on the CPU.
        self.model.rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self._parts = [self._module_parts(i) for i in range(config.num_layers)]
        self._attention = [_Method(layer, "attention") for layer in self.model.layers]
        self._mlp = [_Method(layer, "mlp") for layer in self.model.layers]

    @classmethod
    def load(cls, source: Any) -> DenseModel:
        """Every tensor of `source` (a `ModelSource`) decoded to fp32 under its Hugging Face name."""
        from lmstack.model.checkpoint import to_dense

        if source.architecture.name != "llama":
            raise ConfigError(
                f"lmstack quantize supports the Llama architecture only; model {source.name!r} "
                f"is {source.architecture.name!r}"
            )
        weights = {name: to_dense(t, torch.float32).contiguous() for name, t in source.weights()}
        if source.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return cls(source.config, weights)

    # -- names ------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @staticmethod
    def prefix(i: int) -> str:
        return f"model.layers.{i}."

    def linear_names(self, i: int) -> list[str]:
        p = self.prefix(i)
        attn = [f"{p}self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        return attn + [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]

    def all_linear_names(self) -> list[str]:
        return [n for i in range(self.num_layers) for n in self.linear_names(i)]

    def _module_parts(self, i: int) -> dict[str, list[str]]:
        """Layer i's modules (`qkv_proj`, `input_layernorm`, ...) -> the Hugging Face modules
        they hold, in the order of their parts (the model's own checkpoint-name mapping)."""
        p = self.prefix(i)
        hf = [n.removesuffix(".weight") for n in self.linear_names(i)]
        hf += [p + "input_layernorm", p + "post_attention_layernorm"]
        parts: dict[str, list[tuple[int, str]]] = {}
        for name in hf:
            mapped = llama_checkpoint_name(name + ".weight", self.config)
            assert mapped is not None, name
            param, shard = mapped
            module = param.removeprefix(f"layers.{i}.").removesuffix(".weight")
            parts.setdefault(module, []).append((shard or 0, name))
        return {module: [name for _, name in sorted(ps)] for module, ps in parts.items()}

    # -- the weights a call passes in ---------------------------------------------------------

    def _get(self, name: str, w: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        return w[name] if w and name in w else self.weights.get(name)

    def _module_params(
        self, i: int, module: str, w: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Layer i's `module` weight (and bias, where `weights` holds one) as `functional_call`
        on that module takes them, from `weights` with `w` replacing some by Hugging Face name. A
        fused module's parts are concatenated; its bias takes zeros for parts without one."""
        names = self._parts[i][module]
        ws = [self._get(n + ".weight", w) for n in names]
        params = {"weight": ws[0] if len(ws) == 1 else torch.cat(ws)}
        bs = [self._get(n + ".bias", w) for n in names]
        if any(b is not None for b in bs):
            bs = [t.new_zeros(t.shape[0]) if b is None else b for b, t in zip(bs, ws)]
            params["bias"] = bs[0] if len(bs) == 1 else torch.cat(bs)
        return params

    def _params(
        self, i: int, modules: tuple[str, ...], w: dict[str, torch.Tensor] | None, prefix: str = ""
    ) -> dict[str, torch.Tensor]:
        """`_module_params` of several of layer i's modules, named from the layer (`prefix`:
        what the called module adds, e.g. `module.` for `_Method`)."""
        return {
            f"{prefix}{module}.{key}": t
            for module in modules
            for key, t in self._module_params(i, module, w).items()
        }

    def _rope(self, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rope.tables_full(torch.arange(length).repeat(b), torch.float32)

    # -- forward ----------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids -> [B, L, H]."""
        return functional_call(
            self.model.embed_tokens, {"weight": self.weights["model.embed_tokens.weight"]}, ids
        )

    def layer_forward(
        self, i: int, x: torch.Tensor, w: dict[str, torch.Tensor] | None = None, capture: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Decoder layer i on x [B, L, H], with `w` replacing some of its weights; with
        `capture`, also the inputs of its linears (the keys of `CAPTURED`, [B, L, in] each)."""
        b, length, h = x.shape
        layer = self.model.layers[i]
        captured: dict[str, torch.Tensor] = {}
        hooks = []
        if capture:
            for key, module in CAPTURED.items():

                def save(_module: nn.Module, args: tuple[Any, ...], key: str = key) -> None:
                    captured[key] = args[0].reshape(b, length, -1)

                hooks.append(getattr(layer, module).register_forward_pre_hook(save))
        params = self._params(i, tuple(self._parts[i]), w)
        try:
            out = functional_call(
                layer, params, (x.reshape(b * length, h), self._rope(b, length), _Causal(b))
            )
        finally:
            for hook in hooks:
                hook.remove()
        return out.view(b, length, h), captured

    def norm(self, i: int, which: str, x: torch.Tensor) -> torch.Tensor:
        """Layer i's RMSNorm `which` (`input_layernorm`, `post_attention_layernorm`) on x [B, L, H]."""
        norm = getattr(self.model.layers[i], which)
        return functional_call(norm, self._module_params(i, which, None), x.flatten(0, 1)).view(x.shape)

    def attention(self, i: int, h: torch.Tensor, w: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i's attention block (q/k/v, rotary embedding, attention, o_proj) on its normed
        input h [B, L, H], with `w` replacing some of its weights: [B, L, H]."""
        b, length, hidden = h.shape
        params = self._params(i, ("qkv_proj", "o_proj"), w, prefix="module.")
        out = functional_call(
            self._attention[i], params, (h.reshape(-1, hidden), self._rope(b, length), _Causal(b))
        )
        return out.view(b, length, -1)

    def mlp(self, i: int, h: torch.Tensor, w: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i's MLP on its normed input h [B, L, H], with `w` replacing some of its weights."""
        params = self._params(i, ("gate_up_proj", "down_proj"), w, prefix="module.")
        return functional_call(self._mlp[i], params, h.flatten(0, 1)).view(h.shape[0], h.shape[1], -1)

    def linear(
        self, i: int, name: str, x: torch.Tensor, w: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Layer i's unfused linear `name` (o_proj, down_proj: a Hugging Face weight name) on x."""
        module = next(m for m, parts in self._parts[i].items() if parts == [name.removesuffix(".weight")])
        return functional_call(getattr(self.model.layers[i], module), self._module_params(i, module, w), x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head on the last layer's output: logits [..., V]."""
        head = self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])
        return functional_call(self.model.lm_head, {"weight": head}, self.final_norm(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm on the last layer's output x [..., H]."""
        out = functional_call(
            self.model.norm, {"weight": self.weights["model.norm.weight"]}, x.reshape(-1, x.shape[-1])
        )
        return out.view(x.shape)

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output [B, L, H] (what the LM head reads) for token ids [B, L]."""
        x = self.embed(ids)
        for i in range(self.num_layers):
            x, _ = self.layer_forward(i, x)
        return self.final_norm(x)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The full model's logits [B, L, V] (the scale tuning's teacher; tests)."""
        x = self.embed(ids)
        for i in range(self.num_layers):
            x, _ = self.layer_forward(i, x)
        return self.head(x)

    # -- what the AWQ search folds, and bias correction --------------------------------------

    def scale_groups(self, i: int) -> list[ScaleGroup]:
        """Layer i's linears grouped by shared input, each with the op its scales fold into."""
        c, p = self.config, self.prefix(i)
        a, m = p + "self_attn.", p + "mlp."
        qkv = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        gate_up = [m + "gate_proj.weight", m + "up_proj.weight"]

        def attn_block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.attention(i, x, w)

        def mlp_block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.mlp(i, x, w)

        def linear_block(name: str) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
            return lambda x, w: self.linear(i, name, x, w)

        # o_proj's input channel (query head j, dim d) is a mix of v_proj's row (KV head
        # j // rep, dim d): a scale per v_proj row, repeated over the rep query heads of its
        # KV head, folds exactly (AutoAWQ skips o_proj under GQA instead).
        rep = c.num_heads // c.num_kv_heads
        o_share = {"share": rep, "share_width": c.head_dim} if rep > 1 else {}
        return [
            ScaleGroup("attn_in", qkv, p + "input_layernorm.weight", attn_block, clip=[a + "v_proj.weight"]),
            ScaleGroup(
                "o_in",
                [a + "o_proj.weight"],
                a + "v_proj.weight",
                linear_block(a + "o_proj.weight"),
                clip=[a + "o_proj.weight"],
                **o_share,
            ),
            ScaleGroup("mlp_in", gate_up, p + "post_attention_layernorm.weight", mlp_block, clip=gate_up),
            ScaleGroup(
                "down_in",
                [m + "down_proj.weight"],
                m + "up_proj.weight",
                linear_block(m + "down_proj.weight"),
                clip=[m + "down_proj.weight"],
            ),
        ]

    @torch.no_grad()
    def correct_biases(
        self, i: int, x: torch.Tensor, dense: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor]
    ) -> None:
        """Bias correction of layer i's two blocks: o_proj's bias gains the mean, over the tokens
        of x [B, L, H], of the dense attention block's output minus the quantized one's on the
        same input, and down_proj's the same for the MLP, its input taken after the corrected
        attention. `dense` / `quantized`: the layer's linears as the exact (scaled) dense weights
        and as served. A mean error of a block is a shift that adds up along the residual stream
        (re-quantizing already-quantized weights shifts whole groups by part of a step); the
        corrected layer's outputs are zero-mean in error on the calibration tokens."""
        p = self.prefix(i)
        o, down = p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"

        def add_bias(name: str, delta: torch.Tensor) -> torch.Tensor:
            key = name.removesuffix("weight") + "bias"
            self.weights[key] = self.weights[key] + delta if key in self.weights else delta
            return delta

        h = self.norm(i, "input_layernorm", x)
        want, got = self.attention(i, h, dense), self.attention(i, h, quantized)
        x = x + got + add_bias(o, token_mean(want - got))
        h2 = self.norm(i, "post_attention_layernorm", x)
        want, got = self.mlp(i, h2, dense), self.mlp(i, h2, quantized)
        add_bias(down, token_mean(want - got))

    def complete_biases(self) -> dict[str, bool]:
        """config.json's `attention_bias` / `mlp_bias` for the weights as they are, with a zero
        bias added to every linear of a kind (attention: q/k/v/o; MLP: gate/up/down) that has
        none where another linear of that kind has one: a Llama config biases all of a kind or
        none."""
        kinds = {
            "attention_bias": ("self_attn.", ("q", "k", "v", "o")),
            "mlp_bias": ("mlp.", ("gate", "up", "down")),
        }
        flags: dict[str, bool] = {}
        for flag, (part, names) in kinds.items():
            keys = [
                (f"{self.prefix(i)}{part}{n}_proj.bias", f"{self.prefix(i)}{part}{n}_proj.weight")
                for i in range(self.num_layers)
                for n in names
            ]
            flags[flag] = any(b in self.weights for b, _ in keys)
            if flags[flag]:
                for b, w in keys:
                    if b not in self.weights:
                        self.weights[b] = torch.zeros(self.weights[w].shape[0])
        return flags


class _Causal:
    """The `AttentionFn` of a calibration forward: B samples of equal length laid out one after
    another (B * L tokens), causal attention inside each, no KV cache."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B * L, Hq, D], k / v [B * L, Hkv, D] -> [B * L, Hq, D]."""
        b, heads, kv_heads, d = self.batch, q.shape[1], k.shape[1], q.shape[2]
        rep = heads // kv_heads
        q = q.view(b, -1, heads, d).transpose(1, 2)
        k = k.view(b, -1, kv_heads, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.view(b, -1, kv_heads, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        return o.transpose(1, 2).reshape(-1, heads, d)


class _Method(nn.Module):
    """Runs one method of `module` as its forward: `functional_call` passes weights to
    `forward` only (the prefix of their names: `module.`)."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module, self.method = module, method

    def forward(self, *args: Any) -> torch.Tensor:
        return getattr(self.module, self.method)(*args)
