"""lmstack-gguf: a GGUF checkpoint's quantized blocks served as stored (see README.md)."""
