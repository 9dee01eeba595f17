"""The compatibility checks of a resolved stack: its components against each other (run by
`resolve`, before any weight is read) and against the model's metadata (`check_model`). Each
raises one `ResolutionError` on the first conflict, naming both sides and the way out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmstack.errors import ConfigError, ResolutionError
from lmstack.model.config import ModelConfig
from lmstack.quant.formats import DENSE, GGUF, checkpoint_format_id
from lmstack.registry import Component, Registry
from lmstack.stack.config import DTYPE_AUTO, KV_CACHE_AUTO, KV_CACHE_NONE
from lmstack.stack.resolved import (
    ABSENT,
    CAPABILITY_ROLE,
    DTYPE_NAMES,
    NO_SPECULATOR,
    ROLE_KEY,
    ROLE_LABEL,
    ROLES,
    ResolvedStack,
    Selected,
    alternatives,
    dist,
    effective,
    is_collection,
    listed,
    who,
)


def reads_formats(component: Component) -> tuple[str, ...]:
    """The checkpoint formats a quantizer declares it reads (undeclared: dense and GGUF)."""
    return tuple(component.capabilities.get("checkpoint_formats") or (DENSE, GGUF))


def check_checkpoint_format(r: ResolvedStack, model_config: ModelConfig) -> None:
    fmt = checkpoint_format_id(model_config.quantization)
    sel = r.quantizer
    if fmt in reads_formats(sel.component):
        return
    raise ResolutionError(
        f"{who('quantizer', sel)} reads {listed(reads_formats(sel.component))} checkpoints, but model "
        f"{r.model!r} is a {fmt} checkpoint; set quant.weights: auto or a quantizer that reads {fmt}"
    )


def check_components(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        if sel.component.check is None:
            continue
        problem = sel.component.check(sel.options, r, ROLE_KEY[role])
        if problem:
            raise ResolutionError(f"{who(role, sel)} {problem}")


def check_devices(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        devices = sel.capabilities.get("devices")
        if devices is not None and r.device.type not in devices:
            fits = alternatives(
                registry, role, lambda c: r.device.type in c.capabilities.get("devices", (r.device.type,))
            )
            raise ResolutionError(
                f"{who(role, sel)} runs on {listed(devices)} only, but the stack sets device: "
                f"{r.device}; change device, or pick another {ROLE_LABEL[role]} with "
                f"{ROLE_KEY[role]}{fits}"
            )


def check_phases(r: ResolvedStack, registry: Registry) -> None:
    for role, phase in (("attention_prefill", "prefill"), ("attention_decode", "decode")):
        sel = getattr(r, role)
        phases = sel.capabilities.get("phases")
        if phases is not None and phase not in phases:
            fits = alternatives(registry, role, lambda c, p=phase: p in c.capabilities.get("phases", (p,)))
            raise ResolutionError(
                f"attention kernel {sel.name!r} ({dist(sel)}) handles only {listed(phases)}, but the "
                f"stack uses it for {phase}; set attention.{phase} to another kernel{fits}"
            )


def active_speculator(selected: Mapping[str, Selected]) -> Selected | None:
    speculator = selected.get("speculator")
    return None if speculator is None or speculator.name == NO_SPECULATOR else speculator


def speculation_warning(r: ResolvedStack) -> str | None:
    """A line for `lmstack check` when a speculator runs in a 16-bit dtype: verification computes
    several rows per sequence at once, which 16-bit matmuls round differently from plain
    decoding's single row, so greedy output may differ from plain decoding's (`dtype: auto` picks
    float32 with a speculator on a CPU for this reason)."""
    speculator = active_speculator(r.selected)
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


def check_dtypes(r: ResolvedStack, registry: Registry) -> None:
    dtype = DTYPE_NAMES[r.dtype]
    for role in ("attention_prefill", "attention_decode", "quantizer"):
        sel = getattr(r, role)
        dtypes = sel.capabilities.get("dtypes")
        if dtypes is not None and dtype not in dtypes:
            fits = alternatives(registry, role, lambda c: dtype in c.capabilities.get("dtypes", (dtype,)))
            raise ResolutionError(
                f"{who(role, sel)} supports model dtypes {listed(dtypes)}, but the stack sets "
                f"dtype: {_dtype_setting(r)}; change dtype, or pick another {ROLE_LABEL[role]} with "
                f"{ROLE_KEY[role]}{fits}"
            )


def check_kv_cache_dtype(r: ResolvedStack, registry: Registry) -> None:
    kv = DTYPE_NAMES[r.kv_cache_dtype]
    setting = r.config.quant["kv_cache"]
    if setting not in (KV_CACHE_AUTO, KV_CACHE_NONE):
        source = f"quant.kv_cache: {setting}"
    elif setting == KV_CACHE_AUTO and r.quantizer.capabilities.get("kv_cache_dtype") is not None:
        source = f"{who('quantizer', r.quantizer)} stores the KV cache in {kv}"
    else:
        source = f"the KV cache is in the model dtype ({kv})"
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        allowed = sel.capabilities.get("kv_cache_dtypes")
        if allowed is not None and kv not in allowed:
            fits = alternatives(registry, role, lambda c: kv in c.capabilities.get("kv_cache_dtypes", (kv,)))
            raise ResolutionError(
                f"{who(role, sel)} reads KV caches in {listed(allowed)} only, but {source}; set "
                f"quant.kv_cache to one of {listed(allowed)}, or pick another {ROLE_LABEL[role]} "
                f"with {ROLE_KEY[role]}{fits}"
            )


def check_block_size(r: ResolvedStack, registry: Registry | None = None) -> None:
    block_size = r.block_size
    if block_size is None:
        return
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        sizes = sel.capabilities.get("block_sizes")
        if sizes is not None and block_size not in sizes:
            raise ResolutionError(
                f"{who(role, sel)} supports KV block sizes {listed(sizes)}, but {who('allocator', r.allocator)} "
                f"uses block_size {block_size}; set allocator.block_size to one of {listed(sizes)}, or "
                f"pick another {ROLE_LABEL[role]} with {ROLE_KEY[role]}"
            )


def check_chunked_context(r: ResolvedStack, registry: Registry) -> None:
    sel = r.attention_prefill
    if sel.capabilities.get("chunked_context", True):
        return
    fits = alternatives(registry, "attention_prefill", lambda c: c.capabilities.get("chunked_context", True))
    if r.chunked_prefill:
        raise ResolutionError(
            f"{who('scheduler', r.scheduler)} does chunked prefill, but {who('attention_prefill', sel)} "
            "cannot attend to earlier cached tokens (no chunked_context); set "
            f"scheduler.chunked_prefill: false, or pick another prefill kernel with attention.prefill{fits}"
        )
    # Verifying drafts runs multi-token queries over cached context, through the prefill kernel.
    if r.speculator.name != NO_SPECULATOR:
        raise ResolutionError(
            f"{who('speculator', r.speculator)} verifies drafts against cached tokens, but "
            f"{who('attention_prefill', sel)} cannot attend to earlier cached tokens (no "
            f"chunked_context); set speculator: none, or pick another prefill kernel with "
            f"attention.prefill{fits}"
        )


def check_requirements(r: ResolvedStack, registry: Registry) -> None:
    for role, sel in r.roles().items():
        for key, needed in sel.component.requires.items():
            target_role, capability = _parse_requirement(role, sel, key)
            for target in _target_roles(target_role, capability):
                if target == role:
                    continue
                actual = effective(r, target, capability)
                if satisfies(actual, needed):
                    continue
                tsel = getattr(r, target)
                fits = alternatives(
                    registry,
                    target,
                    lambda c, cap=capability, n=needed: satisfies(c.capabilities.get(cap, ABSENT), n),
                )
                raise ResolutionError(
                    f"{who(role, sel)} needs a {ROLE_LABEL[target]} with {capability}={needed!r}, but "
                    f"{who(target, tsel)} has {capability}={actual!r}; pick another {ROLE_LABEL[target]} "
                    f"with {ROLE_KEY[target]}{fits}, or another {ROLE_LABEL[role]}"
                )


def _parse_requirement(role: str, sel: Selected, key: str) -> tuple[str, str]:
    target, dot, capability = key.partition(".")
    if not dot:
        capability, target = key, CAPABILITY_ROLE.get(key, "")
    if target not in (*ROLES, "attention") or not capability:
        raise ResolutionError(
            f"{who(role, sel)} declares a requirement {key!r} that lmstack does not understand "
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


def satisfies(actual: Any, needed: Any) -> bool:
    if actual is ABSENT:  # an undeclared capability restricts nothing
        return True
    if isinstance(needed, bool):
        return bool(actual) == needed
    if is_collection(actual):
        return all(n in actual for n in needed) if is_collection(needed) else needed in actual
    return actual == needed


def check_model(resolved: ResolvedStack, model_config: ModelConfig, registry: Registry | None = None) -> None:
    """Check the stack against the model's metadata (call it before loading weights).
    `registry`: where to look for alternatives to name in a refusal (optional)."""
    r = resolved
    for role in ("attention_prefill", "attention_decode"):
        sel = getattr(r, role)
        head_dims = sel.capabilities.get("head_dims")
        if head_dims is not None and model_config.head_dim not in head_dims:
            raise ResolutionError(
                f"{who(role, sel)} supports head sizes {listed(head_dims)}, but model {r.model!r} has "
                f"head_dim {model_config.head_dim}; pick another {ROLE_LABEL[role]} with {ROLE_KEY[role]}"
            )
        windows = sorted({w for i in range(model_config.num_layers) if (w := model_config.layer_window(i))})
        if windows and sel.capabilities.get("sliding_window", True) is False:
            raise ResolutionError(
                f"{who(role, sel)} does not support sliding-window attention, but model {r.model!r} "
                f"uses a {'/'.join(map(str, windows))}-token window; pick another {ROLE_LABEL[role]} "
                f"with {ROLE_KEY[role]}"
            )
        # Only a backend that declares it is passed the keyword (model_runner): absent = no.
        cap = model_config.attn_logit_softcap
        if cap and not sel.capabilities.get("logit_softcap", False):
            fits = (  # without the registry: the core's own torch kernel always soft-caps
                alternatives(registry, role, lambda c: bool(c.capabilities.get("logit_softcap")))
                if registry
                else " (the built-in torch kernel does)"
            )
            raise ResolutionError(
                f"{who(role, sel)} does not support attention logit soft-capping, but model "
                f"{r.model!r} caps its attention scores at {cap:g} (attn_logit_softcap); pick another "
                f"{ROLE_LABEL[role]} with {ROLE_KEY[role]}{fits}"
            )
    check_block_size(r)
    tp = getattr(r.parallel.options, "tp", 1)
    if isinstance(tp, int) and tp > 1:  # heads and widths; the quantizer's alignment at build
        from lmstack.exec.parallel_layout import check_tensor_parallel

        check_tensor_parallel(tp, model_config)
    check_checkpoint_format(r, model_config)
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


def check_device_present(device: torch.device) -> None:
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
