"""The Triton attention plugins on one GPU: flash-attention (prefill) and flash-decoding (decode)
against torch, with correctness checked first. Every peer is measured in the same run.

    python benchmarks/gpu/attention_gpu.py            # the full run, on a CUDA device (a few minutes)
    python benchmarks/gpu/attention_gpu.py --smoke    # CPU, Triton interpreter, tiny shapes: checks
                                                  # that the script works, measures nothing

(1) correctness: the core's attention conformance kit (random varlen batches with cached context,
    block sizes 1/4/16, GQA 1/3/8, head dims 64/128, bf16/fp16/fp32) on both kernels, and every
    timed shape against torch's output.
(2) prefill: one sequence of 1k-16k tokens, 32 query / 4 KV heads (GQA 8), head dim 128, bf16, K/V
    read from a paged cache (block 16, blocks shuffled). TFLOP/s (causal: half of 4*N^2*D per
    head) of flash-attention, of torch's scaled_dot_product_attention with the flash backend
    (dense K/V, causal), and of a bf16 matmul.
(3) decode: batch 1-128, context 1k-64k, the same heads. KV bytes read per second by
    flash-decoding (split count chosen from context and SM count) and by the same kernel forced
    to one split (single-pass paged decode: one program per sequence and KV head), against a
    device-to-device copy (bytes read + written per second).
(4) a small sweep of tile configurations and split counts at a few shapes, to tune defaults.

Timing: CUDA events around each call, the median of --reps calls after warm-ups, with the L2
cache flushed (a 256 MiB write) before each call. Triton compiles before the first timed call.

Targets (recorded in the JSON, pass or MISS): prefill >= 80 % of torch's flash backend at >= 4k
tokens; decode >= 70 % of the copy bandwidth at context >= 8k; split-KV >= 3x the single-pass
decode at batch 1, context 32k.

Writes attention_gpu.json and .png into benchmarks/results/attention_gpu-<date>-<gpu>/ (--smoke:
...-<cpu kind>-smoke/) and prints a summary. Needs torch with CUDA and Triton, and lmstack with the
two plugins importable (installed, or on PYTHONPATH as `benchmarks/gpu/gpu_session.sh run` sets it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import gpu_kind, result_dir, write_result

REPO = Path(__file__).resolve().parents[2]

FULL = {
    "dtype": "bfloat16",
    "hq": 32,
    "hkv": 4,
    "head_dim": 128,
    "block_size": 16,
    "prefill_lens": [1024, 2048, 4096, 8192, 16384],
    "decode_batches": [1, 4, 16, 64, 128],
    "decode_contexts": [1024, 4096, 8192, 16384, 32768, 65536],
    "warmup": 3,
    "reps": 15,
    "matmul_n": 8192,
    "copy_bytes": 2 << 30,
    "flush_bytes": 256 << 20,
    "kit_max_len": 300,
    "kit_large_batch": 40,
    # where the targets are read
    "prefill_target_min_len": 4096,
    "decode_target_min_ctx": 8192,
    "split_target_shape": [1, 32768],
    "sweep_prefill_len": 8192,
    "sweep_decode_shapes": [[1, 32768], [64, 8192]],
}
SMOKE = {
    **FULL,
    "hq": 8,
    "hkv": 1,
    "prefill_lens": [40, 100],
    "decode_batches": [1, 3],
    "decode_contexts": [70, 200],
    "warmup": 1,
    "reps": 2,
    "matmul_n": 128,
    "copy_bytes": 1 << 20,
    "flush_bytes": 0,
    "kit_max_len": 40,
    "kit_large_batch": 4,
    "prefill_target_min_len": 100,
    "decode_target_min_ctx": 200,
    "split_target_shape": [1, 200],
    "sweep_prefill_len": 100,
    "sweep_decode_shapes": [[1, 200]],
}
TARGETS = {
    "prefill_vs_torch_flash": 0.80,
    "decode_vs_copy_bandwidth": 0.70,
    "split_speedup_over_single_pass": 3.0,
}
# Tile configurations tried in (4); the first of each is the kernel's default on a GPU.
PREFILL_SWEEP = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
]
DECODE_SWEEP = [
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 2, "num_stages": 4},
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
]
SPLIT_SWEEP = [8, 16, 32, 64, 128]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    if args.reps:
        cfg = {**cfg, "reps": args.reps}
    if args.smoke:
        # Before anything imports Triton: it picks interpreter or compiled mode on import.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            f"attention_gpu: no CUDA device (torch {torch.__version__} sees none); run it on a GPU "
            "machine, or with --smoke for a CPU check of the script itself",
            file=sys.stderr,
        )
        return 2
    bench = Bench(torch, cfg, smoke=args.smoke)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "machine": bench.machine(),
        "config": cfg,
        "targets": {},
    }
    sections = [("correctness", bench.correctness), ("peers", bench.peers), ("prefill", bench.prefill)]
    sections += [("decode", bench.decode)]
    if not args.no_sweep:
        sections.append(("sweep", bench.sweep))
    for name, run in sections:
        t0 = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            result[name] = run()
        except Exception as exc:  # keep what was measured; say what broke
            result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(result[name]["traceback"], file=sys.stderr)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)
    result["targets"] = evaluate_targets(result, cfg)
    result["seconds"] = round(time.perf_counter() - started, 1)

    kind = None if args.smoke else gpu_kind(torch.cuda.get_device_name())
    out = result_dir("attention_gpu", args.out, tag="smoke" if args.smoke else "", kind=kind)
    json_path = write_result(out, "attention_gpu", result, plot)
    png_path = json_path.with_suffix(".png")
    print_summary(result)
    print(f"wrote {json_path} and {png_path.name} ({result['seconds']} s)")
    broken = [k for k in ("correctness", "prefill", "decode") if "error" in result.get(k, {})]
    failed = result.get("correctness", {}).get("failed", 0)
    return 1 if broken or failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument(
        "--out", default=None, help="folder (default benchmarks/results/attention_gpu-<date>-<gpu>[-smoke])"
    )
    p.add_argument("--reps", type=int, help="timed calls per measurement (default 15; smoke 2)")
    p.add_argument("--no-sweep", action="store_true", help="skip (4), the tile-configuration sweep")
    return p.parse_args(argv)


class Bench:
    def __init__(self, torch, cfg: dict, *, smoke: bool) -> None:
        self.torch = torch
        self.cfg = cfg
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = getattr(torch, cfg["dtype"])
        self.flush = (
            torch.empty(cfg["flush_bytes"], dtype=torch.uint8, device=self.device)
            if cfg["flush_bytes"]
            else None
        )
        from lmstack.testing.attention import plain_attention, reference_attention, rel_error
        from lmstack_flash_attention.kernel import flash_prefill
        from lmstack_flash_decoding.kernel import choose_splits, flash_decode

        self.flash_prefill, self.flash_decode, self.choose_splits = flash_prefill, flash_decode, choose_splits
        self.reference_attention, self.plain_attention = reference_attention, plain_attention
        self.rel_error = rel_error

    # --- helpers ---------------------------------------------------------------------------

    def time(self, fn) -> dict:
        """Median seconds of `reps` calls. On a GPU the call is captured in a CUDA graph after
        the warm-ups (which compile), so host-side launch overhead — larger than a small decode
        kernel — is not timed; each replay sits between two CUDA events, after an L2 flush."""
        torch, cfg = self.torch, self.cfg
        for _ in range(cfg["warmup"]):
            fn()
        call, graphed = fn, False
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                call, graphed = graph.replay, True
            except Exception as exc:  # capture unsupported: time plain calls, and say so
                print(f"  (no CUDA graph: {type(exc).__name__}: {exc})", flush=True)
                torch.cuda.synchronize()
        times = []
        for _ in range(cfg["reps"]):
            if self.flush is not None:
                self.flush.zero_()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
        return {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "cuda_graph": graphed,
        }

    def machine(self) -> dict:
        torch = self.torch
        import triton

        from lmstack.kernels.hardware import cpu_description

        info = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "platform": platform.platform(),
            "git": _git(),
            **cpu_description(),
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            info.update(
                gpu=props.name,
                sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1),
            )
        return info

    def paged(self, lengths: list[int], hkv: int, head_dim: int, fill: bool = True):
        """A shuffled paged cache holding `lengths` tokens per sequence: (k_cache, v_cache,
        block_tables [B, max_blocks] int32, seq_lens int32)."""
        torch, bs = self.torch, self.cfg["block_size"]
        blocks = [-(-n // bs) for n in lengths]
        total = sum(blocks)
        k_cache = torch.empty(total, bs, hkv, head_dim, dtype=self.dtype, device=self.device)
        v_cache = torch.empty_like(k_cache)
        if fill:
            k_cache.normal_()
            v_cache.normal_()
        perm = torch.randperm(total, device=self.device).to(torch.int32)
        tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=self.device)
        start = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = perm[start : start + n]
            start += n
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, tables, seq_lens

    @staticmethod
    def dense(cache, table, length: int):
        """[length, Hkv, D] of one sequence, gathered from the paged cache."""
        bs = cache.shape[1]
        return cache[table[: -(-length // bs)].long()].flatten(0, 1)[:length]

    # --- (1) correctness -------------------------------------------------------------------

    def correctness(self) -> dict:
        """The conformance kit's checks, on three fixed combinations (each new combination
        compiles new kernel variants; three keep the compile time to about a minute)."""
        torch = self.torch
        import pytest

        from lmstack.testing.attention import AttentionConformance
        from lmstack_flash_attention.plugin import COMPONENT as FLASH_ATTENTION
        from lmstack_flash_decoding.plugin import COMPONENT as FLASH_DECODING

        combos = [(torch.bfloat16, 128, 16, 8), (torch.float16, 64, 4, 3), (torch.float32, 128, 1, 1)]
        cfg, device = self.cfg, self.device.type

        class Kit(AttentionConformance):
            # The registered components, built through their factories; the phases each runs
            # come from its declared capabilities.
            options = {"interpret": self.smoke}
            dtypes = (torch.bfloat16, torch.float16, torch.float32)
            head_dims = (128, 64)
            block_sizes = (1, 4, 16)
            gqa_ratios = (1, 3, 8)

            def _cases(self, matrix):
                return iter(combos)

        Kit.device, Kit.max_len, Kit.large_decode_batch = device, cfg["kit_max_len"], cfg["kit_large_batch"]
        checks = [
            "test_prefill_varlen",
            "test_prefill_chunk_attends_to_cached_context",
            "test_decode",
            "test_decode_large_batch",
            "test_decode_single_sequence",
            "test_sliding_window",
        ]
        rows = []
        for name, component in (("flash-attention", FLASH_ATTENTION), ("flash-decoding", FLASH_DECODING)):
            kit = type(f"{Kit.__name__}_{name}", (Kit,), {"component": component})()
            for check in checks:
                t0 = time.perf_counter()
                try:
                    getattr(kit, check)()
                    status = "pass"
                except pytest.skip.Exception:
                    status = "skip"
                except AssertionError as exc:
                    status = f"FAIL: {exc}"
                rows.append(
                    {
                        "kernel": name,
                        "check": check,
                        "status": status,
                        "s": round(time.perf_counter() - t0, 2),
                    }
                )
                print(f"  {name:16s} {check:46s} {status}", flush=True)
        failed = sum(r["status"].startswith("FAIL") for r in rows)
        return {"checks": rows, "failed": failed, "combinations": [[str(c[0]), *c[1:]] for c in combos]}

    # --- peers: matmul peak and copy bandwidth --------------------------------------------

    def peers(self) -> dict:
        torch, cfg = self.torch, self.cfg
        n = cfg["matmul_n"]
        a = torch.randn(n, n, device=self.device).to(self.dtype)
        b = torch.randn(n, n, device=self.device).to(self.dtype)
        mm = self.time(lambda: a @ b)
        src = torch.empty(cfg["copy_bytes"], dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        cp = self.time(lambda: dst.copy_(src))
        return {
            "matmul": {"n": n, **mm, "tflops": 2 * n**3 / mm["median_s"] / 1e12},
            "copy": {
                "bytes": cfg["copy_bytes"],
                **cp,
                "gbps_read_plus_write": 2 * cfg["copy_bytes"] / cp["median_s"] / 1e9,
            },
        }

    # --- (2) prefill -----------------------------------------------------------------------

    def sdpa(self, q, k, v):
        """torch's scaled_dot_product_attention, flash backend, causal; returns (fn, how)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        group = q.shape[1] // k.shape[1]
        attempts = [("flash, native GQA", {"enable_gqa": True}, k, v)]
        attempts.append(
            ("flash, K/V heads repeated", {}, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        )
        for how, kw, kk, vv in attempts:

            def fn(kk=kk, vv=vv, kw=kw):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)

            try:
                fn()
                return fn, how
            except RuntimeError:
                continue
        fn = lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True
        )  # noqa: E501
        return fn, "default backend (flash unavailable here)"

    def prefill(self) -> dict:
        torch, cfg = self.torch, self.cfg
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["head_dim"]
        scale = d**-0.5
        rows = []
        for n in cfg["prefill_lens"]:
            k_cache, v_cache, tables, seq_lens = self.paged([n], hkv, d)
            qsl = torch.tensor([0, n], dtype=torch.int32, device=self.device)
            q = torch.randn(n, hq, d, device=self.device).to(self.dtype)
            out = torch.empty_like(q)

            def ours(
                q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, qsl=qsl, seq_lens=seq_lens, n=n, out=out
            ):
                return self.flash_prefill(
                    q, k_cache, v_cache, tables, qsl, seq_lens, n, scale=scale, interpret=self.smoke, out=out
                )

            k = self.dense(k_cache, tables[0], n).transpose(0, 1).unsqueeze(0).contiguous()
            v = self.dense(v_cache, tables[0], n).transpose(0, 1).unsqueeze(0).contiguous()
            q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
            theirs, how = self.sdpa(q4, k, v)
            ref = theirs()[0].transpose(0, 1).float()
            err = float((ours().float() - ref).norm() / ref.norm())
            # Both against fp32 on the last query rows (a full fp32 score matrix would not fit at
            # 16k tokens): what this dtype costs torch on this device is the yardstick for ours.
            tail = min(n, 64)
            exact = self.reference_attention(
                q[-tail:], k[0].transpose(0, 1), v[0].transpose(0, 1), n - tail, scale
            )
            err_fp32 = self.rel_error(ours()[-tail:], exact)
            torch_err_fp32 = self.rel_error(ref[-tail:], exact)
            flops = 4 * d * hq * n * n / 2  # causal: half the score matrix
            t_ours, t_torch = self.time(ours), self.time(theirs)
            rows.append(
                {
                    "tokens": n,
                    "rel_error_vs_torch": err,
                    "rel_error_vs_fp32": err_fp32,
                    "torch_rel_error_vs_fp32": torch_err_fp32,
                    "ours": {**t_ours, "tflops": flops / t_ours["median_s"] / 1e12},
                    "torch_sdpa": {**t_torch, "tflops": flops / t_torch["median_s"] / 1e12, "how": how},
                    "ratio": t_torch["median_s"] / t_ours["median_s"],
                }
            )
            print(
                f"  prefill {n:6d} tokens: ours {rows[-1]['ours']['tflops']:7.1f} TFLOP/s, torch "
                f"{rows[-1]['torch_sdpa']['tflops']:7.1f} ({how}), ratio {rows[-1]['ratio']:.2f}, "
                f"rel err {err:.1e}",
                flush=True,
            )
        return {"heads": [hq, hkv], "head_dim": d, "block_size": cfg["block_size"], "rows": rows}

    # --- (3) decode ------------------------------------------------------------------------

    def decode(self) -> dict:
        torch, cfg = self.torch, self.cfg
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["head_dim"]
        scale = d**-0.5
        shapes = [(b, c) for b in cfg["decode_batches"] for c in cfg["decode_contexts"]]
        bs = cfg["block_size"]
        # One cache for every shape; each shape's block tables pick random blocks of it.
        k_cache, v_cache, _, _ = self.paged([max(b * -(-c // bs) for b, c in shapes) * bs], hkv, d)
        num_blocks = k_cache.shape[0]
        rows = []
        for b, c in shapes:
            nb = -(-c // bs)
            tables = torch.randperm(num_blocks, device=self.device)[: b * nb].view(b, nb).to(torch.int32)
            seq_lens = torch.full((b,), c, dtype=torch.int32, device=self.device)
            q = torch.randn(b, hq, d, device=self.device).to(self.dtype)
            out = torch.empty_like(q)

            def run(num_splits=None, q=q, tables=tables, seq_lens=seq_lens, c=c, out=out):
                return self.flash_decode(
                    q,
                    k_cache,
                    v_cache,
                    tables,
                    seq_lens,
                    c,
                    scale=scale,
                    interpret=self.smoke,
                    num_splits=num_splits,
                    out=out,
                )

            # Correctness of this shape against torch (one sequence is enough at scale).
            kk = self.dense(k_cache, tables[0], c).float().repeat_interleave(hq // hkv, 1)
            vv = self.dense(v_cache, tables[0], c).float().repeat_interleave(hq // hkv, 1)
            ref = torch.einsum(
                "hk,khd->hd", torch.einsum("hd,khd->hk", q[0].float(), kk).mul(scale).softmax(-1), vv
            )
            err = float((run()[0].float() - ref).norm() / ref.norm())
            # The plain computation in this dtype (matmuls in it, fp32 softmax) on this device:
            # the yardstick for ours, as in the conformance kit.
            kd, vd = self.dense(k_cache, tables[0], c), self.dense(v_cache, tables[0], c)
            plain_err = self.rel_error(self.plain_attention(q[:1], kd, vd, c - 1, scale)[0], ref)
            split, single = self.time(run), self.time(lambda: run(1))
            nbytes = 2 * b * c * hkv * d * k_cache.element_size()
            plan = self.choose_splits(b, hkv, c, self.device, self.smoke)
            rows.append(
                {
                    "batch": b,
                    "context": c,
                    "kv_bytes": nbytes,
                    "num_splits": plan.num_splits,
                    "rel_error_vs_torch": err,
                    "plain_rel_error_vs_fp32": plain_err,
                    "split": {**split, "gbps": nbytes / split["median_s"] / 1e9},
                    "single_pass": {**single, "gbps": nbytes / single["median_s"] / 1e9},
                    "speedup": single["median_s"] / split["median_s"],
                }
            )
            r = rows[-1]
            print(
                f"  decode b={b:4d} ctx={c:6d}: split {r['split']['gbps']:8.1f} GB/s, single "
                f"{r['single_pass']['gbps']:8.1f} GB/s, x{r['speedup']:.2f}, rel err {err:.1e}",
                flush=True,
            )
        return {"heads": [hq, hkv], "head_dim": d, "block_size": cfg["block_size"], "rows": rows}

    # --- (4) sweep -------------------------------------------------------------------------

    def sweep(self) -> dict:
        n = self.cfg["sweep_prefill_len"]
        prefill = self._sweep_prefill(n, PREFILL_SWEEP[:1] if self.smoke else PREFILL_SWEEP)
        decode = []
        for b, c in self.cfg["sweep_decode_shapes"]:
            variants = [({"config": x}, x) for x in DECODE_SWEEP]
            variants += [({"num_splits": s}, f"num_splits={s}") for s in SPLIT_SWEEP]
            if self.smoke:  # GPU tile configurations mean nothing to the interpreter
                variants = [({}, "default"), ({"num_splits": 2}, "num_splits=2")]
            decode += self._sweep_decode(b, c, variants)
        return {"prefill_tokens": n, "prefill": prefill, "decode": decode}

    def _sweep_prefill(self, n: int, configs: list[dict]) -> list[dict]:
        torch, cfg = self.torch, self.cfg
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["head_dim"]
        k_cache, v_cache, tables, seq_lens = self.paged([n], hkv, d)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=self.device)
        q = torch.randn(n, hq, d, device=self.device).to(self.dtype)
        args = (q, k_cache, v_cache, tables, qsl, seq_lens, n)
        rows = []
        for c in configs:
            over = None if self.smoke else c
            t = self.time(
                lambda over=over: self.flash_prefill(*args, scale=d**-0.5, interpret=self.smoke, config=over)
            )
            rows.append({"config": c, **t, "tflops": 4 * d * hq * n * n / 2 / t["median_s"] / 1e12})
        return rows

    def _sweep_decode(self, b: int, c: int, variants: list[tuple[dict, Any]]) -> list[dict]:
        torch, cfg = self.torch, self.cfg
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["head_dim"]
        k_cache, v_cache, tables, seq_lens = self.paged([c] * b, hkv, d)
        q = torch.randn(b, hq, d, device=self.device).to(self.dtype)
        args = (q, k_cache, v_cache, tables, seq_lens, c)
        nbytes = 2 * b * c * hkv * d * k_cache.element_size()
        rows = []
        for kw, label in variants:
            t = self.time(lambda kw=kw: self.flash_decode(*args, scale=d**-0.5, interpret=self.smoke, **kw))
            rows.append(
                {"batch": b, "context": c, "variant": label, **t, "gbps": nbytes / t["median_s"] / 1e9}
            )
        return rows


def evaluate_targets(result: dict, cfg: dict) -> dict:
    targets = {}
    prefill = [
        r for r in result.get("prefill", {}).get("rows", []) if r["tokens"] >= cfg["prefill_target_min_len"]
    ]
    if prefill:
        worst = min(r["ratio"] for r in prefill)
        targets["prefill_vs_torch_flash"] = {
            "what": f"flash-attention time vs torch SDPA flash, worst over >= {cfg['prefill_target_min_len']} tokens",
            "target": TARGETS["prefill_vs_torch_flash"],
            "measured": worst,
            "met": worst >= TARGETS["prefill_vs_torch_flash"],
        }
    copy = result.get("peers", {}).get("copy", {}).get("gbps_read_plus_write")
    decode = [
        r for r in result.get("decode", {}).get("rows", []) if r["context"] >= cfg["decode_target_min_ctx"]
    ]
    if decode and copy:
        fractions = {f"b={r['batch']},ctx={r['context']}": r["split"]["gbps"] / copy for r in decode}
        worst = min(fractions.values())
        goal = TARGETS["decode_vs_copy_bandwidth"]
        targets["decode_vs_copy_bandwidth"] = {
            "what": "flash-decoding KV bytes/s vs copy (read + write) bytes/s, worst over every batch "
            f"at context >= {cfg['decode_target_min_ctx']}",
            "target": goal,
            "measured": worst,
            "median": statistics.median(fractions.values()),
            "shapes_below": sorted(k for k, f in fractions.items() if f < goal),
            "met": worst >= goal,
        }
    b, c = cfg["split_target_shape"]
    row = next(
        (r for r in result.get("decode", {}).get("rows", []) if (r["batch"], r["context"]) == (b, c)), None
    )
    if row:
        targets["split_speedup_over_single_pass"] = {
            "what": f"single-pass time / split-KV time at batch {b}, context {c}",
            "target": TARGETS["split_speedup_over_single_pass"],
            "measured": row["speedup"],
            "met": row["speedup"] >= TARGETS["split_speedup_over_single_pass"],
        }
    return targets


def print_summary(result: dict) -> None:
    print(
        "\n== attention_gpu summary"
        + (" (smoke: CPU interpreter, numbers mean nothing)" if result["smoke"] else "")
    )
    m = result["machine"]
    print(f"machine: {m.get('gpu', 'cpu')}, torch {m['torch']}, triton {m['triton']}")
    corr = result.get("correctness", {})
    if "checks" in corr:
        passed = sum(r["status"] == "pass" for r in corr["checks"])
        print(
            f"(1) correctness: {passed} passed, {corr['failed']} failed, "
            f"{sum(r['status'] == 'skip' for r in corr['checks'])} skipped"
        )
    peers = result.get("peers", {})
    if "matmul" in peers:
        print(
            f"    peers: bf16 matmul {peers['matmul']['tflops']:.1f} TFLOP/s, copy "
            f"{peers['copy']['gbps_read_plus_write']:.1f} GB/s (read + write)"
        )
    for r in result.get("prefill", {}).get("rows", []):
        print(
            f"(2) prefill {r['tokens']:6d}: {r['ours']['tflops']:7.1f} vs torch {r['torch_sdpa']['tflops']:7.1f} "
            f"TFLOP/s = {r['ratio']:.2f}x"
        )
    for r in result.get("decode", {}).get("rows", []):
        print(
            f"(3) decode b={r['batch']:4d} ctx={r['context']:6d}: {r['split']['gbps']:8.1f} GB/s, "
            f"x{r['speedup']:.2f} over single-pass"
        )
    sweep = result.get("sweep", {})
    if sweep.get("prefill"):
        best = max(sweep["prefill"], key=lambda r: r["tflops"])
        print(
            f"(4) best prefill config at {sweep['prefill_tokens']}: {best['config']} {best['tflops']:.1f} TFLOP/s"
        )
        for b, c in {(r["batch"], r["context"]) for r in sweep["decode"]}:
            rows = [r for r in sweep["decode"] if (r["batch"], r["context"]) == (b, c)]
            best = max(rows, key=lambda r: r["gbps"])
            print(f"    best decode variant at b={b} ctx={c}: {best['variant']} {best['gbps']:.1f} GB/s")
    for key, t in result["targets"].items():
        extra = (
            f"; median {t['median']:.2f}, below at {', '.join(t['shapes_below'])}"
            if t.get("shapes_below")
            else ""
        )
        print(f"target {key}: {t['measured']:.2f} (>= {t['target']}) {'pass' if t['met'] else 'MISS'}{extra}")
    for key in ("correctness", "peers", "prefill", "decode", "sweep"):
        if "error" in result.get(key, {}):
            print(f"{key}: ERROR {result[key]['error']}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    pre = result.get("prefill", {}).get("rows", [])
    ax = axes[0]
    if pre:
        n = [r["tokens"] for r in pre]
        ax.plot(n, [r["ours"]["tflops"] for r in pre], "o-", label="flash-attention (paged)")
        ax.plot(n, [r["torch_sdpa"]["tflops"] for r in pre], "s-", label="torch SDPA flash")
        mm = result.get("peers", {}).get("matmul", {}).get("tflops")
        if mm:
            ax.axhline(mm, color="gray", ls="--", label=f"bf16 matmul {mm:.0f}")
        ax.set_xscale("log", base=2)
    ax.set(title="prefill, causal, GQA 8, d=128", xlabel="tokens", ylabel="TFLOP/s")
    ax.legend(fontsize=8)
    dec = result.get("decode", {}).get("rows", [])
    copy = result.get("peers", {}).get("copy", {}).get("gbps_read_plus_write")
    ax = axes[1]
    for b in sorted({r["batch"] for r in dec}):
        rows = [r for r in dec if r["batch"] == b]
        line = ax.plot(
            [r["context"] for r in rows], [r["split"]["gbps"] for r in rows], "o-", label=f"split, b={b}"
        )
        ax.plot(
            [r["context"] for r in rows],
            [r["single_pass"]["gbps"] for r in rows],
            ":",
            color=line[0].get_color(),
        )
    if copy:
        ax.axhline(copy, color="gray", ls="--", label=f"copy {copy:.0f}")
        ax.axhline(TARGETS["decode_vs_copy_bandwidth"] * copy, color="red", ls=":", lw=0.8, label="target")
    if dec:
        ax.set_xscale("log", base=2)
    ax.set(title="decode KV bandwidth (dotted: single-pass)", xlabel="context", ylabel="GB/s")
    ax.legend(fontsize=7)
    ax = axes[2]
    for b in sorted({r["batch"] for r in dec}):
        rows = [r for r in dec if r["batch"] == b]
        ax.plot([r["context"] for r in rows], [r["speedup"] for r in rows], "o-", label=f"b={b}")
    ax.axhline(1.0, color="gray", lw=0.8)
    if dec:
        ax.set_xscale("log", base=2)
    ax.set(title="split-KV speedup over single-pass", xlabel="context", ylabel="x")
    ax.legend(fontsize=8)
    when = result["date"] + (" (smoke)" if result["smoke"] else "")
    fig.suptitle(f"lmstack attention kernels on {result['machine'].get('gpu', 'cpu')} — {when}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _git() -> dict:
    def run(*cmd):
        try:
            return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "--porcelain"))}


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
