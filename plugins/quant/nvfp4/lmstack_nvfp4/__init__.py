"""lmstack-nvfp4: the `nvfp4` quantizer (e2m1 weights in groups of 16 with e4m3 scales and a
global fp32 scale, compressed-tensors nvfp4-pack-quantized)."""
