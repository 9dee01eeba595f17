"""Tile sweep for the quantizers' GPU kernels, to choose their defaults: lmstack-awq's W4A16 and
lmstack-nvfp4's GEMMs under several tiles, K splits, warps and stages, and their
dequantize-then-matmul path, against bf16 `F.linear`; plus where fp8's scaled_mm layer spends
its time (activation quantization in torch ops vs one fused Triton kernel vs the matmul); the
dequantize kernels alone under five tiles (each checked equal to the default tile's output); and
an empty Triton kernel's launch-to-end time, which every small timed call includes.

    python benchmarks/gpu/quant_gpu_sweep.py --out DIR    # one CUDA device, a few minutes

Each timed call is first checked against bf16 `F.linear` on the dequantized weight (relative
error <= 2e-2, bf16 rounding of a long dot; the kernels' exact checks are in gpu_check.py and the
plugins' tests). Median of `triton.testing.do_bench` with the L2 flushed between calls.
Writes DIR/quant_gpu_sweep.json; prints the best configuration per shape and row count.
"""

# The timed lambdas run inside the loop iteration that defines them (B023 cannot see it).
# ruff: noqa: B023
from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

SHAPES = ((4096, 4096), (28672, 4096), (4096, 14336))
SWEEP_ROWS = (1, 16, 64)
PATH_ROWS = (1, 4, 16, 32, 64, 128, 256, 1024)
TILES = ((32, 64), (64, 64), (64, 128), (128, 64))  # (BN, bytes or columns per step)
SPLITS = (1, 4, 8, 16)
WARPS_STAGES = ((4, 3), (8, 4))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, tiny sizes: checks the script"
    )
    args = p.parse_args()
    global SHAPES, SWEEP_ROWS, PATH_ROWS, TILES, SPLITS, WARPS_STAGES
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        SHAPES, SWEEP_ROWS, PATH_ROWS = ((48, 160),), (1,), (1, 20)
        TILES, SPLITS, WARPS_STAGES = ((32, 16),), (1, 2), ((4, 3),)
    interp = args.smoke
    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing

    from lmstack.interfaces import LinearSpec
    from lmstack.kernels.hardware import cpu_description
    from lmstack_awq.int4_math import Int4Scheme, quantize_int4
    from lmstack_awq.kernels import triton_w4a16 as w4
    from lmstack_awq.linear import Int4Linear
    from lmstack_fp8 import fp8
    from lmstack_fp8.quantize_kernel import quantize_tokens
    from lmstack_nvfp4 import kernel as nk
    from lmstack_nvfp4 import nvfp4

    dev = "cpu" if args.smoke else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
        **cpu_description(),  # the host's: the GPU does the timed work
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": [],
    }
    path = out / "quant_gpu_sweep.json"

    def bench(fn) -> float:
        if args.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1000
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))

    def rel(a, b) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    def record(**row) -> None:
        result["rows"].append(row)

    def measure(fn, ref, base: float, **where) -> None:
        """Check fn() against ref, then time it (not when it is wrong) and record the row."""
        try:
            err = rel(fn(), ref)
            ms = bench(fn) if err <= 2e-2 else None
            record(**where, ms=ms, rel_error=err, speedup=base / ms if ms else None)
        except Exception as exc:
            record(**where, error=f"{type(exc).__name__}: {exc}"[:300])

    if not args.smoke:  # an idle GPU clocks down; the first timings would catch it ramping up
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            a @ a
        torch.cuda.synchronize()

    t_start = time.perf_counter()
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * k**-0.5
        # int4, groups of 128, asymmetric: the layer's buffers.
        with torch.device(dev):
            layer = Int4Linear(LinearSpec(k, n, False, "sweep"), Int4Scheme(128, False), "dense")
        layer.weight.weight_loader(layer.weight, w, None)
        packed4, scales4, zeros4 = layer.w_packed, layer.w_scales, layer.w_zeros
        deq4 = quantize_int4(w, Int4Scheme(128, False)).dequantize().to(dev).bfloat16()
        packedf, scalef, gs = nvfp4.quantize(w)
        factorf = (1.0 / gs).expand(n).contiguous()
        deqf = nvfp4.dequantize(packedf, scalef, factorf, k).bfloat16()
        wb = w.bfloat16()
        for m in PATH_ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = bench(lambda x=x: F.linear(x, wb))
            record(kernel="bf16", shape=[n, k], rows=m, ms=base)
            ref4, reff = F.linear(x, deq4), F.linear(x, deqf)
            for name, fn, ref in (
                (
                    "w4a16.default",
                    lambda x=x: w4.w4a16_matmul(x, packed4, scales4, zeros4, k, 128, interpret=interp),
                    ref4,
                ),
                (
                    "w4a16.dequant",
                    lambda x=x: w4.w4a16_matmul(
                        x, packed4, scales4, zeros4, k, 128, interpret=interp, dequant_min_rows=1
                    ),
                    ref4,
                ),
                ("nvfp4.default", lambda x=x: nk.nvfp4_matmul(x, packedf, scalef, factorf, interp), reff),
                (
                    "nvfp4.dequant",
                    lambda x=x: nk.nvfp4_matmul(x, packedf, scalef, factorf, interp, dequant_min_rows=1),
                    reff,
                ),
                # The FP16_DECODE variant of the weight decode: the GEMM under the default tiles,
                # and the dequantize path.
                (
                    "nvfp4.fp16_decode",
                    lambda x=x, c=replace(nk.default_config(m, n, k, interp), fp16_decode=True): (
                        nk.nvfp4_gemm(x, packedf, scalef, factorf, c, interp)
                    ),
                    reff,
                ),
                (
                    "nvfp4.fp16_decode_dequant",
                    lambda x=x: F.linear(
                        x,
                        nk.nvfp4_dequantize(
                            packedf, scalef, factorf, k, torch.bfloat16, interp, fp16_decode=True
                        ),
                    ),
                    reff,
                ),
            ):
                measure(fn, ref, base, kernel=name, shape=[n, k], rows=m)
            if m not in SWEEP_ROWS:
                continue
            for (bn, bk), split, (warps, stages) in (
                (t, s, ws) for t in TILES for s in SPLITS for ws in WARPS_STAGES
            ):
                bm = 16 if m <= 16 else 64
                for name, fn, ref in (
                    (
                        "w4a16.gemm",
                        lambda x=x, c=w4.GemmConfig(bm, bn, bk, split, warps, stages): w4.w4a16_gemm(
                            x, packed4, scales4, zeros4, k, 128, c, interpret=interp
                        ),
                        ref4,
                    ),
                    (
                        "nvfp4.gemm",
                        lambda x=x, c=nk.GemmConfig(bm, bn, 2 * bk, split, warps, stages): nk.nvfp4_gemm(
                            x, packedf, scalef, factorf, c, interp
                        ),
                        reff,
                    ),
                ):
                    config = {
                        "bm": bm,
                        "bn": bn,
                        "bk": bk if name.startswith("w4") else 2 * bk,
                        "split_k": split,
                        "num_warps": warps,
                        "num_stages": stages,
                    }
                    measure(fn, ref, base, kernel=name, shape=[n, k], rows=m, config=config)
            path.write_text(json.dumps(result, indent=1))
        print(f"{n}x{k} done at {time.perf_counter() - t_start:.0f} s", flush=True)

    # The dequantize kernels alone, under a few tiles, and an empty kernel's launch (what every
    # small timed call above includes: do_bench's events wait for the host to launch).
    @triton.jit
    def _empty(x_ptr):
        pass

    probe = torch.empty(1, device=dev)
    result["empty_kernel_ms"] = bench(lambda: _empty[(1,)](probe))
    for n, k in SHAPES[:2]:
        w = torch.randn(n, k, device=dev) * k**-0.5
        with torch.device(dev):
            layer = Int4Linear(LinearSpec(k, n, False, "sweep"), Int4Scheme(128, False), "dense")
        layer.weight.weight_loader(layer.weight, w, None)
        packedf, scalef, gs = nvfp4.quantize(w)
        factorf = (1.0 / gs).expand(n).contiguous()
        ref4 = w4.w4a16_dequantize(layer.w_packed, layer.w_scales, layer.w_zeros, k, 128, torch.bfloat16)
        reff = nk.nvfp4_dequantize(packedf, scalef, factorf, k, torch.bfloat16, interp)
        for tile in ((32, 64), (64, 64), (16, 256), (64, 128), (128, 32)):
            tile_f = (tile[0], 2 * tile[1])
            same = torch.equal(
                w4.w4a16_dequantize(
                    layer.w_packed, layer.w_scales, layer.w_zeros, k, 128, torch.bfloat16, tile
                ),
                ref4,
            ) and torch.equal(
                nk.nvfp4_dequantize(packedf, scalef, factorf, k, torch.bfloat16, interp, tile_f), reff
            )
            ms4 = bench(
                lambda t=tile: w4.w4a16_dequantize(
                    layer.w_packed, layer.w_scales, layer.w_zeros, k, 128, torch.bfloat16, t
                )
            )
            msf = bench(
                lambda t=tile_f: nk.nvfp4_dequantize(packedf, scalef, factorf, k, torch.bfloat16, interp, t)
            )
            msf16 = bench(
                lambda t=tile_f: nk.nvfp4_dequantize(
                    packedf, scalef, factorf, k, torch.bfloat16, interp, t, fp16_decode=True
                )
            )
            same = same and torch.equal(
                nk.nvfp4_dequantize(packedf, scalef, factorf, k, torch.bfloat16, interp, tile_f, True), reff
            )
            record(
                kernel="dequant_only",
                shape=[n, k],
                tile=list(tile),
                same_as_default=same,
                w4a16_ms=ms4,
                nvfp4_ms=msf,
                nvfp4_fp16_decode_ms=msf16,
            )

    # fp8: where the layer's time goes at decode sizes (activation quantization in torch ops vs
    # the plugin's fused kernel vs the matmul).
    for n, k in () if args.smoke else SHAPES:
        w = torch.randn(n, k, device=dev) * k**-0.5
        wq, ws = fp8.quantize_weight(w)
        wt, wsr, wbf = wq.t(), ws.reshape(1, -1), w.bfloat16()
        for m in (1, 16, 64, 1024):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            try:
                sx = fp8.token_scales(x)
                qx = fp8.to_fp8(x, sx)
                fq, fs = quantize_tokens(x)
                same = bool(torch.equal(fq.view(torch.uint8), qx.view(torch.uint8)) and torch.equal(fs, sx))
                record(
                    kernel="fp8.parts",
                    shape=[n, k],
                    rows=m,
                    fused_quant_identical=same,
                    torch_quant_ms=bench(lambda x=x: fp8.to_fp8(x, fp8.token_scales(x))),
                    fused_quant_ms=bench(lambda x=x: quantize_tokens(x)),
                    scaled_mm_ms=bench(
                        lambda qx=qx, sx=sx: torch._scaled_mm(
                            qx, wt, scale_a=sx, scale_b=wsr, out_dtype=torch.bfloat16
                        )
                    ),
                    bf16_ms=bench(lambda x=x: F.linear(x, wbf)),
                )
            except Exception:
                record(kernel="fp8.parts", shape=[n, k], rows=m, error=traceback.format_exc(limit=3)[-600:])
    path.write_text(json.dumps(result, indent=1))

    # Summary: per (kernel family, shape, rows) the best configuration.
    print("\nbest GEMM configuration per shape and rows (speedup over bf16 F.linear)")
    rows = [r for r in result["rows"] if r.get("ms")]
    for fam in ("w4a16", "nvfp4"):
        for n, k in SHAPES:
            for m in PATH_ROWS:
                mine = [
                    r for r in rows if r["kernel"].startswith(fam) and r["shape"] == [n, k] and r["rows"] == m
                ]
                if not mine:
                    continue
                best = min(mine, key=lambda r: r["ms"])

                def us(kernel: str) -> float:
                    r = next((r for r in mine if r["kernel"] == kernel), None)
                    return r["ms"] * 1000 if r else float("nan")

                variants = (
                    f"; fp16 decode {us('nvfp4.fp16_decode'):.1f} us, its dequant "
                    f"{us('nvfp4.fp16_decode_dequant'):.1f} us"
                    if fam == "nvfp4"
                    else ""
                )
                print(
                    f"  {fam} {n}x{k} M={m}: best {best['kernel']} {best.get('config', '')} "
                    f"{best['ms'] * 1000:.1f} us ({best['speedup']:.2f}x); default "
                    f"{us(f'{fam}.default'):.1f} us; dequant {us(f'{fam}.dequant'):.1f} us{variants}"
                )
    for r in result["rows"]:
        if r["kernel"] == "fp8.parts":
            if "error" in r:
                print("  fp8", r["shape"], r["rows"], r["error"][-200:])
            else:
                print(
                    f"  fp8 {r['shape']} M={r['rows']}: quant torch {r['torch_quant_ms'] * 1000:.1f} us, fused "
                    f"{r['fused_quant_ms'] * 1000:.1f} us (identical {r['fused_quant_identical']}), scaled_mm "
                    f"{r['scaled_mm_ms'] * 1000:.1f} us, bf16 {r['bf16_ms'] * 1000:.1f} us"
                )
    print(f"  empty Triton kernel, launch to end: {result['empty_kernel_ms'] * 1000:.1f} us")

    def moved(shape) -> float:  # bytes: ~4.5 bits a weight read, a bf16 weight written
        return shape[0] * shape[1] * (0.5625 + 2)

    for r in result["rows"]:
        if r["kernel"] == "dequant_only":
            print(
                f"  dequantize {r['shape']} tile {r['tile']}: W4A16 {r['w4a16_ms'] * 1000:.1f} us, "
                f"NVFP4 {r['nvfp4_ms'] * 1000:.1f} us (fp16 decode {r['nvfp4_fp16_decode_ms'] * 1000:.1f} us; "
                f"same weight as the default tile: {r['same_as_default']}; "
                f"{moved(r['shape']) / r['w4a16_ms'] / 1e6:.0f} / {moved(r['shape']) / r['nvfp4_ms'] / 1e6:.0f} GB/s)"
            )
    errors = [r for r in result["rows"] if "error" in r]
    print(f"{len(errors)} errors; wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
