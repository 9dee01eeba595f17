"""`lmstack quantize --method awq`: the int4 format made `Calibrated` by lmstack-calibrate's AWQ
search (`lmstack_calibrate.awq_search`: activation-aware scales, clipping search, then GPTQ rounding through
`Int4WeightFormat.gptq`)."""

from __future__ import annotations

from lmstack_awq.int4_format import Int4WeightFormat
from lmstack_awq.int4_math import Int4Scheme
from lmstack_calibrate.awq_search import AWQCalibration, AWQConfig, awq_calibrate, search_clip, search_scales


class AwqWeightFormat(AWQCalibration, Int4WeightFormat):
    """What `lmstack quantize --method awq` writes: compressed-tensors pack-quantized int4, after
    the AWQ search (`Calibrated`)."""

    def __init__(self, scheme: Int4Scheme | None = None, config: AWQConfig | None = None) -> None:
        super().__init__("awq", scheme)
        self.awq = config or AWQConfig()


__all__ = ["AWQCalibration", "AWQConfig", "AwqWeightFormat", "awq_calibrate", "search_clip", "search_scales"]
