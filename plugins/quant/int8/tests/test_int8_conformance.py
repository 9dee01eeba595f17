"""The conformance kit on `int8` (quantizing the kit's dense weights as they load), in both
fp32 modes: decode-sized fp32 batches through the int8 op in bf16 (the default), and exact."""

import torch

from lmstack.testing import QuantizerConformance


class TestInt8(QuantizerConformance):
    component = "int8"
    tensor_parallel = True
    # int8 with one scale per row of Gaussian weights: ~0.7 % relative error per layer output
    # (up to ~1 % for the kit's widest rows, whose largest value is furthest out).
    quantization_error = 0.015
    # The kit's batches (< 16 rows) of fp32 activations go through the op in bf16.
    activation_dtypes = {torch.float32: torch.bfloat16}


class TestInt8ExactFp32(QuantizerConformance):
    component = "int8"
    options = {"fp32_activations": "exact"}
    tensor_parallel = True
    dtypes = (torch.float32,)
    quantization_error = 0.015
