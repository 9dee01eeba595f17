"""One pass through a stack, before anything is built: plugins loaded, the stack resolved, the
model opened (metadata and tokenizer, no weights) and checked against the stack.

`lmstack serve` and `lmstack check` prepare a stack once and hand the result on: the engine, its
executor and the server's state take the same plugin manager, resolved stack and open model
source, so a process opens its model file once (a multi-process layout's workers open their
own). An embedder that passes a path or a mapping to `LLMEngine` gets the same pass inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from typing import Any

import pluggy

from lmstack.model.architecture import ModelRegistry, build_model_registry
from lmstack.model.config import ModelConfig
from lmstack.model.source import ModelSource, open_model_source
from lmstack.stack.checks import check_model
from lmstack.stack.config import StackConfig, load_stack
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve
from lmstack.stack.resolved import ResolvedStack


@dataclass(frozen=True)
class PreparedStack:
    """A resolved stack with its plugins and its open, checked model: what building needs."""

    plugin_manager: pluggy.PluginManager
    resolved: ResolvedStack
    models: ModelRegistry  # the installed architectures; the checkpoint picked `source.architecture`
    source: ModelSource

    @property
    def model_config(self) -> ModelConfig:
        return self.source.config


StackSource = str | PathLike | Mapping[str, Any] | StackConfig | ResolvedStack | PreparedStack
"""What names a stack: a stack file, its contents, a parsed or resolved stack, or a prepared one."""


def resolve_stack(
    stack: StackSource, plugin_manager: pluggy.PluginManager, *, check_device: bool = True
) -> ResolvedStack:
    """The stack resolved against the plugins of `plugin_manager` (as given when already resolved)."""
    if isinstance(stack, PreparedStack):
        return stack.resolved
    if isinstance(stack, ResolvedStack):
        return stack
    config = stack if isinstance(stack, StackConfig) else load_stack(stack)
    return resolve(config, build_registry(plugin_manager), check_device=check_device)


def prepare_stack(
    stack: StackSource, *, plugin_manager: pluggy.PluginManager | None = None, check_device: bool = True
) -> PreparedStack:
    """Load the plugins (unless given), resolve the stack, open its model and check the two
    against each other; reads no weights. A `PreparedStack` is returned as it is."""
    if isinstance(stack, PreparedStack):
        return stack
    pm = plugin_manager or make_plugin_manager()
    resolved = resolve_stack(stack, pm, check_device=check_device)
    models = build_model_registry(pm)
    source = open_model_source(resolved.model, models=models)
    check_model(resolved, source.config)  # conflicts stop here, before any weight loads
    return PreparedStack(pm, resolved, models, source)
