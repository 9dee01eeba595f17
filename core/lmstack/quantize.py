"""`lmstack quantize`: the stack's model, dequantized to fp32, written as a quantized Hugging Face
folder through a quantizer plugin's `WeightFormat`.

Steps: build the named quantizer through the registry and ask its `weight_format()`; load every
checkpoint tensor dense (GGUF blocks decoded) into a `CalibrationModel`; when the format is
`Calibrated` (AWQ), cut the calibration text into samples and let it search (it rewrites
weights in place, and may add biases: bias correction); then encode each decoder linear and
write config.json (with the format's `quantization_config`, and `attention_bias` / `mlp_bias`
where biases were added), model.safetensors (Hugging Face tensor names, q/k/v and gate/up
unfused), the tokenizer with its chat template, generation_config.json and
lmstack_quantize.json (method, calibration source, the search's record).

The calibration forward (`CalibrationModel.layer_forward`) is a plain Llama decoder over
equal-length samples [B, L, H] with causal attention: only the Llama architecture (Llama,
Mistral without sliding window, SmolLM2) is supported.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmstack.errors import ConfigError
from lmstack.model.config import ModelConfig
from lmstack.model.rope import RotaryEmbedding, rotate
from lmstack.progress import Progress
from lmstack.quant_format import Calibrated, WeightFormat

SELF = "self"  # --calibration self: the model's own generations

# Prompts for `--calibration self`: varied registers (instructions, prose, code, lists) so the
# activation statistics are not those of one kind of text. Written for this project.
SELF_PROMPTS = (
    "Explain how a bicycle gear system works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for keeping houseplants healthy, with a sentence on each.",
    "Write a Python function that merges two sorted lists, and explain it.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a virus and a bacterium?",
    "Write a polite email asking a colleague to review a report by Friday.",
    "Summarise the causes of the French Revolution.",
    "Give a recipe for a simple vegetable soup.",
    "Explain what a hash table is and when to use one.",
    "Write a poem about autumn rain in a city.",
    "How do airplanes stay in the air?",
    "Describe a typical day of a software engineer.",
    "What should I pack for a week-long hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a dialogue between a teacher and a student about homework.",
)


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


class CalibrationModel:
    """A Llama-family model's dense fp32 weights by Hugging Face name, with the forward pieces a
    calibrating search needs. Samples are [B, L] token ids of equal length; hidden states are
    [B, L, H]."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        if config.sliding_window:
            raise ConfigError("lmstack quantize does not support sliding-window attention models yet")
        self.config = config
        self.weights = weights
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    @classmethod
    def load(cls, source: Any) -> CalibrationModel:
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

    # -- forward ----------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weights["model.embed_tokens.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.weights[name] * x

    def _linear(self, x: torch.Tensor, name: str, w: dict[str, torch.Tensor] | None) -> torch.Tensor:
        weight = w[name] if w and name in w else self.weights[name]
        bias = self.weights.get(name.removesuffix("weight") + "bias")
        return F.linear(x, weight, bias)

    def _attention(self, i: int, x: torch.Tensor, w: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """Attention of layer i on its normed input x [B, L, H], before o_proj: [B, L, q_size]."""
        c, p = self.config, self.prefix(i) + "self_attn."
        b, length, _ = x.shape
        q = self._linear(x, p + "q_proj.weight", w).view(b * length, c.num_heads, c.head_dim)
        k = self._linear(x, p + "k_proj.weight", w).view(b * length, c.num_kv_heads, c.head_dim)
        v = self._linear(x, p + "v_proj.weight", w).view(b, length, c.num_kv_heads, c.head_dim)
        positions = torch.arange(length).repeat(b)
        cos, sin = self.rope.tables(positions, x.dtype)
        q = rotate(q, cos, sin).view(b, length, c.num_heads, c.head_dim).transpose(1, 2)
        k = rotate(k, cos, sin).view(b, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim**-0.5)
        return o.transpose(1, 2).reshape(b, length, c.q_size)

    def _mlp_act(self, i: int, x: torch.Tensor, w: dict[str, torch.Tensor] | None) -> torch.Tensor:
        p = self.prefix(i) + "mlp."
        return F.silu(self._linear(x, p + "gate_proj.weight", w)) * self._linear(x, p + "up_proj.weight", w)

    def layer_forward(
        self, i: int, x: torch.Tensor, w: dict[str, torch.Tensor] | None = None, capture: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Decoder layer i on x [B, L, H], with `w` replacing some of its weights; with
        `capture`, also the inputs of its linears (the keys `ScaleGroup.input` names)."""
        p = self.prefix(i)
        h = self._norm(x, p + "input_layernorm.weight")
        attn = self._attention(i, h, w)
        x = x + self._linear(attn, p + "self_attn.o_proj.weight", w)
        h2 = self._norm(x, p + "post_attention_layernorm.weight")
        act = self._mlp_act(i, h2, w)
        out = x + self._linear(act, p + "mlp.down_proj.weight", w)
        captured = {"attn_in": h, "o_in": attn, "mlp_in": h2, "down_in": act} if capture else {}
        return out, captured

    def scale_groups(self, i: int) -> list[ScaleGroup]:
        """Layer i's linears grouped by shared input, each with the op its scales fold into."""
        c, p = self.config, self.prefix(i)
        a, m = p + "self_attn.", p + "mlp."
        qkv = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        gate_up = [m + "gate_proj.weight", m + "up_proj.weight"]

        def attn_block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._linear(self._attention(i, x, w), a + "o_proj.weight", w)

        def mlp_block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._linear(self._mlp_act(i, x, w), m + "down_proj.weight", w)

        def linear_block(name: str) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
            return lambda x, w: self._linear(x, name, w)

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

        h = self._norm(x, p + "input_layernorm.weight")
        want = self._linear(self._attention(i, h, dense), o, dense)
        got = self._linear(self._attention(i, h, quantized), o, quantized)
        x = x + got + add_bias(o, token_mean(want - got))
        h2 = self._norm(x, p + "post_attention_layernorm.weight")
        want = self._linear(self._mlp_act(i, h2, dense), down, dense)
        got = self._linear(self._mlp_act(i, h2, quantized), down, quantized)
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

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head on the last layer's output: logits [..., V]."""
        x = self._norm(x, "model.norm.weight")
        head = self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])
        return F.linear(x, head)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The full model's logits [B, L, V] (the scale tuning's teacher; tests)."""
        x = self.embed(ids)
        for i in range(self.num_layers):
            x, _ = self.layer_forward(i, x)
        return self.head(x)


# ---------------------------------------------------------------------------------------------
# Calibration text
# ---------------------------------------------------------------------------------------------


def split_validation(
    samples: torch.Tensor, num_samples: int, wanted: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(search samples, validation samples) of `calibration_samples(ids, num_samples + wanted,
    ...)`: the last `wanted` when the text gave them all, else at most a fifth of what it gave."""
    n = samples.shape[0]
    n_val = wanted if n >= num_samples + wanted else min(wanted, n // 5)
    return samples[: n - n_val], samples[n - n_val :]


def calibration_samples(ids: list[int], num_samples: int, seq_len: int) -> torch.Tensor:
    """Consecutive chunks of `seq_len` tokens from the start of `ids`, at most `num_samples`."""
    count = min(num_samples, len(ids) // seq_len)
    if count < 1:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens, fewer than one sample of --seq-len {seq_len}"
        )
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def generate_calibration_text(stack: Any, num_tokens: int, *, seed: int = 0) -> str:
    """The stack's model's own answers to `SELF_PROMPTS` (sampled, temperature 0.8, fixed seed),
    repeated with new seeds until they hold `num_tokens` tokens."""
    from lmstack.llm import LLM
    from lmstack.sampling_params import SamplingParams

    llm = LLM(stack)
    try:
        texts: list[str] = []
        total, round_ = 0, 0
        bar = Progress(num_tokens, "calibration text", "tokens")
        while total < num_tokens:
            params = [
                SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512, seed=seed + round_ * 1000 + k)
                for k in range(len(SELF_PROMPTS))
            ]
            outs = llm.chat([[{"role": "user", "content": p}] for p in SELF_PROMPTS], params)
            for out in outs:
                texts.append(out.text.strip())
                total += len(out.token_ids)
                bar.update(len(out.token_ids))
            round_ += 1
        bar.close()
        return "\n\n".join(texts) + "\n"
    finally:
        llm.engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Writing the folder
# ---------------------------------------------------------------------------------------------


def hf_config(source: Any) -> dict[str, Any]:
    """config.json for the dense model: the folder's own for a Hugging Face source, rebuilt from
    the metadata for a GGUF file."""
    if source.format == "hf":
        cfg = dict(json.loads((source.path / "config.json").read_text(encoding="utf-8")))
        cfg.pop("quantization_config", None)
        return cfg
    c: ModelConfig = source.config
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
    }
    return cfg


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def write_tokenizer(source: Any, out: Path) -> None:
    """The tokenizer, chat template and generation config: copied from a Hugging Face folder;
    for a GGUF file, tokenizer.json from the tokenizer lmstack built from its metadata."""
    if source.format == "hf":
        for name in _TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, out / name)
        return
    tok, c = source.tokenizer, source.config
    tok.backend.save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c.max_position_embeddings,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    tok_config |= {k: v for k, v in tok.template_tokens.items()}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    _write_json(out / "tokenizer_config.json", tok_config)
    gen: dict[str, Any] = {"bos_token_id": c.bos_token_id}
    if c.eos_token_ids:
        gen["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    _write_json(out / "generation_config.json", gen)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def encode_model(model: CalibrationModel, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors: the decoder linears through `fmt.encode`
    (under `<module>.<suffix>`), everything else dense fp32."""
    linears = set(model.all_linear_names())
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.weights.items():
        if name in linears:
            module = name.removesuffix(".weight")
            for suffix, t in fmt.encode(module, tensor).items():
                tensors[f"{module}.{suffix}"] = t.contiguous()
        else:
            tensors[name] = tensor.contiguous()
    return tensors


def prepare_out_dir(out: str | Path) -> Path:
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--out {path} exists and is not an empty folder; pick a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def build_weight_format(
    stack: Any, method: str, group_size: int | None, model_config: ModelConfig
) -> tuple[WeightFormat, Any]:
    """The `WeightFormat` of quantizer `method`, built through the registry with the stack's
    device and dtype. Its options: those of the stack's `quant` section when that names the
    same quantizer (e.g. `quant: {weights: rtn-int4, symmetric: true}`), and `group_size`
    when given."""
    import msgspec

    from lmstack.build import _blame
    from lmstack.interfaces import BuildContext
    from lmstack.plugins import default_registry
    from lmstack.resolve import resolve

    quant: dict[str, Any] = {"weights": method, "kv_cache": "none"}
    if stack.quant.get("weights") == method:
        quant |= {k: v for k, v in stack.quant.items() if k not in ("weights", "kv_cache")}
    if group_size is not None:
        quant["group_size"] = group_size
    resolved = resolve(msgspec.structs.replace(stack, quant=quant), default_registry())
    sel = resolved.selected["quantizer"]
    ctx = BuildContext(model_config, resolved.device, resolved.dtype, resolved.kv_cache_dtype)
    with _blame("quantizer", sel):
        quantizer = sel.component.factory(sel.options, ctx)
    fmt = quantizer.weight_format()
    if fmt is None:
        raise ConfigError(f"quantizer {method!r} reads checkpoints but cannot write them (no weight format)")
    return fmt, sel


def quantize(
    stack: Any,
    method: str,
    out: str | Path,
    *,
    group_size: int | None = None,
    calibration: str | None = None,
    num_samples: int = 32,
    seq_len: int = 512,
) -> Path:
    """Write the quantized folder `out` for the stack's model; returns its path."""
    from safetensors.torch import save_file

    from lmstack.hardware import cpu_description
    from lmstack.model.source import open_model_source

    started = time.perf_counter()
    source = open_model_source(stack.model)
    fmt, sel = build_weight_format(stack, method, group_size, source.config)
    out_dir = prepare_out_dir(out)
    try:
        model = CalibrationModel.load(source)
        record: dict[str, Any] = {
            "method": method,
            "quantizer_options": sel.describe().get("options", {}),
            "source_model": stack.model,
            "source_format": source.format,
            "compute": "float32",
            **cpu_description(),  # the search's fp32 sums, and so its choices, follow the kernels
        }
        if isinstance(fmt, Calibrated):
            # A format may validate on samples its search does not see (`validation_samples`,
            # the scale tuning's): they are cut after --num-samples and passed on their own.
            extra = int(getattr(fmt, "validation_samples", 0))
            text, origin = _calibration_text(stack, calibration, (num_samples + extra) * seq_len)
            samples = calibration_samples(source.tokenizer.encode(text), num_samples + extra, seq_len)
            kwargs: dict[str, Any] = {}
            if extra:
                samples, kwargs["validation"] = split_validation(samples, num_samples, extra)
            record["calibration"] = {
                "source": origin,
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "num_samples": int(samples.shape[0]),
                "seq_len": seq_len,
            }
            if extra:
                record["calibration"]["validation_samples"] = int(kwargs["validation"].shape[0])
            if origin == SELF:
                (out_dir / "calibration.txt").write_text(text, encoding="utf-8")
            fmt.calibrate(model, samples, progress=Progress, **kwargs)
            record["search"] = fmt.calibration_record()
        biases = model.complete_biases()  # bias correction may have added some
        tensors = encode_model(model, fmt)
        ignore = ["lm_head"]
        config = (
            hf_config(source)
            | {k: v for k, v in biases.items() if v}
            | {
                "quantization_config": fmt.quantization_config(ignore),
                "torch_dtype": "float32",
            }
        )
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        _write_json(out_dir / "config.json", config)
        write_tokenizer(source, out_dir)
        record["seconds"] = round(time.perf_counter() - started, 1)
        _write_json(out_dir / "lmstack_quantize.json", record)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)  # no half-written folder that looks servable
        raise
    return out_dir


def _calibration_text(stack: Any, calibration: str | None, num_tokens: int) -> tuple[str, str]:
    """(text, where it came from) for --calibration."""
    if calibration in (None, SELF):
        return generate_calibration_text(stack, num_tokens), SELF
    from lmstack.evaluate import read_text

    return read_text(calibration), str(calibration)


def run_cli(args: Any) -> int:
    from lmstack.evaluate import load_stack_with_model

    stack = load_stack_with_model(args.stack, args.model)
    out = quantize(
        stack,
        args.method,
        args.out,
        group_size=args.group_size,
        calibration=args.calibration,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({math.ceil(size / 2**20)} MiB): serve it with `model: {out}`")
    return 0
