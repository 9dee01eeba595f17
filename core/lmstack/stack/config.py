"""The stack file: which model, which components, and their options.

Component sections stay raw mappings here (``{name: ..., **options}``): a component's options
belong to the plugin that provides it, so they are converted to its `options_type` only when the
stack is resolved against the installed components (`lmstack.stack.resolve`). Every error is a
`ConfigError` naming the full key path (``scheduler.max_num_seqs``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

from lmstack.errors import ConfigError
from lmstack.roles import NAMED_SECTIONS, ROLE

# Names the stack accepts for dtypes; each is an attribute of `torch` (`torch.bfloat16`, ...).
MODEL_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_AUTO = "auto"  # the default: `lmstack.kernels.hardware.auto_dtype` picks per device
KV_CACHE_DTYPES = (*MODEL_DTYPES, "float8_e4m3fn", "float8_e5m2")
# Other spellings `quant.kv_cache` accepts (the names quantization tools and issues use).
KV_CACHE_ALIASES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

# `quant.kv_cache`: "auto" follows the weights quantizer (or the model dtype); "none" means no
# KV-cache quantization, i.e. the model dtype, whatever the quantizer would pick.
KV_CACHE_AUTO = "auto"
KV_CACHE_NONE = "none"
# `quant.weights`: "auto" picks the installed quantizer that reads the checkpoint's format.
QUANT_AUTO = "auto"

# The reference backend: `attention: auto`'s last resort.
DEFAULT_ATTENTION = ROLE["attention_prefill"].default
# `attention.<phase>: auto` (the default): the installed backend ranked best for the device
# (`auto_rank` capability) that fits this stack and machine, else the reference backend
# (`lmstack.stack.resolve`).
ATTENTION_AUTO = "auto"
# `device: auto` (the default): cuda where torch sees a GPU, else cpu.
DEVICE_AUTO = "auto"
# `cache: auto` (the default): the installed cache ranked best for the device (`auto_rank`,
# lmstack-prefix-cache's prefix caching) that fits the stack, else `none`.
CACHE_AUTO = "auto"
# What an absent (or name-less) section of each single-role kind means: its role's built-in
# component, except where an `auto` is the default.
SECTION_DEFAULTS: dict[str, str] = {**NAMED_SECTIONS, "cache": CACHE_AUTO}
ATTENTION_PHASES = ("prefill", "decode")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


def _named(name: str) -> Any:
    return msgspec.field(default_factory=lambda: {"name": name})


def _default_attention() -> dict[str, dict[str, Any]]:
    return {phase: {"name": ATTENTION_AUTO} for phase in ATTENTION_PHASES}


def _default_quant() -> dict[str, Any]:
    return {"weights": QUANT_AUTO, "kv_cache": KV_CACHE_AUTO}


# The fields of StackConfig, in file order. Component sections come from the role table
# (`lmstack.roles`), so a new kind gets its section without an edit here; `attention` (a kernel
# per phase) and `quant` (weights and KV cache) have shapes of their own.
_SCALAR_FIELDS: list[tuple[str, Any, Any]] = [
    ("model", str, "smollm2-135m-instruct"),
    # "auto": what this device computes best (`lmstack.kernels.hardware.auto_dtype`).
    ("dtype", Literal["auto", "float32", "float16", "bfloat16"], DTYPE_AUTO),
    ("device", str, DEVICE_AUTO),
    ("max_model_len", PositiveInt | None, None),
    ("seed", NonNegativeInt, 0),
]
_SECTION_FIELDS: list[tuple[str, Any, Any]] = [
    (section, dict[str, Any], _named(default)) for section, default in SECTION_DEFAULTS.items()
] + [
    ("attention", dict[str, dict[str, Any]], msgspec.field(default_factory=_default_attention)),
    ("quant", dict[str, Any], msgspec.field(default_factory=_default_quant)),
]
# Top-level sections a plugin declares (lmstack-api's `server:`), kept raw until `resolve`
# converts them with the type the plugin registered; a section nobody declares is an error there.
EXTRA = "extra_sections"

StackConfig = msgspec.defstruct(
    "StackConfig",
    [*_SCALAR_FIELDS, *_SECTION_FIELDS, (EXTRA, dict[str, Any], msgspec.field(default_factory=dict))],
    forbid_unknown_fields=True,
    frozen=True,
    module=__name__,
)
StackConfig.__doc__ = """A parsed stack file. Sections are normalised by `load_stack`:

- one section per single-role kind (scheduler, allocator, speculator, parallel, cache, ...):
  ``{"name": str, **options}``;
- `attention`: ``{"prefill": {"name": str, **options}, "decode": {...}}``;
- `quant`: ``{"weights": str, "kv_cache": "auto" | "none" | dtype, **weight options}``;
- `extra_sections`: every other top-level key, raw, for the plugins that declare them.
"""

# Top-level keys the core owns; a plugin may not declare a section by one of these names.
CORE_KEYS: tuple[str, ...] = tuple(name for name, *_ in (*_SCALAR_FIELDS, *_SECTION_FIELDS))


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_stack(
    source: str | os.PathLike[str] | Mapping[str, Any] | StackConfig,
    overrides: Mapping[str, Any] | None = None,
) -> StackConfig:
    """Parse a stack from a YAML file path, an already-loaded mapping, or a model alone (a known
    name, a .gguf file, a Hugging Face folder or Hub id: that model with every default).
    `overrides` maps dotted key paths to values (`scheduler.max_num_seqs: 8`), each set over
    the stack as if the file said so (`--set`, `LLM(model=..., dtype=...)`)."""
    if isinstance(source, StackConfig):
        if not overrides:
            return source
        source = msgspec.to_builtins(source)
        source.update(source.pop(EXTRA))  # `server:` back at the top, where an override names it
    data: Any = source if isinstance(source, Mapping) else stack_mapping(source)
    if overrides:
        from lmstack.stack.overrides import apply_overrides

        data = apply_overrides(data, overrides)
    return stack_from_mapping(data)


def stack_mapping(source: str | os.PathLike[str]) -> Any:
    """The stack as written, before any default: a stack file's parsed YAML, or `{model: SOURCE}`
    when `source` names a model (a tool that rewrites a stack, `lmstack tune`, keeps what the
    user wrote)."""
    model = _model_only(source)
    return {"model": model} if model is not None else _read_stack_file(Path(source))


def _model_only(source: str | os.PathLike[str]) -> str | None:
    """`source` as a model when it names one rather than a stack file: a .gguf file, a folder
    with config.json, or (not being a file here) a known name or Hub id. A .yaml path is a
    stack file, there or not."""
    path = Path(source)
    if path.suffix.lower() in (".yaml", ".yml"):
        return None
    if path.is_file():
        return str(source) if path.suffix.lower() == ".gguf" else None
    if path.is_dir():
        return str(source) if (path / "config.json").is_file() else None
    from lmstack.model.source import KNOWN_MODELS, MADE_BY, HubModel  # deferred: loads torch

    text = str(source)
    if text.lower() in KNOWN_MODELS or path.as_posix() in MADE_BY or HubModel.parse(text) is not None:
        return text
    return None


def _read_stack_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        not_a_model = (
            ""
            if path.suffix.lower() in (".yaml", ".yml")
            else " (nor is it a model: a known name, a .gguf file, a Hugging Face folder or Hub id)"
        )
        raise ConfigError(f"stack file not found: {path}{not_a_model}") from None
    except IsADirectoryError:
        raise ConfigError(f"stack file {path} is a directory (a model folder needs config.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read stack file {path}: {exc}") from None
    return _parse_yaml(text, str(path))


def parse_stack(text: str, filename: str = "<stack>") -> StackConfig:
    """Parse a stack from YAML text; `filename` only appears in error messages."""
    return stack_from_mapping(_parse_yaml(text, filename))


def _parse_yaml(text: str, filename: str) -> Mapping[str, Any]:
    try:
        data = yaml.load(text, Loader=_StackLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_message(exc, filename)) from None
    if data is None:  # an empty file: every default
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{filename}: a stack file must be a mapping of keys to values, got {_kind(data)}")
    return data


def stack_from_mapping(data: Mapping[str, Any]) -> StackConfig:
    raw = dict(data)
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}")
    for section, default in SECTION_DEFAULTS.items():
        if section in raw:
            raw[section] = _named_section(raw[section], section, default)
    if "attention" in raw:
        raw["attention"] = _attention_section(raw["attention"])
    if "quant" in raw:
        raw["quant"] = _quant_section(raw["quant"])
    if "dtype" in raw:
        _check_choice(raw["dtype"], (DTYPE_AUTO, *MODEL_DTYPES), "dtype")
    extra = dict(raw.pop(EXTRA, None) or {})  # a StackConfig turned back into a mapping
    for key in [k for k in raw if k not in CORE_KEYS]:
        extra[key] = raw.pop(key)
    # `server:` alone (null) asks for the section's defaults, as an absent one does.
    raw[EXTRA] = {k: v for k, v in extra.items() if v is not None}
    stack = convert(raw, StackConfig)
    _check_device(stack.device)
    return stack


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def _named_section(value: Any, path: str, default: str) -> dict[str, Any]:
    """`{name: X, **options}`; a bare string is a name; null means the default component."""
    if value is None:
        return {"name": default}
    if isinstance(value, str):
        return {"name": _check_name(value, f"{path}.name")}
    section = _mapping(value, path)
    section["name"] = _check_name(section.get("name", default), f"{path}.name")
    return section


def _attention_section(value: Any) -> dict[str, dict[str, Any]]:
    """A kernel name for both phases, ``{name: X, **options}`` for both phases, or
    ``{prefill: X | {name: X, **options}, decode: ...}``."""
    if value is None:
        return _default_attention()
    if isinstance(value, str):
        name = _check_name(value, "attention")
        return {phase: {"name": name} for phase in ATTENTION_PHASES}
    section = _mapping(value, "attention")
    if "name" in section:
        for phase in ATTENTION_PHASES:
            if phase in section:
                raise ConfigError(
                    "give either one kernel (name) or one per phase (prefill, decode), not both",
                    f"attention.{phase}",
                )
        section["name"] = _check_name(section["name"], "attention.name")
        return {phase: dict(section) for phase in ATTENTION_PHASES}
    for key in section:
        if key not in ATTENTION_PHASES:
            raise ConfigError(
                "unknown key; expected prefill and decode (a kernel each), or name (one kernel for both)",
                f"attention.{key}",
            )
    return {
        phase: _named_section(section.get(phase), f"attention.{phase}", ATTENTION_AUTO)
        for phase in ATTENTION_PHASES
    }


def _quant_section(value: Any) -> dict[str, Any]:
    """``{weights: NAME, kv_cache: auto | none | DTYPE, **options of the weights quantizer}``;
    a bare string names the weights quantizer."""
    if value is None:
        value = {}
    elif isinstance(value, str):
        value = {"weights": value}
    section = _mapping(value, "quant")
    section["weights"] = _check_name(section.get("weights", QUANT_AUTO), "quant.weights")
    kv = section.get("kv_cache", KV_CACHE_AUTO)
    if kv is None:  # YAML `kv_cache: null` / `~`
        kv = KV_CACHE_NONE
    _check_choice(kv, (KV_CACHE_AUTO, KV_CACHE_NONE, *KV_CACHE_DTYPES, *KV_CACHE_ALIASES), "quant.kv_cache")
    section["kv_cache"] = KV_CACHE_ALIASES.get(kv, kv)
    return section


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping (or a component name), got {_kind(value)}", path)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}", path)
    return dict(value)


def _check_name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"expected a component name, got {value!r}", path)
    return value.strip()


def _check_choice(value: Any, choices: tuple[str, ...], path: str) -> None:
    if value not in choices:
        raise ConfigError(f"expected one of {', '.join(choices)}; got {value!r}", path)


def _check_device(device: str) -> None:
    if device == DEVICE_AUTO:
        return
    import torch  # deferred: parsing a stack file should not pay for importing torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(
            f"not a torch device: {device!r} (expected auto, or e.g. cpu, cuda, cuda:1)", "device"
        ) from None


# ---------------------------------------------------------------------------------------------
# msgspec conversion with our error paths
# ---------------------------------------------------------------------------------------------

S = TypeVar("S", bound=msgspec.Struct)

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")


def convert(data: Mapping[str, Any], struct_type: type[S], path: str = "", owner: str | None = None) -> S:
    """`msgspec.convert(data, struct_type, strict=True)`, raising `ConfigError` whose path is
    `path` (the section the data came from) joined with the offending key. `owner` names who
    takes these options (``scheduler 'continuous'``) in unknown-key messages."""
    try:
        return msgspec.convert(data, struct_type, strict=True)
    except msgspec.ValidationError as exc:
        raise config_error(exc, struct_type, path, data, owner) from None


_MISSING = object()


def config_error(
    exc: msgspec.ValidationError,
    struct_type: type,
    path: str = "",
    data: Any = _MISSING,
    owner: str | None = None,
) -> ConfigError:
    """Rewrite msgspec's ``... - at `$.a[0].b``` into a ConfigError at ``path.a[0].b``; with
    the converted `data`, a bad value is quoted too (msgspec says only what was expected)."""
    m = _AT.match(str(exc))
    msg, rel = (m["msg"], m["path"] or "") if m else (str(exc), "")
    is_key = bool(m and m["key"])
    where = _join(path, rel)
    if unknown := _UNKNOWN_FIELD.match(msg):
        allowed = _field_names(struct_type, rel)
        if owner and not rel:
            hint = f"; {owner} accepts: {', '.join(allowed)}" if allowed else f"; {owner} takes no options"
        else:
            hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return ConfigError(f"unknown key{hint}", _join(where, unknown["field"]))
    if missing := _MISSING_FIELD.match(msg):
        return ConfigError("required key is missing", _join(where, missing["field"]))
    if is_key:
        return ConfigError(f"keys must be strings ({_humanize(msg)})", where or None)
    if msg.startswith("Invalid enum value"):
        choices = _choices(struct_type, rel)
        if choices:
            msg = f"{msg}; expected one of {', '.join(choices)}"
        return ConfigError(_humanize(msg), where or None)
    if ", got" not in msg and data is not _MISSING:
        value = _value_at(data, rel)
        if value is not _MISSING:
            msg = f"{msg}, got {value!r}"
    return ConfigError(_humanize(msg), where or None)


def _humanize(msg: str) -> str:
    msg = msg.replace("`object`", "a mapping").replace("`array`", "a list").replace("`", "")
    msg = re.sub(r"^Invalid enum value", "invalid value", msg)
    return msg[:1].lower() + msg[1:]


def _join(base: str, rel: str) -> str:
    rel = rel.lstrip(".") if not base else rel
    if not rel:
        return base
    if not base:
        return rel
    return f"{base}{rel}" if rel.startswith(("[", ".")) else f"{base}.{rel}"


def _value_at(data: Any, rel: str) -> Any:
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", rel):
        try:
            data = data[name] if name else data[int(index)]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING
    return data


def _field_names(struct_type: type, rel: str) -> list[str]:
    """Field names of the Struct reached by following `rel` (``.a[0].b``) from `struct_type`."""
    info = _unwrap(_type_at(struct_type, rel))
    if isinstance(info, msgspec.inspect.StructType):
        return [f.encode_name for f in info.fields]
    return []


def _choices(struct_type: type, rel: str) -> list[str]:
    """The allowed values of the Literal / Enum field at `rel`, if it is one."""
    info = _unwrap(_type_at(struct_type, rel))
    if isinstance(info, msgspec.inspect.LiteralType):
        return [repr(v) for v in info.values]
    if isinstance(info, msgspec.inspect.EnumType):
        return [repr(m.value) for m in info.cls]
    return []


def _type_at(struct_type: type, rel: str) -> Any:
    """msgspec type info of the value at `rel` inside `struct_type`; None when unknown."""
    try:
        info: Any = msgspec.inspect.type_info(struct_type)
    except TypeError:
        return None
    for name, _ in re.findall(r"\.([^.\[]+)|(\[[^\]]*\])", rel):
        info = _unwrap(info)
        if name:
            if not isinstance(info, msgspec.inspect.StructType):
                return None
            fields = {f.encode_name: f.type for f in info.fields}
            if name not in fields:
                return None
            info = fields[name]
        elif isinstance(info, msgspec.inspect.ListType | msgspec.inspect.VarTupleType):
            info = info.item_type
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return None
    return info


def _unwrap(info: Any) -> Any:
    """The Struct (or container) inside an Optional / Union, if there is exactly one; without
    the ``Annotated[..., msgspec.Meta(...)]`` wrapper an option's description puts around it."""
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        inner = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(inner) == 1:
            info = inner[0]
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    return info


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------


class _StackLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: YAML keeps the last one silently, which turns a
    pasted-in second `scheduler:` into a setting nobody sees."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key; the stack validation reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first given on line {first})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StackLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_message(exc: yaml.YAMLError, filename: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context and context not in problem else problem
    if mark is None:
        return f"{filename}: invalid YAML: {what}"
    return f"{filename}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {what}"


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"
