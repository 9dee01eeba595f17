"""What kernel plugins build on: the native (C++) extension build, Triton support (the
interpreter on CPUs, split-K helpers), reusable scratch buffers and CPU feature detection.
Public: see `lmstack.plugin_api.PUBLIC_API`."""
