"""lmstack plugin `flash-decoding`: a Triton split-KV (FlashDecoding) decode kernel over the
paged KV cache (see README.md).

- `lmstack_flash_decoding.plugin`: the component (capabilities, options, resolution check)
  and the registration hook — the entry point;
- `lmstack_flash_decoding.backend`: `FlashDecoding`, the core's AttentionBackend;
- `lmstack_flash_decoding.kernel`: the Triton kernels and `flash_decode`, their launcher
  (needs only torch and Triton).

Importing the package imports none of them.
"""
