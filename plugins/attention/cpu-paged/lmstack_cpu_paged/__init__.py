"""lmstack plugin `cpu-paged`: paged attention on the CPU as a C++ extension (see README.md).

- `lmstack_cpu_paged.plugin`: the component (capabilities, options, resolution check) and the
  registration hook — the entry point;
- `lmstack_cpu_paged.backend`: `CpuPagedAttention`, the core's AttentionBackend;
- `lmstack_cpu_paged.build`: compiles the extension against the installed torch
  (`python -m lmstack_cpu_paged.build`) and loads it;
- `csrc/`: the kernels.

Importing the package imports none of them.
"""
