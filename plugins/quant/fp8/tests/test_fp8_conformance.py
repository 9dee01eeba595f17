"""The conformance kit on `fp8` (quantizing the kit's dense weights as they load)."""

from lmstack.testing import QuantizerConformance


class TestFp8(QuantizerConformance):
    component = "fp8"
    options = {"kernel": "dequant"}
    # e4m3 keeps 3 mantissa bits: weights and per-token activations each cost ~3 % (rms).
    quantization_error = 0.06
