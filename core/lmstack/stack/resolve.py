"""Turning a stack file into concrete components, and checking that they fit together.

Everything here runs before any weight is read: `resolve` looks up the components and checks
their capabilities against each other and the stack; `check_model` checks them against the
model's metadata. Each conflict is one `ResolutionError` naming both sides and the way out.

The capability vocabulary (the keys each kind may declare in `Component.capabilities`, with
their types) is in `lmstack.roles`; an absent key means no restriction.

`Component.requires` maps ``"<role>.<capability>"`` (roles: scheduler, allocator, attention,
attention_prefill, attention_decode, quantizer, speculator, parallel) to the value needed, e.g.
``{"attention.chunked_context": True}``; a bare capability name is looked up in the role that
declares it.

A component whose capabilities depend on its options declares `Component.capabilities_for`;
one with a condition the vocabulary cannot express declares `Component.check`, which runs
before the checks here so that its own explanation (and way out) is the one reported.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from lmstack.errors import ConfigError, ResolutionError
from lmstack.kernels.hardware import auto_dtype
from lmstack.model.config import ModelConfig
from lmstack.quant.formats import DENSE, GGUF, checkpoint_format_id
from lmstack.registry import Component, Registry
from lmstack.roles import ROLE_NAMES, check_capabilities
from lmstack.roles import ROLES as ROLE_TABLE
from lmstack.stack.config import (
    ATTENTION_AUTO,
    CORE_KEYS,
    DEFAULT_ATTENTION,
    DTYPE_AUTO,
    EXTRA,
    KV_CACHE_AUTO,
    KV_CACHE_NONE,
    QUANT_AUTO,
    StackConfig,
    convert,
    stack_from_mapping,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Views of the role table (`lmstack.roles`), under the names the checks below use.
ROLES = ROLE_NAMES
ROLE_KIND = {r.name: r.kind for r in ROLE_TABLE}
ROLE_KEY = {r.name: r.key for r in ROLE_TABLE}  # where each role is chosen (for "way out" hints)
ROLE_LABEL = {r.name: r.label for r in ROLE_TABLE}

NO_SPECULATOR = "none"
SINGLE_DEVICE_LAYOUT = "single"
LAYOUT_AXES = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}

# The role a bare requirement (no "role." prefix) refers to.
_CAPABILITY_ROLE = {
    "chunked_context": "attention",
    "sliding_window": "attention",
    "head_dims": "attention",
    "block_sizes": "attention",
    "kv_cache_dtypes": "attention",
    "phases": "attention",
    "chunked_prefill": "scheduler",
}
_ABSENT = object()


@dataclass(frozen=True)
class Selected:
    """A component chosen for one role, with its converted options."""

    component: Component
    options: msgspec.Struct

    @property
    def name(self) -> str:
        return self.component.name

    @property
    def capabilities(self) -> Mapping[str, Any]:
        """The component's capabilities under the selected options."""
        c = self.component
        return c.capabilities if c.capabilities_for is None else c.capabilities_for(self.options)

    def describe(self) -> dict[str, Any]:
        c = self.component
        return {
            "name": c.name,
            "kind": c.kind,
            "distribution": c.distribution,
            "version": c.version,
            "options": _jsonable(self.options),
            "capabilities": _jsonable(dict(self.capabilities)),
            "requires": _jsonable(dict(c.requires)),
        }


@dataclass(frozen=True)
class ResolvedStack:
    """A stack whose components are known, whose options are converted and whose components
    were checked against each other. Built by `resolve`; nothing mutates it later.

    Each role of the role table is an attribute (`r.scheduler`, `r.attention_prefill`, ...),
    looked up in `selected`; `sections` holds the plugin-declared sections (lmstack-api's
    ``server``), converted."""

    config: StackConfig
    model: str
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    selected: Mapping[str, Selected]
    sections: Mapping[str, msgspec.Struct]
    # How each section shows itself to readers (secrets left out); name -> public(value).
    section_views: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    # The model's checkpoint format (`lmstack.quant.formats` id) as read at resolution.
    checkpoint_format: str | None = None
    # Why `dtype` is what it is: "set in the stack", or what `dtype: auto` saw.
    dtype_reason: str = "set in the stack"
    # Roles the stack left to `auto` (attention), and why each got its component.
    auto_reasons: Mapping[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Selected:
        # Only reached when normal lookup fails: the role attributes.
        selected = self.__dict__.get("selected")
        if selected is not None and name in selected:
            return selected[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def roles(self) -> dict[str, Selected]:
        """Role -> selected component, in build order."""
        return {role: self.selected[role] for role in ROLES}

    @property
    def chunked_prefill(self) -> bool:
        """Whether the scheduler cuts prompts into chunks (its option, else its capability)."""
        return bool(_effective(self, "scheduler", "chunked_prefill", default=False))

    @property
    def block_size(self) -> int | None:
        return getattr(self.allocator.options, "block_size", None)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: every role's component, origin, options and capabilities, and
        each plugin section as its plugin chooses to show it."""
        sections = {}
        for name, value in self.sections.items():
            view = self.section_views.get(name)
            sections[name] = _jsonable(view(value) if view is not None else value)
        return {
            "model": self.model,
            "device": str(self.device),
            "dtype": DTYPE_NAMES[self.dtype],
            "dtype_reason": self.dtype_reason,
            "kv_cache_dtype": DTYPE_NAMES.get(self.kv_cache_dtype, str(self.kv_cache_dtype)),
            "checkpoint_format": self.checkpoint_format,
            "max_model_len": self.config.max_model_len,
            "seed": self.config.seed,
            "components": {role: sel.describe() for role, sel in self.roles().items()},
            "auto_reasons": dict(self.auto_reasons),
            **sections,
        }


# ---------------------------------------------------------------------------------------------
# resolve
# ---------------------------------------------------------------------------------------------


def resolve(stack: StackConfig, registry: Registry, *, check_device: bool = True) -> ResolvedStack:
    """Look up every component the stack names, convert its options, and check that the
    components fit together and run on the stack's device and dtype. Reads no weights.

    `check_device=False` skips only the "is this device present on this machine" check (to
    validate a GPU stack on a CPU-only machine)."""
    # Re-normalise: a StackConfig built in code (not by load_stack) may use the short forms.
    stack = stack_from_mapping(msgspec.to_builtins(stack))
    device = torch.device(stack.device)
    quant = dict(stack.quant)
    quant_name = quant.pop("weights")
    quant.pop("kv_cache")
    checkpoint_format = _checkpoint_format(stack.model)
    if quant_name == QUANT_AUTO:
        quant_name = auto_quantizer(registry, checkpoint_format)

    quantizer = _select(registry, "quantizer", quant_name, quant, "quant", name_key="quant.weights")
    selected = {"quantizer": quantizer, "parallel": _select_parallel(registry, stack.parallel)}
    # `attention: auto`: candidates best first, tried in turn below (the first one whose check
    # passes on this machine is kept).
    auto: dict[str, list[Selected]] = {}
    for role, phase in (("attention_prefill", "prefill"), ("attention_decode", "decode")):
        section, path = stack.attention[phase], f"attention.{phase}"
        if section["name"] == ATTENTION_AUTO:
            auto[role] = _auto_attention_candidates(registry, device, phase, section, path)
            selected[role] = auto[role][0]
        else:
            selected[role] = _select_section(registry, "attention", section, path)
    # Every other role is a plain {name: ..., **options} section.
    for role in ROLE_TABLE:
        if role.name not in selected:
            section = getattr(stack, role.section)
            selected[role.name] = _select_section(registry, role.kind, section, role.section)
    sections, views = _convert_sections(stack, registry)

    def assemble(reasons: Mapping[str, str]) -> ResolvedStack:
        if stack.dtype == DTYPE_AUTO:
            dtype, dtype_reason = _auto_dtype(device, selected)
        else:
            dtype, dtype_reason = DTYPES[stack.dtype], "set in the stack"
        return ResolvedStack(
            config=stack,
            model=stack.model,
            device=device,
            dtype=dtype,
            dtype_reason=dtype_reason,
            kv_cache_dtype=_kv_cache_dtype(stack, quantizer, dtype),
            selected=dict(selected),
            sections=sections,
            section_views=views,
            checkpoint_format=checkpoint_format,
            auto_reasons=dict(reasons),
        )

    reasons: dict[str, str] = {}
    for role, candidates in auto.items():
        skipped = []
        for i, sel in enumerate(candidates):
            selected[role] = sel
            problem = _auto_fit_problem(assemble(reasons), role, sel)
            if problem is None or i == len(candidates) - 1:
                break  # the last (the reference backend) is kept: the checks below explain
            skipped.append(f"{sel.name} {problem}")
        ranked = ", ".join(c.name for c in candidates)
        reasons[role] = f"auto on {device.type} (ranked: {ranked}): {selected[role].name}" + (
            f"; skipped {'; '.join(skipped)}" if skipped else ""
        )
    resolved = assemble(reasons)
    for check in (
        _check_components,
        _check_devices,
        _check_phases,
        _check_dtypes,
        _check_kv_cache_dtype,
        _check_block_size,
        _check_chunked_context,
        _check_requirements,
    ):
        check(resolved, registry)
    if check_device:
        _check_device_present(device)
    return resolved


def _convert_sections(
    stack: StackConfig, registry: Registry
) -> tuple[dict[str, msgspec.Struct], dict[str, Callable[[Any], Any]]]:
    """Plugin-declared sections, converted by their declared types (defaults when absent); a
    top-level key nobody declares is an error naming it and every accepted key."""
    raw = getattr(stack, EXTRA)
    for key in raw:
        if key not in registry.sections:
            accepted = [*CORE_KEYS, *sorted(registry.sections)]
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"unknown key; {hint}expected one of: {', '.join(accepted)} (a plugin may declare "
                "more sections: is it installed?)",
                key,
            )
    sections: dict[str, msgspec.Struct] = {}
    views: dict[str, Callable[[Any], Any]] = {}
    for name, spec in sorted(registry.sections.items()):
        value = raw.get(name, {})
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {type(value).__name__} {value!r}", name)
        owner = f"section {name!r} ({spec.distribution or 'unknown origin'})"
        sections[name] = convert(value, spec.type, name, owner=owner)
        if spec.public is not None:
            views[name] = spec.public
    return sections, views


def reads_formats(component: Component) -> tuple[str, ...]:
    """The checkpoint formats a quantizer declares it reads (undeclared: dense and GGUF)."""
    return tuple(component.capabilities.get("checkpoint_formats") or (DENSE, GGUF))


def _checkpoint_format(model: str) -> str:
    """The model's checkpoint format id from its metadata (no weights read); "dense" when the
    model cannot be opened here (then loading reports that)."""
    from lmstack.model.hf_loader import read_json
    from lmstack.model.source import resolve_model_path

    try:
        path = resolve_model_path(model)
        if path.is_file():
            return GGUF  # a .gguf file (its metadata need not be read to know that)
        return checkpoint_format_id(read_json(path / "config.json").get("quantization_config"))
    except Exception:
        return DENSE


def auto_quantizer(registry: Registry, checkpoint_format: str) -> str:
    """`quant.weights: auto`: the first installed quantizer (`none`, then by name) that reads
    `checkpoint_format`."""
    names = registry.names("quantizer")
    order = [n for n in ("none",) if n in names] + sorted(n for n in names if n != "none")
    for name in order:
        if checkpoint_format in reads_formats(registry.get("quantizer", name)):
            return name
    raise ResolutionError(
        f"quant.weights: auto: no installed quantizer reads {checkpoint_format} checkpoints "
        f"(installed: {', '.join(order) or 'none'}); install a quantizer plugin that declares it"
    )


def _check_checkpoint_format(r: ResolvedStack, model_config: ModelConfig) -> None:
    fmt = checkpoint_format_id(model_config.quantization)
    sel = r.quantizer
    if fmt in reads_formats(sel.component):
        return
    raise ResolutionError(
        f"{_who('quantizer', sel)} reads {_list(reads_formats(sel.component))} checkpoints, but model "
        f"{r.model!r} is a {fmt} checkpoint; set quant.weights: auto or a quantizer that reads {fmt}"
    )


def _auto_attention_candidates(
    registry: Registry, device: torch.device, phase: str, section: Mapping[str, Any], path: str
) -> list[Selected]:
    """`attention: auto` for one phase: the installed backends that declare an `auto_rank` for
    this device type and run this phase, highest rank first, then the reference backend."""
    if len(section) > 1:
        extra = ", ".join(sorted(k for k in section if k != "name"))
        raise ConfigError(f"auto takes no options (got {extra}); name a backend to set its options", path)
    ranked = []
    for name in registry.names("attention"):
        component = registry.get("attention", name)
        caps = component.capabilities
        rank = (caps.get("auto_rank") or {}).get(device.type)
        if rank is None or name == DEFAULT_ATTENTION:
            continue
        if device.type not in caps.get("devices", (device.type,)) or phase not in caps.get(
            "phases", (phase,)
        ):
            continue
        ranked.append((-rank, name))
    names = [name for _, name in sorted(ranked)] + [DEFAULT_ATTENTION]
    return [_select(registry, "attention", name, {}, path, name_key=f"{path}.name") for name in names]


def _auto_fit_problem(r: ResolvedStack, role: str, sel: Selected) -> str | None:
    """Why an `auto` attention candidate does not fit this stack (its own check, the dtype and
    KV-cache dtype), or None."""
    if sel.component.check is not None:
        problem = sel.component.check(sel.options, r, ROLE_KEY[role])
        if problem:
            return problem
    dtypes = sel.capabilities.get("dtypes")
    if dtypes is not None and DTYPE_NAMES[r.dtype] not in dtypes:
        return f"does not take {DTYPE_NAMES[r.dtype]}"
    kv = sel.capabilities.get("kv_cache_dtypes")
    if kv is not None and DTYPE_NAMES.get(r.kv_cache_dtype) not in kv:
        return f"cannot read a {DTYPE_NAMES.get(r.kv_cache_dtype)} KV cache"
    return None


def _select_section(registry: Registry, kind: str, section: Mapping[str, Any], path: str) -> Selected:
    options = {k: v for k, v in section.items() if k != "name"}
    return _select(registry, kind, section["name"], options, path, name_key=f"{path}.name")


def _select(
    registry: Registry, kind: str, name: str, options: Mapping[str, Any], path: str, *, name_key: str
) -> Selected:
    try:
        component = registry.get(kind, name)
    except ResolutionError as exc:
        raise ResolutionError(f"{name_key}: {exc}") from None
    owner = f"{kind} {name!r} ({component.distribution or 'unknown origin'})"
    selected = Selected(component, convert(options, component.options_type, path, owner=owner))
    if component.capabilities_for is not None:  # what these options give is checked once, here
        check_capabilities(kind, selected.capabilities, owner)
    return selected


def _select_parallel(registry: Registry, section: Mapping[str, Any]) -> Selected:
    name = section["name"]
    try:
        component = registry.get("parallel", name)
    except ResolutionError as exc:
        raise ResolutionError(f"parallel.name: {exc}") from None
    options = {k: v for k, v in section.items() if k != "name"}
    fields = set(getattr(component.options_type, "__struct_fields__", ()))
    for axis in LAYOUT_AXES:
        if axis not in options:
            continue
        value = options[axis]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"expected a positive integer, got {value!r}", f"parallel.{axis}")
        # tp/pp/ep of 1 mean "not sharded": every layout accepts them, even one without options.
        if axis not in fields:
            del options[axis]
            if value > 1:
                _raise_not_sharding(registry, component, axis, value)
    selected = _select(registry, "parallel", name, options, "parallel", name_key="parallel.name")
    if name == SINGLE_DEVICE_LAYOUT:
        for axis in LAYOUT_AXES:
            value = getattr(selected.options, axis, 1)
            if isinstance(value, int) and value > 1:
                _raise_not_sharding(registry, component, axis, value)
    return selected


def _raise_not_sharding(registry: Registry, component: Component, axis: str, value: int) -> None:
    others = [n for n in registry.names("parallel") if n != component.name]
    installed = f"installed layouts: {', '.join(others)}" if others else "none is installed"
    raise ResolutionError(
        f"parallel.{axis}: {axis}={value} asks for {LAYOUT_AXES[axis]} parallelism, but parallel "
        f"layout {component.name!r} ({component.distribution or 'unknown origin'}) runs the model "
        f"on one device; install a parallel plugin and select it with parallel.name ({installed}), "
        f"or set {axis}: 1"
    )


def _kv_cache_dtype(stack: StackConfig, quantizer: Selected, dtype: torch.dtype) -> torch.dtype:
    kv = stack.quant["kv_cache"]
    if kv == KV_CACHE_NONE:
        return dtype
    if kv != KV_CACHE_AUTO:
        return DTYPES[kv]
    name = quantizer.capabilities.get("kv_cache_dtype")
    if name is None:
        return dtype
    if name not in DTYPES:
        raise ResolutionError(
            f"quantizer {quantizer.name!r} ({quantizer.component.distribution}) declares KV-cache "
            f"dtype {name!r}, which lmstack does not know (known: {', '.join(DTYPES)}); set "
            "quant.kv_cache explicitly"
        )
    return DTYPES[name]


# ---------------------------------------------------------------------------------------------
# Capability checks (each raises on the first conflict it finds)
# ---------------------------------------------------------------------------------------------


def _check_components(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        if sel.component.check is None:
            continue
        problem = sel.component.check(sel.options, r, ROLE_KEY[role])
        if problem:
            raise ResolutionError(f"{_who(role, sel)} {problem}")


def _check_devices(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        devices = sel.capabilities.get("devices")
        if devices is not None and r.device.type not in devices:
            fits = _alternatives(
                registry, role, lambda c: r.device.type in c.capabilities.get("devices", (r.device.type,))
            )
            raise ResolutionError(
                f"{_who(role, sel)} runs on {_list(devices)} only, but the stack sets device: "
                f"{r.device}; change device, or pick another {ROLE_LABEL[role]} with "
                f"{ROLE_KEY[role]}{fits}"
            )


def _check_phases(r: ResolvedStack, registry: Registry) -> None:
    for role, phase in (("attention_prefill", "prefill"), ("attention_decode", "decode")):
        sel = getattr(r, role)
        phases = sel.capabilities.get("phases")
        if phases is not None and phase not in phases:
            fits = _alternatives(registry, role, lambda c, p=phase: p in c.capabilities.get("phases", (p,)))
            raise ResolutionError(
                f"attention kernel {sel.name!r} ({_dist(sel)}) handles only {_list(phases)}, but the "
                f"stack uses it for {phase}; set attention.{phase} to another kernel{fits}"
            )


def _auto_dtype(device: torch.device, selected: Mapping[str, Selected]) -> tuple[torch.dtype, str]:
    """`dtype: auto`: the device's best dtype, or the next best that every component whose
    `dtypes` capability is declared accepts (none does: the best, and `_check_dtypes` says why)."""
    choice = auto_dtype(device)
    limits = [
        (sel, sel.capabilities["dtypes"])
        for role, sel in selected.items()
        if role in ("attention_prefill", "attention_decode", "quantizer") and sel.capabilities.get("dtypes")
    ]
    # A quantizer may name the dtype its kernels compute best on a device kind (`auto_dtypes`,
    # e.g. int8's C++ CPU kernel takes fp32 activations): auto takes it there if all accept it.
    quantizer = selected.get("quantizer")
    preferred = (quantizer.capabilities.get("auto_dtypes") or {}).get(device.type) if quantizer else None
    if (
        preferred in DTYPES
        and DTYPES[preferred] != choice.dtype
        and all(preferred in dtypes for _, dtypes in limits)
    ):
        why = quantizer.capabilities.get("auto_dtypes_reason") or f"what {quantizer.name} computes best"
        return DTYPES[preferred], f"auto: {preferred} on {device.type} ({why})"
    speculator = _active_speculator(selected)
    if (
        speculator is not None
        and device.type == "cpu"
        and choice.dtype != torch.float32
        and all("float32" in dtypes for _, dtypes in limits)
    ):
        return torch.float32, (
            f"auto: float32 on cpu with the {speculator.name} speculator (not {DTYPE_NAMES[choice.dtype]}): "
            "drafts are verified several rows at a time, and 16-bit matmuls round a row differently "
            "by the batch's shape, so greedy output would drift from plain decoding's"
        )
    for dtype in (choice.dtype, *choice.fallbacks):
        if all(DTYPE_NAMES[dtype] in dtypes for _, dtypes in limits):
            if dtype == choice.dtype:
                return dtype, choice.reason
            refuse = sorted({sel.name for sel, dtypes in limits if DTYPE_NAMES[choice.dtype] not in dtypes})
            return dtype, (
                f"{choice.reason}; but {', '.join(refuse)} does not take {DTYPE_NAMES[choice.dtype]}, "
                f"so {DTYPE_NAMES[dtype]}"
            )
    return choice.dtype, choice.reason


def _active_speculator(selected: Mapping[str, Selected]) -> Selected | None:
    speculator = selected.get("speculator")
    return None if speculator is None or speculator.name == NO_SPECULATOR else speculator


def speculation_warning(r: ResolvedStack) -> str | None:
    """A line for `lmstack check` when a speculator runs in a 16-bit dtype: verification computes
    several rows per sequence at once, which 16-bit matmuls round differently from plain
    decoding's single row, so greedy output may differ from plain decoding's (`dtype: auto` picks
    float32 with a speculator on a CPU for this reason)."""
    speculator = _active_speculator(r.selected)
    if speculator is None or r.dtype == torch.float32:
        return None
    return (
        f"dtype {DTYPE_NAMES[r.dtype]} with the {speculator.name} speculator: verified drafts are "
        "rounded differently from plain decoding's single rows, so greedy output may differ from "
        "plain decoding's; float32 keeps them alike"
    )


def _dtype_setting(r: ResolvedStack) -> str:
    name = DTYPE_NAMES[r.dtype]
    return f"auto ({name} on this machine)" if r.config.dtype == DTYPE_AUTO else name


def _check_dtypes(r: ResolvedStack, registry: Registry) -> None:
    dtype = DTYPE_NAMES[r.dtype]
    for role in ("attention_prefill", "attention_decode", "quantizer"):
        sel = getattr(r, role)
        dtypes = sel.capabilities.get("dtypes")
        if dtypes is not None and dtype not in dtypes:
            fits = _alternatives(registry, role, lambda c: dtype in c.capabilities.get("dtypes", (dtype,)))
            raise ResolutionError(
                f"{_who(role, sel)} supports model dtypes {_list(dtypes)}, but the stack sets "
                f"dtype: {_dtype_setting(r)}; change dtype, or pick another {ROLE_LABEL[role]} with "
                f"{ROLE_KEY[role]}{fits}"
            )


def _check_kv_cache_dtype(r: ResolvedStack, registry: Registry) -> None:
    kv = DTYPE_NAMES[r.kv_cache_dtype]
    setting = r.config.quant["kv_cache"]
    if setting not in (KV_CACHE_AUTO, KV_CACHE_NONE):
        source = f"quant.kv_cache: {setting}"
    elif setting == KV_CACHE_AUTO and r.quantizer.capabilities.get("kv_cache_dtype") is not None:
        source = f"{_who('quantizer', r.quantizer)} stores the KV cache in {kv}"
    else:
        source = f"the KV cache is in the model dtype ({kv})"
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        allowed = sel.capabilities.get("kv_cache_dtypes")
        if allowed is not None and kv not in allowed:
            fits = _alternatives(registry, role, lambda c: kv in c.capabilities.get("kv_cache_dtypes", (kv,)))
            raise ResolutionError(
                f"{_who(role, sel)} reads KV caches in {_list(allowed)} only, but {source}; set "
                f"quant.kv_cache to one of {_list(allowed)}, or pick another {ROLE_LABEL[role]} "
                f"with {ROLE_KEY[role]}{fits}"
            )


def _check_block_size(r: ResolvedStack, registry: Registry | None = None) -> None:
    block_size = r.block_size
    if block_size is None:
        return
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        sizes = sel.capabilities.get("block_sizes")
        if sizes is not None and block_size not in sizes:
            raise ResolutionError(
                f"{_who(role, sel)} supports KV block sizes {_list(sizes)}, but {_who('allocator', r.allocator)} "
                f"uses block_size {block_size}; set allocator.block_size to one of {_list(sizes)}, or "
                f"pick another {ROLE_LABEL[role]} with {ROLE_KEY[role]}"
            )


def _check_chunked_context(r: ResolvedStack, registry: Registry) -> None:
    sel = r.attention_prefill
    if sel.capabilities.get("chunked_context", True):
        return
    fits = _alternatives(registry, "attention_prefill", lambda c: c.capabilities.get("chunked_context", True))
    if r.chunked_prefill:
        raise ResolutionError(
            f"{_who('scheduler', r.scheduler)} does chunked prefill, but {_who('attention_prefill', sel)} "
            "cannot attend to earlier cached tokens (no chunked_context); set "
            f"scheduler.chunked_prefill: false, or pick another prefill kernel with attention.prefill{fits}"
        )
    # Verifying drafts runs multi-token queries over cached context, through the prefill kernel.
    if r.speculator.name != NO_SPECULATOR:
        raise ResolutionError(
            f"{_who('speculator', r.speculator)} verifies drafts against cached tokens, but "
            f"{_who('attention_prefill', sel)} cannot attend to earlier cached tokens (no "
            f"chunked_context); set speculator: none, or pick another prefill kernel with "
            f"attention.prefill{fits}"
        )


def _check_requirements(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        for key, needed in sel.component.requires.items():
            target_role, capability = _parse_requirement(role, sel, key)
            for target in _target_roles(target_role, capability):
                if target == role:
                    continue
                actual = _effective(r, target, capability)
                if _satisfies(actual, needed):
                    continue
                tsel = getattr(r, target)
                fits = _alternatives(
                    registry,
                    target,
                    lambda c, cap=capability, n=needed: _satisfies(c.capabilities.get(cap, _ABSENT), n),
                )
                raise ResolutionError(
                    f"{_who(role, sel)} needs a {ROLE_LABEL[target]} with {capability}={needed!r}, but "
                    f"{_who(target, tsel)} has {capability}={actual!r}; pick another {ROLE_LABEL[target]} "
                    f"with {ROLE_KEY[target]}{fits}, or another {ROLE_LABEL[role]}"
                )


def _parse_requirement(role: str, sel: Selected, key: str) -> tuple[str, str]:
    target, dot, capability = key.partition(".")
    if not dot:
        capability, target = key, _CAPABILITY_ROLE.get(key, "")
    if target not in (*ROLES, "attention") or not capability:
        raise ResolutionError(
            f"{_who(role, sel)} declares a requirement {key!r} that lmstack does not understand "
            "(expected '<role>.<capability>'); the plugin may need a newer lmstack"
        )
    return target, capability


def _target_roles(target: str, capability: str) -> tuple[str, ...]:
    if target != "attention":
        return (target,)
    # Only the prefill kernel sees multi-token queries over cached context.
    if capability == "chunked_context":
        return ("attention_prefill",)
    return ("attention_prefill", "attention_decode")


def _effective(r: ResolvedStack, role: str, capability: str, default: Any = _ABSENT) -> Any:
    """A capability that is also an option (`chunked_prefill`) counts as set by the option."""
    sel: Selected = getattr(r, role)
    if capability in getattr(sel.component.options_type, "__struct_fields__", ()):
        return getattr(sel.options, capability)
    return sel.capabilities.get(capability, default)


def _satisfies(actual: Any, needed: Any) -> bool:
    if actual is _ABSENT:  # an undeclared capability restricts nothing
        return True
    if isinstance(needed, bool):
        return bool(actual) == needed
    if _is_collection(actual):
        return all(n in actual for n in needed) if _is_collection(needed) else needed in actual
    return actual == needed


# ---------------------------------------------------------------------------------------------
# check_model
# ---------------------------------------------------------------------------------------------


def check_model(resolved: ResolvedStack, model_config: ModelConfig) -> None:
    """Check the stack against the model's metadata (call it before loading weights)."""
    r = resolved
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        head_dims = sel.capabilities.get("head_dims")
        if head_dims is not None and model_config.head_dim not in head_dims:
            raise ResolutionError(
                f"{_who(role, sel)} supports head sizes {_list(head_dims)}, but model {r.model!r} has "
                f"head_dim {model_config.head_dim}; pick another {ROLE_LABEL[role]} with {ROLE_KEY[role]}"
            )
        if model_config.sliding_window and sel.capabilities.get("sliding_window", True) is False:
            raise ResolutionError(
                f"{_who(role, sel)} does not support sliding-window attention, but model {r.model!r} "
                f"uses a {model_config.sliding_window}-token window; pick another {ROLE_LABEL[role]} "
                f"with {ROLE_KEY[role]}"
            )
    _check_block_size(r)
    tp = getattr(r.parallel.options, "tp", 1)
    if isinstance(tp, int) and tp > 1:  # heads and widths; the quantizer's alignment at build
        from lmstack.exec.parallel_layout import check_tensor_parallel

        check_tensor_parallel(tp, model_config)
    _check_checkpoint_format(r, model_config)
    limit = model_config.max_position_embeddings
    if (
        r.config.max_model_len is not None
        and r.config.max_model_len > limit
        and not model_config.rope_scaling
    ):
        raise ConfigError(
            f"{r.config.max_model_len} exceeds the context length model {r.model!r} was trained for "
            f"({limit}); lower it or leave it unset",
            "max_model_len",
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _dist(sel: Selected) -> str:
    c = sel.component
    return f"{c.distribution} {c.version}".strip() or "unknown origin"


def _who(role: str, sel: Selected) -> str:
    return f"{ROLE_LABEL[role]} {sel.name!r} ({_dist(sel)})"


def _alternatives(registry: Registry, role: str, fits: Callable[[Component], bool]) -> str:
    """`` (installed ones that fit: a, b)`` or `` (no installed one fits)``."""
    kind = ROLE_KIND[role]
    names = [n for n in registry.names(kind) if fits(registry.get(kind, n))]
    return f" (installed ones that fit: {', '.join(names)})" if names else " (no installed one fits)"


def _check_device_present(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ResolutionError(
                f"device: {device} is not available here (torch {torch.__version__} sees no CUDA "
                "device); use device: cpu, or install a CUDA build of torch on a GPU machine"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ResolutionError(
                f"device: {device} does not exist; this machine has {torch.cuda.device_count()} CUDA "
                f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ResolutionError(f"device: {device} is not available here; use device: cpu")


def _is_collection(value: Any) -> bool:
    return isinstance(value, Collection) and not isinstance(value, str | bytes | Mapping)


def _list(values: Any) -> str:
    if _is_collection(values):
        return ", ".join(str(v) for v in values) or "nothing"
    return str(values)


def _jsonable(value: Any) -> Any:
    # Capabilities are plugin-defined: anything msgspec cannot encode is shown by its repr.
    return msgspec.to_builtins(value, str_keys=True, enc_hook=repr)
