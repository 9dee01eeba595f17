"""The EAGLE-1 draft head (Li et al. 2024) and its folder format.

For position t the head reads fc(concat(embed(token_{t+1}), f_t)), with f_t the target's final
norm output at t and embed the target's embedding, runs one Llama decoder layer over it (causal
self-attention with RoPE over the head's own earlier positions, then a SwiGLU MLP; as in EAGLE-1
the layer has no input norm and the head no final norm) and returns f'_{t+1}, the predicted
feature of the next position: the target's LM head turns it into draft logits.

A head folder is what EAGLE-1 and vLLM's EAGLE loader read: `config.json` (a Llama config with
`num_hidden_layers: 1`) and `model.safetensors` with `fc.weight` (`fc.bias` when the config's
`bias` is true), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight` and `layers.0.post_attention_layernorm.weight`. A
`model.` prefix on the names (some exports) is accepted when loading.

Heads trained here ship with the distribution (`heads/NAME/`, NAME the target's known model
name): a bare name without a slash that one of them carries names it, anything else is a folder
(`head_path`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.errors import ConfigError
from lmstack.model.rope import RotaryEmbedding, rotate

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# lmstack's own addition: the token ids of the head's training text, most frequent first (the
# `draft_vocab` option drafts only among the first N of them).
VOCAB_FILE = "draft_vocab.json"
# Heads shipped with the distribution, one folder per target model name.
BUNDLED_HEADS = Path(__file__).parent / "heads"


def bundled_heads() -> list[str]:
    """The names of the heads this distribution ships."""
    if not BUNDLED_HEADS.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_HEADS.iterdir() if (p / CONFIG_FILE).is_file())


def head_path(head: str | Path) -> Path:
    """The folder a `head` value names: a bundled head's for a bare name it carries (as a model's
    known name does), else the path itself (`~` expanded). `./NAME` reaches a local folder of
    the same name."""
    text = str(head)
    bundled = BUNDLED_HEADS / text.lower()
    if "/" not in text and (bundled / CONFIG_FILE).is_file():
        return bundled
    return Path(text).expanduser()


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    bias: bool = True  # fc has a bias (EAGLE-1's default)

    @classmethod
    def for_target(cls, mc: Any, bias: bool = True) -> HeadConfig:
        """A head shaped like one decoder layer of the target (`lmstack.model.config.ModelConfig`)."""
        return cls(
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_attention_heads=mc.num_heads,
            num_key_value_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            rms_norm_eps=mc.rms_norm_eps,
            rope_theta=mc.rope_theta,
            rope_scaling=mc.rope_scaling,
            max_position_embeddings=mc.max_position_embeddings,
            bias=bias,
        )

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> HeadConfig:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bias=bool(cfg.get("bias", True)),
        )

    def to_json(self) -> dict[str, Any]:
        """A Llama config (what EAGLE / vLLM read) with the head's single layer."""
        d = asdict(self)
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            num_hidden_layers=1,
            hidden_act="silu",
        )
        return d


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, q, kv = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        self.fc = nn.Linear(2 * h, h, bias=cfg.bias)
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    # -- the EAGLE names ------------------------------------------------------------------------

    def eagle_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(dtype).contiguous() for k, v in self._targets().items()}

    def load_eagle_state_dict(self, tensors: dict[str, torch.Tensor], where: str = "head") -> None:
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        missing = [k for k in self._targets() if k not in tensors]
        if missing:
            raise ConfigError(f"{where}: missing tensors {', '.join(missing)}", "speculator.head")
        with torch.no_grad():
            for name, target in self._targets().items():
                t = tensors[name]
                if tuple(t.shape) != tuple(target.shape):
                    raise ConfigError(
                        f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(target.shape)}",
                        "speculator.head",
                    )
                target.copy_(t.to(target.dtype))

    def _targets(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight}
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias
        for n in ("q", "k", "v", "o"):
            out[f"layers.0.self_attn.{n}_proj.weight"] = getattr(self, f"{n}_proj").weight
        for n in ("gate", "up", "down"):
            out[f"layers.0.mlp.{n}_proj.weight"] = getattr(self, f"{n}_proj").weight
        out["layers.0.post_attention_layernorm.weight"] = self.post_attention_layernorm
        return out

    # -- forward --------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return self.post_attention_layernorm * xf.to(x.dtype)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's T new positions: embeds (of token t+1) and features (f_t) [T, H] at
        `positions` [T], attending to `past_k` / `past_v` [P, kv_heads, head_dim] (the head's
        cache of the P positions before) and causally to each other. Returns the predicted next
        features [T, H] and the new positions' keys and values [T, kv_heads, head_dim]."""
        c = self.cfg
        x = self.fuse(embeds, features)
        t = x.shape[0]
        q, k, v = self.qkv(x, positions)
        keys = k if past_k is None else torch.cat((past_k, k))
        values = v if past_v is None else torch.cat((past_v, v))
        p = keys.shape[0] - t
        rep = c.num_attention_heads // c.num_key_value_heads
        kk = keys.transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, P+T, D]
        vv = values.transpose(0, 1).repeat_interleave(rep, dim=0)
        if t == 1:
            mask = None
        else:
            mask = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=c.head_dim**-0.5)
        return self.finish(x, o.transpose(0, 1)), k, v

    # The forward's pieces, shared with the trainer's unrolled chain (lmstack_eagle.train).

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc over [embed(token_{t+1}), f_t], [T, H]."""
        return self.fc(torch.cat((embeds, features), dim=-1))

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values of x [T, H]: [T, heads, D], [T, kv_heads, D] x 2."""
        c = self.cfg
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        cos, sin = self.rope.tables(positions, x.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: attn [T, heads, D] -> the predicted features [T, H]."""
        x = x + self.o_proj(attn.reshape(attn.shape[0], -1))
        h = self._norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


# -- the folder ---------------------------------------------------------------------------------


def save_head(
    head: EagleHead,
    folder: str | Path,
    extra_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the folder; `dtype` is the tensors' (and config.json's `torch_dtype`)."""
    from safetensors.torch import save_file

    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg.to_json()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.update(extra_config or {})
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(head.eagle_state_dict(dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def read_head_config(folder: str | Path) -> HeadConfig:
    path = head_path(folder)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"EAGLE head {str(folder)!r} is neither a folder with {CONFIG_FILE} nor a bundled head "
            f"({', '.join(bundled_heads()) or 'none installed'}); build one with "
            f"`lmstack eagle train --stack STACK --out {folder}`",
            "speculator.head",
        )
    try:
        return HeadConfig.from_json(json.loads((path / CONFIG_FILE).read_text()))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"EAGLE head {str(folder)!r}: bad {CONFIG_FILE} ({e})", "speculator.head") from e


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    from safetensors.torch import load_file

    path = head_path(folder)
    cfg = read_head_config(path)
    files = (
        [path / WEIGHTS_FILE] if (path / WEIGHTS_FILE).is_file() else sorted(path.glob("model*.safetensors"))
    )
    if not files:
        raise ConfigError(f"EAGLE head {str(folder)!r} has no {WEIGHTS_FILE}", "speculator.head")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    head = EagleHead(cfg)
    head.load_eagle_state_dict(tensors, f"EAGLE head {str(folder)!r}")
    return head.to(dtype).eval()


def save_draft_vocab(folder: str | Path, token_ids: list[int]) -> None:
    (Path(folder).expanduser() / VOCAB_FILE).write_text(json.dumps([int(t) for t in token_ids]) + "\n")


def read_draft_vocab(folder: str | Path, n: int) -> list[int]:
    """The head's n most frequent training tokens; ConfigError when the folder has no list."""
    path = head_path(folder) / VOCAB_FILE
    if not path.is_file():
        raise ConfigError(
            f"draft_vocab needs {VOCAB_FILE} in the head folder (written by `lmstack eagle train`); "
            f"{str(folder)!r} has none",
            "speculator.draft_vocab",
        )
    return json.loads(path.read_text())[:n]
