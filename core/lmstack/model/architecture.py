"""Model architectures and their registry.

A plugin offers a model through the `lmstack_register_models(register)` hook by registering a
`ModelArchitecture`: the names checkpoints use for it, how to read its config, how to build it,
and how checkpoint tensor names map to its parameters. Models are not a stack-selected component
kind: the checkpoint's own architecture (config.json `architectures`, GGUF
`general.architecture`) picks one from the `ModelRegistry`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lmstack.errors import ConfigError, ResolutionError

if TYPE_CHECKING:
    import pluggy

    from lmstack.interfaces import LinearFactory
    from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor
    from lmstack.model.config import ModelConfig
    from lmstack.model.weight_loader import ShardId


class AttentionFn(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]."""


class CausalLM(Protocol):
    """What the model runner needs of a built model (an `nn.Module`)."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        hidden_state_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, positions: [T] -> (logits [L, V] fp32, {layer: hidden [L, H]}). A model
        that serves drafters reading every position's state (`Speculator.hidden_state_positions
        = "all"`) also takes the keyword `hidden_rows` [R]: the hidden states come back at those
        rows ([R, H]) instead of at `logits_indices`."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Map checkpoint names to parameters and call their weight loaders."""


class ModelBuilder(Protocol):
    def __call__(
        self, config: ModelConfig, linear: LinearFactory, *, dtype: torch.dtype, max_positions: int
    ) -> nn.Module:
        """An unloaded model (parameters allocated, not initialised) on the current default
        device, floating parameters in `dtype` unless the linear factory chooses otherwise."""


HFConfigParser = Callable[[Mapping[str, Any], str], "ModelConfig"]
"""(config.json as a dict, model name) -> ModelConfig, without `quantization` (the source adds it)."""

GGUFConfigParser = Callable[[Mapping[str, Any], Mapping[str, "GGUFTensor"], str], "ModelConfig"]
"""(GGUF metadata, tensors by GGUF name, model name) -> ModelConfig."""

GGUFTensorAdapter = Callable[
    [str, "GGUFTensor", "ModelConfig"], "tuple[str, GGUFTensor] | list[tuple[str, GGUFTensor]] | None"
]
"""(GGUF tensor name, tensor, config) -> (Hugging Face checkpoint name, tensor with llama.cpp's
conversion edits undone), a list of them for a tensor that stacks several (a MoE layer's
experts), or None for a tensor that is not a weight."""

CheckpointNameMapping = Callable[[str, "ModelConfig"], "tuple[str, ShardId | None] | None"]
"""(Hugging Face checkpoint name, config) -> (parameter name, shard id), or None to skip it."""


@dataclass(frozen=True)
class ModelArchitecture:
    name: str
    build: ModelBuilder
    checkpoint_name: CheckpointNameMapping
    hf_architectures: tuple[str, ...] = ()  # config.json "architectures" entries it serves
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type", when "architectures" is absent
    parse_hf_config: HFConfigParser | None = None
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values it serves
    parse_gguf_config: GGUFConfigParser | None = None
    gguf_tensor: GGUFTensorAdapter | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if (self.hf_architectures or self.hf_model_types) and self.parse_hf_config is None:
            raise ResolutionError(
                f"model architecture {self.name!r} names HF architectures but no parse_hf_config"
            )
        if self.gguf_architectures and (self.parse_gguf_config is None or self.gguf_tensor is None):
            raise ResolutionError(
                f"model architecture {self.name!r} names GGUF architectures but lacks parse_gguf_config "
                "or gguf_tensor"
            )


class ModelRegistry:
    """The installed architectures, looked up by the names checkpoints use."""

    def __init__(self, architectures: Iterable[ModelArchitecture] = ()) -> None:
        self._by_name: dict[str, ModelArchitecture] = {}
        self._hf: dict[str, ModelArchitecture] = {}
        self._hf_types: dict[str, ModelArchitecture] = {}
        self._gguf: dict[str, ModelArchitecture] = {}
        for arch in architectures:
            self.add(arch)

    def add(self, arch: ModelArchitecture) -> None:
        if not isinstance(arch, ModelArchitecture):
            raise ResolutionError(
                f"register() in lmstack_register_models got a {type(arch).__name__}; expected a "
                "lmstack.model.architecture.ModelArchitecture"
            )
        tables = [
            (self._by_name, (arch.name,), "model architecture"),
            (self._hf, arch.hf_architectures, "Hugging Face architecture"),
            (self._hf_types, arch.hf_model_types, "Hugging Face model_type"),
            (self._gguf, arch.gguf_architectures, "GGUF architecture"),
        ]
        for table, keys, label in tables:
            for key in keys:
                if key in table:
                    raise ResolutionError(
                        f"{label} {key!r} is registered twice (by {table[key].name!r} and {arch.name!r})"
                    )
        for table, keys, _ in tables:
            for key in keys:
                table[key] = arch

    @property
    def architectures(self) -> list[ModelArchitecture]:
        return list(self._by_name.values())

    def for_hf(self, config: Mapping[str, Any], where: str) -> ModelArchitecture:
        """The architecture of a config.json: its first `architectures` entry anyone serves, else
        its `model_type`."""
        names = config.get("architectures") or []
        for name in names:
            if name in self._hf:
                return self._hf[name]
        model_type = config.get("model_type")
        if not names and model_type in self._hf_types:
            return self._hf_types[model_type]
        asked = ", ".join(names) if names else f"model_type {model_type!r}"
        installed = ", ".join(sorted(self._hf)) or "none"
        raise ConfigError(
            f"{where} is a {asked} model, which no installed plugin serves (installed: {installed})"
        )

    def for_gguf(self, gguf_architecture: str | None, where: str) -> ModelArchitecture:
        if gguf_architecture in self._gguf:
            return self._gguf[gguf_architecture]
        installed = ", ".join(sorted(self._gguf)) or "none"
        raise ConfigError(
            f"{where}: GGUF architecture {gguf_architecture!r} is not served by any installed plugin "
            f"(installed: {installed})"
        )


def build_model_registry(pm: pluggy.PluginManager) -> ModelRegistry:
    """Call every `lmstack_register_models` hook; a plugin's failure is one line naming it."""
    registry = ModelRegistry()
    tolerant = getattr(pm, "tolerant", set())  # autoloaded entry points: skipped when broken
    for impl in pm.hook.lmstack_register_models.get_hookimpls():
        try:
            impl.function(register=registry.add)
        except (ConfigError, ResolutionError) as exc:
            if id(impl.plugin) not in tolerant:
                raise
            _skip(pm, impl.plugin, str(exc))
        except Exception as exc:
            message = f"failed in lmstack_register_models: {type(exc).__name__}: {exc}"
            if id(impl.plugin) not in tolerant:
                raise ResolutionError(f"plugin {pm.get_name(impl.plugin)!r} {message}") from exc
            _skip(pm, impl.plugin, message)
    return registry


def _skip(pm: pluggy.PluginManager, plugin: object, message: str) -> None:
    from lmstack.stack.plugins import PluginProblem, origin_of, warn

    dist, version = origin_of(pm, plugin)
    warn(PluginProblem(pm.get_name(plugin) or "?", dist, version, " ".join(message.split())))


@functools.cache
def default_model_registry() -> ModelRegistry:
    """The built-in architectures only (what a caller without a plugin manager gets)."""
    from lmstack.stack.plugins import make_plugin_manager

    return build_model_registry(make_plugin_manager(autoload=False))
