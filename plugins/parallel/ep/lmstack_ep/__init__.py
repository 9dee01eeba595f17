"""lmstack-ep: the `ep` parallel layout (expert parallelism)."""
