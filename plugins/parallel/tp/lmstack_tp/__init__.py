"""lmstack-tp: the `tp` parallel layout (tensor parallelism)."""
