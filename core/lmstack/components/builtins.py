"""The reference components and the Llama architecture, registered through the same hooks
third-party plugins use."""

from __future__ import annotations

from lmstack.components import (
    continuous,
    none_cache,
    none_quantizer,
    none_speculator,
    paged,
    single,
    torch_attention,
)
from lmstack.hookspecs import hookimpl
from lmstack.model import families, gemma, moe


@hookimpl
def lmstack_register_schedulers(register):
    register(continuous.COMPONENT)


@hookimpl
def lmstack_register_allocators(register):
    register(paged.COMPONENT)


@hookimpl
def lmstack_register_attention(register):
    register(torch_attention.COMPONENT)


@hookimpl
def lmstack_register_quantizers(register):
    register(none_quantizer.COMPONENT)


@hookimpl
def lmstack_register_speculators(register):
    register(none_speculator.COMPONENT)


@hookimpl
def lmstack_register_parallel(register):
    register(single.COMPONENT)


@hookimpl
def lmstack_register_caches(register):
    register(none_cache.COMPONENT)


@hookimpl
def lmstack_register_models(register):
    for architecture in (*families.DECODER_ARCHITECTURES, *gemma.ARCHITECTURES, *moe.MOE_ARCHITECTURES):
        register(architecture)
