"""The one table of component kinds and the roles they fill in a stack.

A *kind* is what a plugin registers (through one hook) and what interface it implements. A
*role* is a place in a stack a component of some kind fills: most kinds fill one role, attention
fills two (a prefill and a decode kernel). Everything that used to be spread over parallel
tables — registration hooks, stack keys, labels in messages, defaults, build order, the
capability vocabulary — is read from here, so adding a kind means adding a row to `KINDS` and
`ROLES` (and its interface in `lmstack.interfaces`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

# ---------------------------------------------------------------------------------------------
# Capabilities: the keys a component of each kind may declare, with their types. An absent key
# restricts nothing. Keys starting with "x-" are the plugin's own (shown, never checked).
# ---------------------------------------------------------------------------------------------

DeviceTypes = tuple[str, ...]
DtypeNames = tuple[str, ...]


class Capabilities(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every kind: the device types it runs on (e.g. ``("cpu", "cuda")``)."""

    devices: DeviceTypes | None = None


class SchedulerCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    # Cuts prompts into chunks; an option of the same name says whether it is on.
    chunked_prefill: bool | None = None
    preemption: str | None = None  # how a preempted sequence resumes, e.g. "recompute"


class AllocatorCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    fork: bool | None = None  # copy-on-write sharing for n > 1
    truncate: bool | None = None  # rolls back rejected draft slots
    content_hash: bool | None = None  # hashes full blocks (prefix reuse can attach)


class AttentionCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    dtypes: DtypeNames | None = None  # model dtypes of q/k/v
    kv_cache_dtypes: DtypeNames | None = None
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    phases: tuple[str, ...] | None = None  # subset of ("prefill", "decode")
    # Takes a `sliding_window` per call, so each layer may have its own (or none): Mistral's
    # one window, Gemma's alternating local / global layers.
    sliding_window: bool | None = None
    # Takes the keyword `logit_softcap` (tanh soft-capping of the scores, Gemma 2). Absent
    # means no: backends written before the keyword existed are never passed it.
    logit_softcap: bool | None = None
    # Prefill queries attend to earlier cached tokens: needed by chunked prefill and by
    # speculative verification (multi-token queries over a cached context).
    chunked_context: bool | None = None
    # `attention: auto` considers the backend on these device types, highest rank first (the
    # reference `torch` backend is always the last resort); absent: only chosen by name.
    auto_rank: dict[str, int] | None = None


class QuantizerCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    dtypes: DtypeNames | None = None  # model (activation) dtypes
    kv_cache_dtype: str | None = None  # the KV-cache dtype under quant.kv_cache: auto
    # Checkpoint formats it reads (`lmstack.quant.formats` ids: "dense", "gguf",
    # "compressed-tensors/pack-quantized", ...); None: not declared (treated as dense + gguf).
    checkpoint_formats: tuple[str, ...] | None = None
    # Device type -> the dtype `dtype: auto` takes there (what its kernels compute best, e.g.
    # {"cpu": "float32"}), with the reason `lmstack check` gives.
    auto_dtypes: dict[str, str] | None = None
    auto_dtypes_reason: str | None = None
    # Checkpoint format -> device type -> rank: `quant.weights: auto` considers it for those
    # checkpoints on those devices, highest rank first (e.g. {"gguf": {"cpu": 20}}). Only
    # formats it serves as stored: quantizing at load changes the model's outputs, which auto
    # never does. Absent: only chosen by name, or as a checkpoint's sole reader.
    auto_rank: dict[str, dict[str, int]] | None = None


class SpeculatorCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    pass


class ParallelCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    world_size: int | None = None


class CacheCapabilities(Capabilities, forbid_unknown_fields=True, frozen=True):
    # Where blocks live, fastest first, e.g. ("device", "disk").
    tiers: tuple[str, ...] | None = None
    persistent: bool | None = None  # blocks outlive the process (a restart finds them)
    # `cache: auto` (the default) takes the installed cache ranked highest for the device type
    # that fits the stack, else `none`; absent: only chosen by name.
    auto_rank: dict[str, int] | None = None


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KindSpec:
    name: str
    hook: str  # the registration hook in lmstack.hookspecs
    interface: str  # the base class in lmstack.interfaces its factory returns
    capabilities: type[Capabilities]


@dataclass(frozen=True)
class RoleSpec:
    name: str  # attribute of ResolvedStack and key of resolve()'s role mapping
    kind: str
    key: str  # where the stack file names the component, e.g. "attention.prefill"
    label: str  # how messages name the role: "prefill kernel"
    default: str  # the component used when the stack names none

    @property
    def section(self) -> str:
        return self.key.partition(".")[0]


KINDS: tuple[KindSpec, ...] = (
    KindSpec("scheduler", "lmstack_register_schedulers", "Scheduler", SchedulerCapabilities),
    KindSpec("allocator", "lmstack_register_allocators", "KVAllocator", AllocatorCapabilities),
    KindSpec("attention", "lmstack_register_attention", "AttentionBackend", AttentionCapabilities),
    KindSpec("quantizer", "lmstack_register_quantizers", "Quantizer", QuantizerCapabilities),
    KindSpec("speculator", "lmstack_register_speculators", "Speculator", SpeculatorCapabilities),
    KindSpec("parallel", "lmstack_register_parallel", "ParallelLayout", ParallelCapabilities),
    KindSpec("cache", "lmstack_register_caches", "BlockCache", CacheCapabilities),
)

# In build order: each factory may use what the ones before it put into the BuildContext
# (attention needs the quantizer's KV dtype, the allocator the executor's KV geometry and the
# cache, the scheduler the allocator, the speculator the scheduler's limits).
ROLES: tuple[RoleSpec, ...] = (
    RoleSpec("quantizer", "quantizer", "quant.weights", "quantizer", "none"),
    RoleSpec("attention_prefill", "attention", "attention.prefill", "prefill kernel", "torch"),
    RoleSpec("attention_decode", "attention", "attention.decode", "decode kernel", "torch"),
    RoleSpec("parallel", "parallel", "parallel.name", "parallel layout", "single"),
    RoleSpec("cache", "cache", "cache.name", "KV cache", "none"),
    RoleSpec("allocator", "allocator", "allocator.name", "allocator", "paged"),
    RoleSpec("scheduler", "scheduler", "scheduler.name", "scheduler", "continuous"),
    RoleSpec("speculator", "speculator", "speculator.name", "speculator", "none"),
)

KIND_NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
KIND: dict[str, KindSpec] = {k.name: k for k in KINDS}
ROLE: dict[str, RoleSpec] = {r.name: r for r in ROLES}
ROLE_NAMES: tuple[str, ...] = tuple(r.name for r in ROLES)

# Sections of the stack file of the form {name: ..., **options}: one per single-role kind.
NAMED_SECTIONS: dict[str, str] = {r.section: r.default for r in ROLES if r.key == f"{r.section}.name"}


# ---------------------------------------------------------------------------------------------
# Checking declared capabilities
# ---------------------------------------------------------------------------------------------

PRIVATE_PREFIX = "x-"


def capability_names(kind: str) -> tuple[str, ...]:
    return tuple(KIND[kind].capabilities.__struct_fields__)


def check_capabilities(kind: str, capabilities: Mapping[str, Any], who: str) -> None:
    """Raise ValueError naming the key when `capabilities` uses a key the kind does not define
    (with the closest known key) or a value of the wrong type. `who` names the component."""
    spec = KIND[kind]
    known = capability_names(kind)
    shared = {}
    for key, value in capabilities.items():
        if not isinstance(key, str):
            raise ValueError(f"{who}: capability keys must be strings, got {key!r}")
        if key.startswith(PRIVATE_PREFIX):
            continue
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{who}: unknown {kind} capability {key!r}; {hint}{kind} capabilities are: "
                f"{', '.join(known)} (prefix a plugin's own keys with {PRIVATE_PREFIX!r})"
            )
        shared[key] = value
    try:
        msgspec.convert(shared, spec.capabilities, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{who}: invalid capability: {_capability_message(exc)}") from None


def _capability_message(exc: msgspec.ValidationError) -> str:
    text = str(exc).replace("`", "")
    msg, _, where = text.partition(" - at $.")
    return f"{where}: {msg[:1].lower()}{msg[1:]}" if where else text
