"""The conformance kit on `fp8` (quantizing the kit's dense weights as they load)."""

from torch import float32

from lmstack.testing import QuantizerConformance


class TestFp8(QuantizerConformance):
    component = "fp8"
    options = {"kernel": "dequant"}
    # e4m3 keeps 3 mantissa bits: ~3 % rms weight error (and as much again for activations).
    quantization_error = 0.06


class TestFp8W8A8(QuantizerConformance):
    # The W8A8 arithmetic of the CUDA kernel (activations rounded per token), on the CPU.
    component = "fp8"
    options = {"kernel": "emulate"}
    reader_options = {"kernel": "emulate"}  # read back with the same arithmetic
    weight_only = False
    dtypes = (float32,)
    quantization_error = 0.06
