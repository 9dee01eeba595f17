"""lmstack-fp8: the `fp8` quantizer (FP8 e4m3 weights, compressed-tensors float-quantized)."""
