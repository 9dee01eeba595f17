"""lmstack-int8: the `int8` quantizer (per-row symmetric int8 weights made at load)."""
