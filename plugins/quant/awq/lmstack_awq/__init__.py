"""lmstack-awq: int4 weights for lmstack (`awq` and `rtn-int4` quantizers).

`lmstack_awq.int4_format.Int4WeightFormat` is the checkpoint format both quantizers write
(compressed-tensors pack-quantized int4, group scales, optional zero points)."""
