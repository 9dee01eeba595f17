"""The fp8 and nvfp4 quantizers' CPU matmul paths against the dense linear, on SmolLM2-135M's
linear shapes (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576), batch 1 and 32.

    python benchmarks/kernels/fp_quant_cpu_matmul.py [--reps 30] [--threads N]

Paths (each built through the plugin's own linear, dense weights quantized at load):
  dense           torch.nn.functional.linear in the model dtype
  fp8/dequant     the fp8 default on the CPU: e4m3 weights widened and scaled per call,
                  activations rounded through e4m3 per token, then a dense matmul
  fp8/scaled_mm   torch._scaled_mm on the CPU (row-wise scales)
  nvfp4/dequant   the nvfp4 CPU path: codes and scales decoded per call, then a dense matmul

Prints one JSON object (median microseconds per call, summed over the four layer shapes, per
path, dtype and batch; the CPU's name) and writes it to benchmarks/results/fp_quant_cpu_matmul-<date>-<cpu kind>/.
The machine may be shared: quote ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports happen inside the functions, so --help is fast
    import torch

from lmstack_bench.toolbox import result_dir, write_json

SHAPES = {
    "qkv_proj": (576, (576, 192, 192)),
    "o_proj": (576, (576,)),
    "gate_up_proj": (576, (1536, 1536)),
    "down_proj": (1536, (576,)),
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def layers(path: str, dtype: torch.dtype):
    import torch

    from lmstack.interfaces import LinearSpec
    from lmstack.model.linear import default_linear

    if path == "dense":
        make = default_linear
    elif path.startswith("fp8"):
        from lmstack_fp8.quantizer import make_quantizer

        make = make_quantizer(None, "cpu", kernel=path.split("/")[1]).linear_factory()
    else:
        from lmstack_nvfp4.quantizer import make_quantizer as make_nvfp4

        make = make_nvfp4(None, "cpu", kernel="dequant").linear_factory()
    out = []
    for name, (inp, sizes) in SHAPES.items():
        layer = make(LinearSpec(inp, sum(sizes), False, name, sizes, "replicated", dtype))
        for i, n in enumerate(sizes):
            layer.weight.weight_loader(
                layer.weight, torch.randn(n, inp) * inp**-0.5, i if len(sizes) > 1 else None
            )
        out.append(layer)
    return out


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()

    import torch

    args.threads = args.threads or torch.get_num_threads()

    torch.set_num_threads(args.threads)
    results = []
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for path in ("dense", "fp8/dequant", "fp8/scaled_mm", "nvfp4/dequant"):
                mods = layers(path, dtype)
                for m in (1, 32):
                    xs = [
                        torch.randn(m, mod.weight.shape[1] if path == "dense" else mod.spec.in_features).to(
                            dtype
                        )
                        for mod in mods
                    ]
                    us = median_us(lambda mods=mods, xs=xs: [mod(x) for mod, x in zip(mods, xs)], args.reps)
                    results.append(
                        {
                            "path": path,
                            "dtype": str(dtype).removeprefix("torch."),
                            "batch": m,
                            "us": round(us, 1),
                        }
                    )
                    print(json.dumps(results[-1]), flush=True)
    summary = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "reps": args.reps,
        "shapes": SHAPES,
        "results": results,
    }
    write_json(result_dir("fp_quant_cpu_matmul") / "fp_quant_cpu_matmul.json", summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
