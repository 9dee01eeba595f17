"""The conformance kit on `nvfp4` (quantizing the kit's dense weights as they load): the CPU
dequantize-per-layer path, and the Triton dequantizing GEMM in the Triton interpreter."""

from lmstack.testing import QuantizerConformance


class TestNvfp4Dequant(QuantizerConformance):
    component = "nvfp4"
    options = {"kernel": "dequant"}
    # e2m1 keeps one mantissa bit: ~9 % rms weight error with e4m3 scales per 16 values.
    quantization_error = 0.12


class TestNvfp4Triton(QuantizerConformance):
    component = "nvfp4"
    options = {"kernel": "triton", "interpret": True}
    quantization_error = 0.12
