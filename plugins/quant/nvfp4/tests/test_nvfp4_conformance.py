"""The conformance kit on `nvfp4` (quantizing the kit's dense weights as they load), on the CPU
dequantize-per-layer path; test_nvfp4_kernel.py checks the Triton kernel against it."""

from lmstack.testing import QuantizerConformance


class TestNvfp4(QuantizerConformance):
    component = "nvfp4"
    options = {"kernel": "dequant"}
    input_multiple = 16  # compressed-tensors' NVFP4 layout holds whole groups of 16
    # e2m1 keeps one mantissa bit: ~9 % rms weight error with e4m3 scales per 16 values.
    quantization_error = 0.12
