"""The GPU paths that CI cannot run, checked and timed on one CUDA device in one short run:
the quantizers' GPU kernels against references, the engine on CUDA against CPU and against
transformers, and the quantized linears' speed against a bf16 matmul.

    python benchmarks/gpu/gpu_check.py --out DIR            # on a CUDA machine (about two minutes)
    python benchmarks/gpu/gpu_check.py --smoke --out DIR    # CPU, Triton interpreter, tiny sizes:
                                                        # checks the script, measures nothing

(1) kernels: on fresh random shapes (odd ones included) and fp32 / fp16 / bf16 inputs,
    awq / rtn-int4's Triton W4A16 GEMM and nvfp4's Triton dequantizing GEMM against fp32
    products with the dequantized weight, fp8's `torch._scaled_mm` layer against its own W8A8
    emulation (the same rounding without an fp8 matmul). A case passes under the bound the CPU
    tests use (twice the plain layer's error in that dtype plus an epsilon; nvfp4: its test's
    tolerance).
(2) engine: a tiny random Llama (head dim 64, GQA 2) served on the device, teacher-forced
    log-probabilities of four prompts and 24 greedy tokens each, compared with: transformers on
    the device (torch attention, fp32), the torch attention backend (flash-attention +
    flash-decoding, fp32 and bf16, and with an fp8_e4m3 KV cache), the CPU engine with the same
    quantizer (rtn-int4 / nvfp4 in fp32; fp8's scaled_mm against its emulation on the device),
    and plain decoding (ngram speculation: greedy text identical).
(3) timing (CUDA only): y = x W^T for Llama-3-8B's layer shapes (4096x4096, 2x14336x4096 fused
    gate/up, 4096x14336) at M = 1, 16, 128, 1024 rows: bf16 `F.linear`, the W4A16 layer (group
    128), the fp8 layer (per-token activation scales + `_scaled_mm`), the nvfp4 GEMM; the median
    of `triton.testing.do_bench` (L2 flushed between calls), and the weight bytes each streams.

Writes DIR/gpu_check.json and prints a summary; each section's failure is recorded, not fatal.
Imports lmstack and the plugins from this checkout when they are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "float16", "bfloat16")
# Llama-3-8B: hidden 4096, intermediate 14336 (gate and up fused).
TIMED_SHAPES = ((4096, 4096), (28672, 4096), (4096, 14336))
TIMED_ROWS = (1, 16, 128, 1024)
PROMPTS = (
    "the cat sat on the mat",
    "in the beginning there was the word, and the word was in the beginning",
    "one two one two one two one two one two one two",
    "abcabcabcabcabcabcabc",
)


def rel_error(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))


# --- (1) kernels --------------------------------------------------------------------------------


def check_kernels(torch, dev, interpret: bool, trials: int) -> list[dict[str, Any]]:
    from lmstack.interfaces import LinearSpec
    from lmstack_awq.int4_math import Int4Scheme, quantize_int4
    from lmstack_awq.kernels.triton_w4a16 import w4a16_matmul
    from lmstack_awq.linear import Int4Linear
    from lmstack_fp8.linear import Fp8Linear
    from lmstack_fp8.scheme import Fp8Scheme
    from lmstack_nvfp4 import nvfp4
    from lmstack_nvfp4.kernel import nvfp4_matmul

    rng = random.Random()
    rows: list[dict[str, Any]] = []

    def record(kernel, dtype, shape, err, bound) -> None:
        rows.append(
            {
                "kernel": kernel,
                "dtype": dtype,
                "shape": shape,
                "rel_error": err,
                "bound": bound,
                "ok": err <= bound,
            }
        )

    big = 4 if interpret else 1024
    for trial in range(trials):
        # The first trial is SmolLM2's MLP shape (576 = 4.5 groups of 128); the rest fresh and odd.
        if trial == 0:
            m, n, k = 1, 64 if interpret else 1536, 576
        else:
            m = rng.choice((1, rng.randint(2, 40), rng.randint(41, big + 41)))
            n, k = rng.randint(1, 300), rng.randint(1, 700)
        for name in DTYPES:
            dt = getattr(torch, name)
            x = torch.randn(m, k, device=dev)
            # W4A16 through the layer the quantizer builds (its loader quantizes on the device).
            group = rng.choice((32, 64, 128))
            w = torch.randn(n, k, device=dev) * k**-0.5
            scheme = Int4Scheme(group, rng.random() < 0.5)
            with torch.device(dev):
                layer = Int4Linear(LinearSpec(k, n, False, "kit"), scheme, "dense")
            layer.weight.weight_loader(layer.weight, w, None)
            deq = quantize_int4(w, scheme).dequantize().to(dev)
            out = w4a16_matmul(
                x.to(dt), layer.w_packed, layer.w_scales, layer.w_zeros, k, group, interpret=interpret
            )
            ref = x.double() @ deq.double().t()
            plain = (x.to(dt) @ deq.to(dt).t()).double()
            bound = 2 * rel_error(plain, ref) + torch.finfo(dt).eps + 1e-6
            record("w4a16", name, [m, n, k, group], rel_error(out, ref), bound)
            # NVFP4 (16-element groups of e2m1 with e4m3 scales).
            packed, scale, gs = nvfp4.quantize(w)
            factor = (1.0 / gs).expand(n)
            deq = nvfp4.dequantize(packed, scale, factor, k)
            out = nvfp4_matmul(x.to(dt), packed, scale, factor, interpret=interpret)
            ref = x.double() @ deq.double().t()
            plain = (x.to(dt) @ deq.to(dt).t()).double()
            bound = 2 * rel_error(plain, ref) + torch.finfo(dt).eps + 1e-6
            record("nvfp4", name, [m, n, k], rel_error(out, ref), bound)
        # FP8 scaled_mm (its sizes in multiples of 16) against the W8A8 emulation, bf16 / fp16.
        if not interpret:
            n16, k16 = 16 * rng.randint(1, 40), 16 * rng.randint(1, 60)
            w = torch.randn(n16, k16, device=dev) * k16**-0.5
            x = torch.randn(m, k16, device=dev)
            layers = {}
            for kernel in ("scaled_mm", "emulate"):
                with torch.device(dev):
                    layers[kernel] = Fp8Linear(LinearSpec(k16, n16, False, "kit"), Fp8Scheme(), False, kernel)
                layers[kernel].weight.weight_loader(layers[kernel].weight, w, None)
            for name in ("bfloat16", "float16", "float32"):
                dt = getattr(torch, name)
                xd = x.to(dt)
                out, ref = layers["scaled_mm"](xd), layers["emulate"](xd.float())
                # Both round the same x and W to e4m3 identically; what differs is the product's
                # accumulation and the bf16 result: a few bf16 steps.
                record("fp8_scaled_mm", name, [m, n16, k16], rel_error(out, ref), 4 * 2**-8)
    return rows


# --- (2) engine -----------------------------------------------------------------------------------


def _llm(stack: dict[str, Any]):
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    return LLM(stack, plugin_manager=make_plugin_manager())


def _run(stack: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Teacher-forced prompt log-probabilities and greedy tokens for PROMPTS."""
    from lmstack.sampling_params import SamplingParams

    llm = _llm(stack)
    try:
        forced = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        greedy = llm.generate(
            list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    finally:
        llm.engine.shutdown()
    logprobs = []
    for o in forced:
        for entry in o.prompt_logprobs[1:]:
            ((_, lp),) = entry.items()
            logprobs.append(float(getattr(lp, "logprob", lp)))
    return {"logprobs": logprobs, "tokens": [list(o.outputs[0].token_ids) for o in greedy]}


def _compare(name: str, a: dict[str, Any], b: dict[str, Any], tol: float, same_text: bool) -> dict[str, Any]:
    diff = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    same = a["tokens"] == b["tokens"]
    # Greedy text after a token where the two disagree is not comparable: count matching prefixes.
    prefix = [
        next((i for i, (p, q) in enumerate(zip(s, t, strict=True)) if p != q), len(s))
        for s, t in zip(a["tokens"], b["tokens"], strict=True)
    ]
    ok = diff <= tol and (same or not same_text)
    return {
        "check": name,
        "max_logprob_diff": diff,
        "tol": tol,
        "greedy_identical": same,
        "greedy_matching_prefix": prefix,
        "ok": ok,
    }


def _against_fp32(name: str, a: dict[str, Any], b: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    def err(x: dict[str, Any]) -> float:
        return sum(abs(p - q) for p, q in zip(x["logprobs"], ref["logprobs"], strict=True)) / len(
            ref["logprobs"]
        )

    ea, eb = err(a), err(b)
    row = _compare(name, a, b, float("inf"), False)
    row.update({"mean_error_vs_fp32": ea, "reference_mean_error_vs_fp32": eb, "ok": ea <= 2 * eb + 1e-3})
    return row


def _hf_logprobs(torch, model_path: Path, dev) -> list[float]:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p).ids], device=dev)
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out += [float(lp[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]
    return out


def check_engine(torch, dev: str, interpret: bool, max_tokens: int) -> list[dict[str, Any]]:
    import tempfile

    from lmstack.testing.tiny_model import write_tiny_model

    folder = write_tiny_model(
        Path(tempfile.mkdtemp()) / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    base = {
        "model": str(folder),
        "dtype": "float32",
        "device": dev,
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 256},
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256},
    }
    flash = {
        "prefill": {"name": "flash-attention", "interpret": interpret},
        "decode": {"name": "flash-decoding", "interpret": interpret},
    }
    torch_attn = {"prefill": "torch", "decode": "torch"}
    results: list[dict[str, Any]] = []

    def attempt(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            row = fn()
        except Exception:
            row = {"check": name, "ok": False, "error": traceback.format_exc(limit=6)}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        print(f"  engine: {name}: {'ok' if row['ok'] else 'FAIL'} ({row['seconds']} s)", flush=True)

    cache: dict[str, dict[str, Any]] = {}

    def run(key: str, **sections: Any) -> dict[str, Any]:
        if key not in cache:
            cache[key] = _run({**base, **sections}, max_tokens)
        return cache[key]

    def vs_transformers() -> dict[str, Any]:
        ours = run("torch32", attention=torch_attn)
        theirs = {"logprobs": _hf_logprobs(torch, folder, dev), "tokens": ours["tokens"]}
        return _compare("torch attention fp32 vs transformers", ours, theirs, 1e-3, True)

    attempt("torch attention fp32 vs transformers", vs_transformers)
    attempt(
        "flash fp32 vs torch fp32",
        lambda: _compare(
            "flash fp32 vs torch fp32",
            run("flash32", attention=flash),
            run("torch32", attention=torch_attn),
            1e-3,
            True,
        ),
    )
    if dev != "cpu":
        attempt(
            "torch fp32 cuda vs cpu",
            lambda: _compare(
                "torch fp32 cuda vs cpu",
                run("torch32", attention=torch_attn),
                _run({**base, "device": "cpu", "attention": torch_attn}, max_tokens),
                1e-3,
                True,
            ),
        )

    # Below fp32 (and with lossy formats) the two paths round differently: each is compared with
    # the fp32 unquantized model, and the path under test may err at most twice the reference
    # path's mean |logprob error| (plus 1e-3).
    def pair(
        name: str, key: str, sections: dict[str, Any], ref_key: str, ref_sections: dict[str, Any]
    ) -> None:
        attempt(
            name,
            lambda: _against_fp32(
                name, run(key, **sections), run(ref_key, **ref_sections), run("torch32", attention=torch_attn)
            ),
        )

    pair(
        "flash bf16 vs torch bf16",
        "flash16",
        {"attention": flash, "dtype": "bfloat16"},
        "torch16",
        {"attention": torch_attn, "dtype": "bfloat16"},
    )
    kv = {"weights": "none", "kv_cache": "fp8_e4m3"}
    pair(
        "flash + fp8 KV vs torch + fp8 KV (bf16)",
        "flashkv",
        {"attention": flash, "dtype": "bfloat16", "quant": kv},
        "torchkv",
        {"attention": torch_attn, "dtype": "bfloat16", "quant": kv},
    )
    cpu = {**base, "device": "cpu", "attention": torch_attn}
    exact = {"weights": "rtn-int4", "fp32_activations": "exact"}
    attempt(
        "rtn-int4 fp32: device vs cpu (exact)",
        lambda: _compare(
            "rtn-int4 fp32: device vs cpu (exact)",
            run("int4", attention=torch_attn, quant=exact),
            _run({**cpu, "quant": exact}, max_tokens),
            1e-3,
            False,
        ),
    )
    attempt(
        "nvfp4 fp32: device vs cpu",
        lambda: _compare(
            "nvfp4 fp32: device vs cpu",
            run("nvfp4", attention=torch_attn, quant={"weights": "nvfp4"}),
            _run({**cpu, "quant": {"weights": "nvfp4"}}, max_tokens),
            1e-3,
            False,
        ),
    )
    if dev != "cpu":
        pair(
            "fp8 bf16: scaled_mm vs emulation",
            "fp8mm",
            {"attention": flash, "dtype": "bfloat16", "quant": {"weights": "fp8", "kernel": "scaled_mm"}},
            "fp8em",
            {"attention": flash, "dtype": "bfloat16", "quant": {"weights": "fp8", "kernel": "emulate"}},
        )
    attempt(
        "ngram greedy identical (flash, fp32)",
        lambda: _compare(
            "ngram greedy identical (flash, fp32)",
            run("ngram", attention=flash, speculator={"name": "ngram", "num_draft_tokens": 4}),
            run("flash32", attention=flash),
            1e-3,
            True,
        ),
    )
    return results


# --- (3) timing ------------------------------------------------------------------------------------


def time_linears(torch, dev, shapes, row_counts, interpret: bool) -> list[dict[str, Any]]:
    import statistics

    import torch.nn.functional as F
    import triton.testing

    from lmstack.interfaces import LinearSpec
    from lmstack_awq.int4_math import Int4Scheme
    from lmstack_awq.linear import Int4Linear
    from lmstack_fp8.linear import Fp8Linear
    from lmstack_fp8.scheme import Fp8Scheme
    from lmstack_nvfp4 import nvfp4
    from lmstack_nvfp4.kernel import nvfp4_matmul

    rows: list[dict[str, Any]] = []

    def bench(fn) -> float:
        if dev == "cuda":
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    for n, k in shapes:
        w = torch.randn(n, k, device=dev) * k**-0.5
        wb = w.bfloat16()
        spec = LinearSpec(k, n, False, "timed", params_dtype=torch.bfloat16)
        with torch.device(dev):
            int4 = Int4Linear(spec, Int4Scheme(128, False), "dense")
            fp8 = Fp8Linear(spec, Fp8Scheme(), False, "emulate" if interpret else "scaled_mm")
        int4.weight.weight_loader(int4.weight, w, None)
        fp8.weight.weight_loader(fp8.weight, w, None)
        packed, scale, gs = nvfp4.quantize(w)
        factor = (1.0 / gs).expand(n).contiguous()
        weight_bytes = {
            "bf16": 2 * n * k,
            "w4a16": sum(t.numel() * t.element_size() for t in (int4.w_packed, int4.w_scales, int4.w_zeros)),
            "fp8": n * k + 4 * n,
            "nvfp4": packed.numel() + scale.numel() + 4 * n,
        }
        for m in row_counts:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            calls = {
                "bf16": lambda x=x, wb=wb: F.linear(x, wb),
                "w4a16": lambda x=x, layer=int4: layer(x),
                "fp8": lambda x=x, layer=fp8: layer(x),
                "nvfp4": lambda x=x, p=packed, s=scale, f=factor: nvfp4_matmul(x, p, s, f, interpret),
            }
            ms = {kernel: bench(call) for kernel, call in calls.items()}
            for kernel, t in ms.items():
                rows.append(
                    {
                        "shape": [n, k],
                        "rows": m,
                        "kernel": kernel,
                        "ms": t,
                        "weight_GBps": weight_bytes[kernel] / t / 1e6,
                        "tflops": 2 * m * n * k / t / 1e9,
                        "speedup_vs_bf16": ms["bf16"] / t,
                    }
                )
            print(
                f"  timing {n}x{k} M={m}: "
                + ", ".join(f"{kn} {t * 1000:.1f} us ({ms['bf16'] / t:.2f}x)" for kn, t in ms.items()),
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    p.add_argument("--out", required=True, help="folder for gpu_check.json")
    p.add_argument("--sections", default="kernels,engine,timing", help="which of kernels, engine, timing")
    p.add_argument("--trials", type=int, help="random shapes per kernel (default 12; smoke 2)")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run it on a GPU machine, or with --smoke", file=sys.stderr)
        return 2
    dev = "cpu" if args.smoke else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    from lmstack.kernels.hardware import cpu_description

    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        **cpu_description(),  # the host's, where the engine's CPU comparisons run
    }
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["sms"], result["capability"] = (
            props.multi_processor_count,
            list(torch.cuda.get_device_capability()),
        )
    path = out / "gpu_check.json"

    def section(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            result[name] = fn()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
            print(result[name]["error"], flush=True)
        result[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(result, indent=1))

    trials = args.trials or (2 if args.smoke else 12)
    wanted = set(args.sections.split(","))
    if "kernels" in wanted:
        section("kernels", lambda: check_kernels(torch, dev, args.smoke, trials))
    if "engine" in wanted:
        section("engine", lambda: check_engine(torch, dev, args.smoke, 6 if args.smoke else 24))
    if "timing" not in wanted:
        pass
    elif args.smoke:
        section("timing", lambda: time_linears(torch, dev, ((48, 96),), (1, 5), True))
    else:
        section("timing", lambda: time_linears(torch, dev, TIMED_SHAPES, TIMED_ROWS, False))

    print("\nsummary")
    kernels = result.get("kernels")
    if isinstance(kernels, list):
        for kernel in sorted({r["kernel"] for r in kernels}):
            mine = [r for r in kernels if r["kernel"] == kernel]
            bad = [r for r in mine if not r["ok"]]
            worst = max(mine, key=lambda r: r["rel_error"] / r["bound"])
            print(
                f"  {kernel}: {len(mine) - len(bad)}/{len(mine)} within bound; worst {worst['rel_error']:.2e} "
                f"(bound {worst['bound']:.2e}, {worst['dtype']} {worst['shape']})"
            )
    engine = result.get("engine")
    if isinstance(engine, list):
        for r in engine:
            if "error" in r:
                detail = r["error"].strip().splitlines()[-1:]
            elif "mean_error_vs_fp32" in r:
                detail = [
                    f"mean |dlogprob| vs fp32 {r['mean_error_vs_fp32']:.2e} (reference path "
                    f"{r['reference_mean_error_vs_fp32']:.2e}), greedy identical {r['greedy_identical']}"
                ]
            else:
                detail = [
                    f"max |dlogprob| {r['max_logprob_diff']:.2e} (tol {r['tol']}), "
                    f"greedy identical {r['greedy_identical']}"
                ]
            print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {detail[0] if detail else ''}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
