"""torch.compile per region of the reference decoder layer vs eager, at SmolLM2-135M sizes (fp32,
random weights, one thread): each region's compile time per token count as it first meets it
(1, then 32, 7, 13: dynamic-shape recompiles), graphs compiled, and eager vs compiled time per
call at T = 1 and 32 (interleaved; medians). The attention kernel itself is left out (its
paged-cache Python breaks graphs): "layer" = the regions before and after it.

    OMP_NUM_THREADS=1 python benchmarks/compile_regions.py out.json
"""

import json
import statistics
import sys
import time

import torch
import torch._dynamo.utils as du

from lmstack.hardware import cpu_description
from lmstack.interfaces import LinearSpec
from lmstack.model.linear import default_linear
from lmstack.model.llama import RMSNorm, silu_mul
from lmstack.model.rope import RotaryEmbedding, rotate_

torch.set_num_threads(1)
H, NH, NKV, D, INTER = 576, 9, 3, 64, 1536
dtype = torch.float32
g = torch.Generator().manual_seed(0)
norm = RMSNorm(H, 1e-5, dtype)
norm.weight.data = 1 + 0.1 * torch.randn(H, generator=g)
rope = RotaryEmbedding(D, 2048, 10000.0, None)


def lin(i, o):
    m = default_linear(LinearSpec(i, o, False, "x", (o,), "column", dtype))
    m.weight.data = torch.randn(o, i, generator=g) * 0.02
    return m


qkv_proj, o_proj = lin(H, (NH + 2 * NKV) * D), lin(NH * D, H)
gate_up, down = lin(H, 2 * INTER), lin(INTER, H)
norm2 = RMSNorm(H, 1e-5, dtype)
norm2.weight.data = norm.weight.data.clone()


def r_norm(x, res):
    return norm(x.clone(), res)


def r_silu(gu):
    return silu_mul(gu.clone())


def r_rope(qkv, cos, sin):
    t = qkv.shape[0]
    q = qkv.clone()
    rotate_(q[:, : (NH + NKV) * D].view(t, -1, D), cos, sin)
    return q


def pre_attn(x, cos, sin):  # norm + qkv + rotary
    t = x.shape[0]
    qkv = qkv_proj(norm(x))
    rotate_(qkv[:, : (NH + NKV) * D].view(t, -1, D), cos, sin)
    return qkv


def post_attn(o, x):  # o_proj + residual + norm + mlp + residual
    h, x = norm2(o_proj(o), x)
    return x + down(silu_mul(gate_up(h)))


def inputs(name, t):
    pos = torch.arange(100, 100 + t)
    cos, sin = rope.tables_full(pos, dtype)
    x = torch.randn(t, H, generator=g)
    return {
        "rmsnorm+residual": (x, torch.randn(t, H, generator=g)),
        "silu_mul": (torch.randn(t, 2 * INTER, generator=g),),
        "rotary": (torch.randn(t, (NH + 2 * NKV) * D, generator=g), cos, sin),
        "layer_pre_attention": (x, cos, sin),
        "layer_post_attention": (torch.randn(t, NH * D, generator=g), x),
    }[name]


FNS = {
    "rmsnorm+residual": r_norm,
    "silu_mul": r_silu,
    "rotary": r_rope,
    "layer_pre_attention": pre_attn,
    "layer_post_attention": post_attn,
}


def timeit(fn, args, n):
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return ts


out = {}
with torch.inference_mode():
    for name, fn in FNS.items():
        torch._dynamo.reset()
        comp = torch.compile(fn, dynamic=None)
        row = {}
        # warm-up / compile cost at T=1, then T=32, then other sizes (recompiles, dynamic shapes)

        for t in (1, 32, 7, 13, 1):
            a = inputs(name, t)
            t0 = time.perf_counter()
            comp(*a)
            first = time.perf_counter() - t0
            row.setdefault("first_call_s", []).append([t, round(first, 2)])
        frames = du.counters["stats"]["unique_graphs"]
        row["graphs_compiled"] = frames
        for t in (1, 32):
            a = inputs(name, t)
            n = 400 if t == 1 else 100
            e, c = [], []
            for _ in range(3):  # interleaved
                e += timeit(fn, a, n)
                c += timeit(comp, a, n)
            row[f"eager_us_T{t}"] = round(statistics.median(e), 1)
            row[f"compiled_us_T{t}"] = round(statistics.median(c), 1)
            row[f"compiled/eager_T{t}"] = round(statistics.median(c) / statistics.median(e), 3)
        out[name] = row
        print(name, json.dumps(row), flush=True)
json.dump({"machine": cpu_description(), **out}, open(sys.argv[1], "w"), indent=1)
