"""`none`: no quantization — plain linears in the serving dtype, KV cache in the serving dtype."""

from __future__ import annotations

from lmstack.interfaces import Quantizer
from lmstack.registry import Component


class NoQuantizer(Quantizer):
    kv_cache_dtype = None


COMPONENT = Component(
    name="none",
    kind="quantizer",
    factory=lambda options, ctx: NoQuantizer(),
    description="Full-precision weights and KV cache in the serving dtype.",
    capabilities={"devices": ("cpu", "cuda", "mps"), "kv_cache_dtype": None},
)
