"""The `nvfp4` quantizer: what it builds for a checkpoint."""

from __future__ import annotations

from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import LinearFactory, LinearSpec, Quantizer
from lmstack.quant.formats import CT_NVFP4, DENSE, GGUF, WeightFormat, checkpoint_format_id
from lmstack_nvfp4 import nvfp4
from lmstack_nvfp4.scheme import SCALE_SEARCH, Nvfp4WeightFormat, parse_scheme


class Nvfp4Quantizer(Quantizer):
    kv_cache_dtype = None

    def __init__(
        self,
        from_checkpoint: bool,
        kernel: str,
        search: tuple[float, ...],
        input_scales: bool = False,
        interpret: bool = False,
    ) -> None:
        self.from_checkpoint, self.kernel, self.search = from_checkpoint, kernel, search
        self.input_scales, self.interpret = input_scales, interpret

    def linear_factory(self) -> LinearFactory:
        from lmstack_nvfp4.linear import Nvfp4Linear

        def make(spec: LinearSpec) -> nn.Module:
            return Nvfp4Linear(
                spec, self.from_checkpoint, self.kernel, self.search, self.input_scales, self.interpret
            )

        return make

    def shard_alignment(self, spec: LinearSpec) -> int:
        # Row-parallel splits cut the input: whole groups of 16 (8 bytes, one scale) per rank.
        return nvfp4.GROUP if spec.parallel == "row" else 1

    def weight_format(self) -> WeightFormat:
        return Nvfp4WeightFormat(self.search)


def make_quantizer(
    quantization: dict | None,
    device_type: str,
    kernel: str = "auto",
    scale_search: bool = True,
    interpret: bool = False,
) -> Nvfp4Quantizer:
    """An nvfp4-pack-quantized checkpoint is served as stored; a dense or GGUF one is quantized
    as it loads (the same RTN-with-scale-search `lmstack quantize --method nvfp4` writes)."""
    fmt = checkpoint_format_id(quantization)
    input_scales = False
    if fmt == CT_NVFP4:
        input_scales, from_checkpoint = parse_scheme(quantization or {}), True
    elif fmt in (DENSE, GGUF):
        from_checkpoint = False
    else:
        raise ConfigError(f"nvfp4 cannot read a {fmt} checkpoint (it reads {CT_NVFP4}, dense and gguf)")
    if kernel == "auto":
        kernel = "triton" if device_type == "cuda" or interpret else "dequant"
    search = SCALE_SEARCH if scale_search else (1.0,)
    return Nvfp4Quantizer(from_checkpoint, kernel, search, input_scales, interpret)
