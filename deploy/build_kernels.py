"""Build every native kernel lmstack ships, for the image (deploy/Dockerfile runs it): exit 1
naming any that did not build, so an image never ships without them unnoticed.

The kernels are compiled with the compiler's default target (x86-64 baseline on Debian amd64;
the extensions pass no -march) and pick AVX2 / AVX-512 code at run time (`best_isa()`), so one
image runs on any x86-64 CPU. This checks that baseline too: a compiler whose default target
is a newer ISA would build kernels that crash with SIGILL on older hosts.
"""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys

# The modules holding a NativeExtension as EXTENSION (the build modules `make install` runs).
MODULES = (
    "lmstack.model.layer_ops",
    "lmstack_cpu_paged.build",
    "lmstack_int8.native",
    "lmstack_gguf.native",
)


def default_march(compiler: str = "c++") -> str | None:
    """The -march the compiler uses when none is given (None where it does not say)."""
    out = subprocess.run([compiler, "-Q", "--help=target"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "-march=":
            return parts[1]
    return None


def main() -> int:
    failed = []
    if platform.machine() == "x86_64":
        march = default_march()
        if march not in ("x86-64", None):
            failed.append(f"the compiler's default target is -march={march}, not the x86-64 baseline")
    for name in MODULES:
        ext = importlib.import_module(name).EXTENSION
        problem = ext.load_error()
        if problem is None:
            print(
                f"{name}: built in {ext.build_dir()} (kernels for this CPU: ISA level {ext.load().best_isa()})"
            )
        else:
            failed.append(f"{name}: {problem}")
    for line in failed:
        print(f"NOT built: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
