"""Quantizers `rtn-int4` and `awq` (work in progress)."""

from __future__ import annotations

from lmstack.interfaces import Quantizer
from lmstack.quant_format import WeightFormat
from lmstack_awq.int4_format import Int4WeightFormat
from lmstack_awq.int4_math import Int4Scheme


class RtnInt4Quantizer(Quantizer):
    def __init__(self, options, ctx) -> None:
        self.options = options
        self.scheme = Int4Scheme(options.group_size, options.symmetric)

    def weight_format(self) -> WeightFormat:
        return Int4WeightFormat("rtn-int4", self.scheme)


class AwqQuantizer(Quantizer):
    def __init__(self, options, ctx) -> None:
        self.options = options

    def weight_format(self) -> WeightFormat:
        from lmstack_awq.search import AwqWeightFormat  # the AWQ search runs before encoding

        return AwqWeightFormat(Int4Scheme(128, False))
