"""A resolved stack: the components chosen for each role with their converted options, and the
small vocabulary the resolution and its checks share (dtype names, role views, how a component
is named in a message)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from lmstack.registry import Component, Registry
from lmstack.roles import ROLE_NAMES
from lmstack.roles import ROLES as ROLE_TABLE
from lmstack.stack.config import StackConfig

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
CAPABILITY_ROLE = {
    "chunked_context": "attention",
    "sliding_window": "attention",
    "logit_softcap": "attention",
    "head_dims": "attention",
    "block_sizes": "attention",
    "kv_cache_dtypes": "attention",
    "phases": "attention",
    "chunked_prefill": "scheduler",
}
ABSENT = object()


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
            "options": jsonable(self.options),
            "capabilities": jsonable(dict(self.capabilities)),
            "requires": jsonable(dict(c.requires)),
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
        return bool(effective(self, "scheduler", "chunked_prefill", default=False))

    @property
    def block_size(self) -> int | None:
        return getattr(self.allocator.options, "block_size", None)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: every role's component, origin, options and capabilities, and
        each plugin section as its plugin chooses to show it."""
        sections = {}
        for name, value in self.sections.items():
            view = self.section_views.get(name)
            sections[name] = jsonable(view(value) if view is not None else value)
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


def effective(r: ResolvedStack, role: str, capability: str, default: Any = ABSENT) -> Any:
    """A capability that is also an option (`chunked_prefill`) counts as set by the option."""
    sel: Selected = getattr(r, role)
    if capability in getattr(sel.component.options_type, "__struct_fields__", ()):
        return getattr(sel.options, capability)
    return sel.capabilities.get(capability, default)


def dist(sel: Selected) -> str:
    c = sel.component
    return f"{c.distribution} {c.version}".strip() or "unknown origin"


def who(role: str, sel: Selected) -> str:
    return f"{ROLE_LABEL[role]} {sel.name!r} ({dist(sel)})"


def alternatives(registry: Registry, role: str, fits: Callable[[Component], bool]) -> str:
    """`` (installed ones that fit: a, b)`` or `` (no installed one fits)``."""
    kind = ROLE_KIND[role]
    names = [n for n in registry.names(kind) if fits(registry.get(kind, n))]
    return f" (installed ones that fit: {', '.join(names)})" if names else " (no installed one fits)"


def is_collection(value: Any) -> bool:
    return isinstance(value, Collection) and not isinstance(value, str | bytes | Mapping)


def listed(values: Any) -> str:
    if is_collection(values):
        return ", ".join(str(v) for v in values) or "nothing"
    return str(values)


def jsonable(value: Any) -> Any:
    # Capabilities are plugin-defined: anything msgspec cannot encode is shown by its repr.
    return msgspec.to_builtins(value, str_keys=True, enc_hook=repr)
