"""Quantization in the core: checkpoint formats (`formats`) and the scaled fp8 KV cache (`kv`)."""
