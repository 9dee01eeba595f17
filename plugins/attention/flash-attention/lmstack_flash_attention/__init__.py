"""lmstack plugin `flash-attention`: a Triton FlashAttention kernel for varlen causal prefill over
the paged KV cache (see README.md).

- `lmstack_flash_attention.plugin`: the component (capabilities, options, resolution check)
  and the registration hook — the entry point;
- `lmstack_flash_attention.backend`: `FlashAttention`, the core's AttentionBackend;
- `lmstack_flash_attention.kernel`: the Triton kernel and `flash_prefill`, its launcher
  (needs only torch and Triton).

Importing the package imports none of them.
"""
