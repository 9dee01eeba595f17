"""Turning a stack file into concrete components (the checks they then pass: `checks`).

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
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import msgspec
import torch

from lmstack.components.paged import BLOCK_SIZE_AUTO, KV_MEMORY_AUTO, auto_block_size
from lmstack.errors import ConfigError, ResolutionError
from lmstack.kernels.hardware import auto_dtype, kv_budget_reason
from lmstack.quant.formats import DENSE, GGUF, checkpoint_format_id
from lmstack.registry import Component, Registry
from lmstack.roles import ROLE, check_capabilities
from lmstack.roles import ROLES as ROLE_TABLE
from lmstack.stack.checks import (
    _parse_requirement,
    _target_roles,
    active_speculator,
    check_block_size,
    check_chunked_context,
    check_components,
    check_device_present,
    check_devices,
    check_dtypes,
    check_kv_cache_dtype,
    check_model,
    check_phases,
    check_requirements,
    reads_formats,
    satisfies,
    speculation_warning,
)
from lmstack.stack.config import (
    ATTENTION_AUTO,
    CACHE_AUTO,
    CORE_KEYS,
    DEFAULT_ATTENTION,
    DEVICE_AUTO,
    DTYPE_AUTO,
    EXTRA,
    KV_CACHE_AUTO,
    KV_CACHE_NONE,
    QUANT_AUTO,
    StackConfig,
    convert,
    stack_from_mapping,
)
from lmstack.stack.resolved import (
    DTYPE_NAMES,
    DTYPES,
    LAYOUT_AXES,
    ROLE_KEY,
    SINGLE_DEVICE_LAYOUT,
    ResolvedStack,
    Selected,
    effective,
)

# `cache: auto`'s last resort: no reuse.
NO_CACHE = ROLE["cache"].default
# `quant.weights: auto`'s last resort where it reads the checkpoint: as published.
NO_QUANTIZER = ROLE["quantizer"].default

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "ResolvedStack",
    "Selected",
    "auto_device",
    "auto_quantizer",
    "check_model",
    "reads_formats",
    "resolve",
    "speculation_warning",
]


def resolve(stack: StackConfig, registry: Registry, *, check_device: bool = True) -> ResolvedStack:
    """Look up every component the stack names, convert its options, and check that the
    components fit together and run on the stack's device and dtype. Reads no weights.

    `check_device=False` skips only the "is this device present on this machine" check (to
    validate a GPU stack on a CPU-only machine)."""
    # Re-normalise: a StackConfig built in code (not by load_stack) may use the short forms.
    stack = stack_from_mapping(msgspec.to_builtins(stack))
    reasons: dict[str, str] = {}
    if stack.device == DEVICE_AUTO:
        device, reasons["device"] = auto_device()
    else:
        device = torch.device(stack.device)
    quant = dict(stack.quant)
    quant_name = quant.pop("weights")
    quant.pop("kv_cache")
    checkpoint_format = _checkpoint_format(stack.model)
    # Every `auto` role: its candidates best first, tried in turn below (the first that fits
    # this stack on this machine is kept). The quantizer goes first: the dtype follows it.
    auto: dict[str, list[Selected]] = {}
    skipped: dict[str, list[str]] = {}  # candidates left out before the fit checks, and why
    selected: dict[str, Selected] = {}
    if quant_name == QUANT_AUTO:
        auto["quantizer"], skipped["quantizer"] = _auto_quantizer_candidates(
            registry, checkpoint_format, device, quant
        )
        selected["quantizer"] = auto["quantizer"][0]
    else:
        selected["quantizer"] = _select(
            registry, "quantizer", quant_name, quant, "quant", name_key="quant.weights"
        )
    selected["parallel"] = _select_parallel(registry, stack.parallel)
    for role, phase in (("attention_prefill", "prefill"), ("attention_decode", "decode")):
        section, path = stack.attention[phase], f"attention.{phase}"
        if section["name"] == ATTENTION_AUTO:
            auto[role] = _auto_attention_candidates(registry, device, phase, section, path)
            selected[role] = auto[role][0]
        else:
            selected[role] = _select_section(registry, "attention", section, path)
    if stack.cache["name"] == CACHE_AUTO:
        auto["cache"] = _auto_cache_candidates(registry, device, stack.cache)
        selected["cache"] = auto["cache"][0]
    # Every other role is a plain {name: ..., **options} section.
    for role in ROLE_TABLE:
        if role.name not in selected:
            section = getattr(stack, role.section)
            selected[role.name] = _select_section(registry, role.kind, section, role.section)
    # `block_size: auto` a number before any candidate is weighed (the allocator is never auto).
    alloc = selected["allocator"]
    if getattr(alloc.options, "block_size", None) == BLOCK_SIZE_AUTO:
        size, reasons["block_size"] = auto_block_size(device)
        selected["allocator"] = replace(
            alloc, options=msgspec.structs.replace(alloc.options, block_size=size)
        )
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
            kv_cache_dtype=_kv_cache_dtype(stack, selected["quantizer"], dtype),
            selected=dict(selected),
            sections=sections,
            section_views=views,
            checkpoint_format=checkpoint_format,
            auto_reasons=dict(reasons),
        )

    for role, candidates in auto.items():
        left_out = skipped.get(role, [])
        for i, sel in enumerate(candidates):
            selected[role] = sel
            problem = _auto_fit_problem(assemble(reasons), role, sel)
            if problem is None or i == len(candidates) - 1:
                break  # the last (the reference component) is kept: the checks below explain
            left_out.append(f"{sel.name} {problem}")
        ranked = ", ".join(c.name for c in candidates)
        where = f"for a {checkpoint_format} checkpoint on" if role == "quantizer" else "on"
        reasons[role] = f"auto {where} {device.type} (ranked: {ranked}): {selected[role].name}" + (
            f"; skipped {'; '.join(left_out)}" if left_out else ""
        )
    if getattr(selected["allocator"].options, "kv_cache_memory", None) == KV_MEMORY_AUTO:
        # Measured again when the allocator is built, after the weights are loaded.
        reasons["kv_cache_memory"] = kv_budget_reason(device)
    resolved = assemble(reasons)
    for check in (
        check_components,
        check_devices,
        check_phases,
        check_dtypes,
        check_kv_cache_dtype,
        check_block_size,
        check_chunked_context,
        check_requirements,
    ):
        check(resolved, registry)
    if check_device:
        check_device_present(device)
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


def auto_device() -> tuple[torch.device, str]:
    """`device: auto`: the first CUDA device where torch sees one, else the CPU; and why."""
    if torch.cuda.is_available():
        return torch.device("cuda"), f"auto: cuda (torch sees {torch.cuda.device_count()} CUDA device(s))"
    return torch.device("cpu"), "auto: cpu (torch sees no CUDA device)"


def auto_quantizer_ranking(registry: Registry, checkpoint_format: str, device: torch.device) -> list[str]:
    """`quant.weights: auto`'s candidates, best first: the installed quantizers that declare an
    `auto_rank` for `checkpoint_format` on this device type (they serve it as stored, faster
    than dequantizing it: lmstack-gguf's blocks on a CPU), highest first; then `none` (the
    checkpoint as published, dequantized) where it reads the format, else every other reader
    that runs here, by name. A quantizer that would quantize the checkpoint at load (int8 on a
    dense one) declares no rank for it, so it never comes before `none`: auto does not change
    the model's outputs."""
    readers = {}
    for name in registry.names("quantizer"):
        component = registry.get("quantizer", name)
        if checkpoint_format in reads_formats(component) and device.type in component.capabilities.get(
            "devices", (device.type,)
        ):
            readers[name] = component.capabilities
    ranked = []
    for name, caps in readers.items():
        rank = ((caps.get("auto_rank") or {}).get(checkpoint_format) or {}).get(device.type)
        if rank is not None and name != NO_QUANTIZER:
            ranked.append((-rank, name))
    order = [name for _, name in sorted(ranked)]
    rest = [NO_QUANTIZER] if NO_QUANTIZER in readers else sorted(readers)
    order += [name for name in rest if name not in order]
    if not order:
        raise ResolutionError(
            f"quant.weights: auto: no installed quantizer reads {checkpoint_format} checkpoints on "
            f"{device.type} (installed: {', '.join(registry.names('quantizer')) or 'none'}); install a "
            "quantizer plugin that declares it"
        )
    return order


def auto_quantizer(registry: Registry, checkpoint_format: str, device: torch.device | None = None) -> str:
    """The quantizer `quant.weights: auto` ranks first for `checkpoint_format` on `device` (the
    CPU when not given); `resolve` falls back down the ranking when it does not fit the stack."""
    return auto_quantizer_ranking(registry, checkpoint_format, device or torch.device("cpu"))[0]


def _auto_quantizer_candidates(
    registry: Registry, checkpoint_format: str, device: torch.device, options: Mapping[str, Any]
) -> tuple[list[Selected], list[str]]:
    """The ranking's quantizers with the options the quant section gives (`quant: {activations:
    fp32}` beside `weights: auto`), leaving out, with the reason, those that do not take them;
    all refusing: the first one's error."""
    candidates, left_out, errors = [], [], []
    for name in auto_quantizer_ranking(registry, checkpoint_format, device):
        try:
            candidates.append(
                _select(registry, "quantizer", name, options, "quant", name_key="quant.weights")
            )
        except ConfigError as exc:
            errors.append(exc)
            left_out.append(f"{name} does not take {', '.join(sorted(options))}")
    if not candidates:
        raise errors[0]
    return candidates, left_out


def _auto_cache_candidates(
    registry: Registry, device: torch.device, section: Mapping[str, Any]
) -> list[Selected]:
    """`cache: auto`: the installed caches that declare an `auto_rank` for this device type,
    highest first, then `none` (no reuse)."""
    if len(section) > 1:
        extra = ", ".join(sorted(k for k in section if k != "name"))
        raise ConfigError(f"auto takes no options (got {extra}); name a cache to set its options", "cache")
    ranked = []
    for name in registry.names("cache"):
        caps = registry.get("cache", name).capabilities
        rank = (caps.get("auto_rank") or {}).get(device.type)
        if rank is not None and name != NO_CACHE and device.type in caps.get("devices", (device.type,)):
            ranked.append((-rank, name))
    names = [name for _, name in sorted(ranked)] + [NO_CACHE]
    return [_select(registry, "cache", name, {}, "cache", name_key="cache.name") for name in names]


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
    """Why an `auto` candidate does not fit this stack (its own check, its device types, the
    dtype, the KV-cache dtype, what it requires of the other roles), or None."""
    if sel.component.check is not None:
        problem = sel.component.check(sel.options, r, ROLE_KEY[role])
        if problem:
            return problem
    devices = sel.capabilities.get("devices")
    if devices is not None and r.device.type not in devices:
        return f"does not run on {r.device.type}"
    for key, needed in sel.component.requires.items():
        target_role, capability = _parse_requirement(role, sel, key)
        for target in _target_roles(target_role, capability):
            actual = effective(r, target, capability)
            if target != role and not satisfies(actual, needed):
                return f"needs {ROLE_KEY[target]} with {capability}={needed!r} ({getattr(r, target).name} has {actual!r})"
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


def _auto_dtype(device: torch.device, selected: Mapping[str, Selected]) -> tuple[torch.dtype, str]:
    """`dtype: auto`: the device's best dtype, or the next best that every component whose
    `dtypes` capability is declared accepts (none does: the best, and `check_dtypes` says why)."""
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
    speculator = active_speculator(selected)
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
