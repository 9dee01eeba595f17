"""The `fp8` quantizer: what it builds for a checkpoint."""

from __future__ import annotations

from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.quant.formats import CT_FLOAT_QUANTIZED, DENSE, GGUF, WeightFormat, checkpoint_format_id
from lmstack_fp8.scheme import Fp8Scheme, Fp8WeightFormat, parse_scheme

KERNELS = ("auto", "dequant", "scaled_mm", "emulate")


class Fp8Quantizer(Quantizer):
    kv_cache_dtype = None

    def __init__(self, scheme: Fp8Scheme, from_checkpoint: bool, kernel: str) -> None:
        self.scheme, self.from_checkpoint, self.kernel = scheme, from_checkpoint, kernel

    def linear_factory(self) -> LinearFactory:
        from lmstack_fp8.linear import Fp8Linear

        def make(spec: LinearSpec) -> nn.Module:
            return Fp8Linear(spec, self.scheme, self.from_checkpoint, self.kernel)

        return make

    def weight_format(self) -> WeightFormat:
        return Fp8WeightFormat()


def make_quantizer(
    quantization: dict | None, device_type: str, kernel: str = "auto", activations: str = "dynamic"
) -> Fp8Quantizer:
    """A float-quantized checkpoint is served as its config says; a dense or GGUF one is
    quantized as it loads (per-channel weights, `activations` as asked)."""
    fmt = checkpoint_format_id(quantization)
    if fmt == CT_FLOAT_QUANTIZED:
        scheme, from_checkpoint = parse_scheme(quantization or {}), True
    elif fmt in (DENSE, GGUF):
        scheme, from_checkpoint = Fp8Scheme(per_channel_weights=True, activations=activations), False
    else:
        raise ConfigError(
            f"fp8 cannot read a {fmt} checkpoint (it reads {CT_FLOAT_QUANTIZED}, dense and gguf)"
        )
    if kernel == "auto":
        # The CPU has no fp8 matmul (torch._scaled_mm there is no faster than widening the
        # weight: README), so it computes weight-only, as vLLM does on such GPUs.
        kernel = "scaled_mm" if device_type == "cuda" else "dequant"
    return Fp8Quantizer(scheme, from_checkpoint, kernel)
