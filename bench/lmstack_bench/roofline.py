"""How close a server comes to this machine's limits: a short calibration of the machine's peaks
and the roofline figures a black-box HTTP benchmark can derive at one load point.

Calibration (`calibrate`), under the thread count the servers get:
- matmul GFLOP/s in fp32 and bf16: `torch.mm` of two square `size` x `size` matrices (2 n^3
  FLOPs a call), and int8 GOP/s with `torch._int_mm` where this torch runs it on the CPU;
- memory read bandwidth GB/s: `.sum()` over a `mem_mb` fp32 tensor (bigger than any L3 cache).
Each is one warm-up call and then up to `repeats` timed calls within its share of the time
budget; the peak is the **best** call (noise on a shared machine only ever slows a call), the
median is kept beside it.

Figures at one load point, from what the client sees (the run's `Summary`: token counts, wall
time, TTFT and ITL percentiles) and the model's shapes (`gguf_shapes`):
- P = the parameters used in matmuls: every weight of two or more dimensions except the token
  embedding (a lookup reads one row), plus the LM head, which is the token embedding again when
  the head is tied. P_head is the head's part, P_body the rest. One token through the model is
  2 P FLOPs; attention's own FLOPs (QK^T, PV; a few % at 200-token prompts) are left out, and so
  are norms, activations and rotary embeddings.
- matmul work of a load point = 2 P_body (prompt tokens + output tokens - requests)
  + 2 P_head output tokens: every prompt token and every output token but the last of a request
  passes the layers once; logits are computed at each sequence's last position only, as all the
  compared servers do in generation. Achieved GFLOP/s = that work / the load point's wall time
  (first request sent to last answer), for all the work the server did; at high concurrency
  most of it is batched decode.
- prefill GFLOP/s = one request's prefill work, 2 (P_body mean prompt tokens + P_head), / TTFT
  P50. At concurrency 1 TTFT is one prefill (plus the HTTP round trip and tokenization); at
  higher concurrency it also holds queueing behind the other sequences' steps, so the figure is
  a lower bound on the prefill's own rate there.
- decode weight bytes/s = the bytes of weights one decode step reads / ITL P50: a decode step
  reads every matmul weight once whatever the batch (KV-cache reads are left out), and the
  median gap between two tokens of a stream is the median step time. A model whose weights fit
  partly in the last-level cache can exceed the measured DRAM bandwidth (a fraction above 1).
- fractions: GFLOP/s over the calibrated matmul peak in the server's compute dtype (`fp32`,
  `bf16`, `int8` for int8-activation paths); a dtype the calibration did not measure (or
  `max`, when the path is not known) is compared against the highest measured peak, and the
  figure names which. Bytes/s over the calibrated memory bandwidth.

Torch is imported inside `calibrate` only, and `gguf` inside `gguf_shapes`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bytes one weight takes in each dense or quantized form a server may hold (scales excluded).
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class ModelShapes:
    """What the roofline figures need from a model: matmul parameters (body and LM head), their
    output rows (for per-row scales) and the file's bytes a decode step reads."""

    body_params: int
    head_params: int
    body_rows: int
    head_rows: int
    embedding_params: int
    tied: bool
    file_step_bytes: int  # every tensor of the file but the embedding lookup (once more if tied)

    @property
    def matmul_params(self) -> int:
        return self.body_params + self.head_params

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "matmul_params": self.matmul_params}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShapes:
        return cls(**{k: v for k, v in data.items() if k != "matmul_params"})


def gguf_shapes(path: str | Path) -> ModelShapes:
    """The matmul parameters of a GGUF model from its tensor shapes. A tensor of two or more
    dimensions is a matmul weight; a 3-D MoE expert tensor counts for the experts a token uses
    (`<arch>.expert_used_count` of `<arch>.expert_count`). No `output.weight`: the head is tied
    to `token_embd.weight`."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.parts[f.data[0]]

    arch_raw = field("general.architecture")
    arch = bytes(arch_raw).decode() if arch_raw is not None else ""
    used, experts = field(f"{arch}.expert_used_count"), field(f"{arch}.expert_count")
    share = int(used[0]) / int(experts[0]) if used is not None and experts is not None else 1.0
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    body = head = body_rows = head_rows = embedding = step_bytes = 0
    for t in reader.tensors:
        shape = [int(d) for d in t.shape]  # ggml order: shape[0] is the input dimension
        if t.name == "token_embd.weight":
            embedding = int(t.n_elements)
            if tied:
                head, head_rows, step_bytes = embedding, shape[1], step_bytes + int(t.n_bytes)
            continue
        step_bytes += int(t.n_bytes)
        if len(shape) < 2:
            continue
        if t.name == "output.weight":
            head, head_rows = int(t.n_elements), shape[1]
            continue
        part = share if len(shape) == 3 else 1.0
        body += round(int(t.n_elements) * part)
        body_rows += round(shape[1] * (shape[2] if len(shape) == 3 else 1) * part)
    if not head:
        raise ValueError(f"{path}: no token_embd.weight or output.weight, no LM head to count")
    return ModelShapes(body, head, body_rows, head_rows, embedding, tied, step_bytes)


def step_weight_bytes(shapes: ModelShapes, form: str) -> int:
    """Bytes of weights one decode step reads with the weights held as `form`: `file` (the GGUF's
    tensors as stored), `int8` (one byte a weight and an fp32 scale per output row), or a key of
    BYTES_PER_WEIGHT (other scales and the norms left out)."""
    if form == "file":
        return shapes.file_step_bytes
    if form == "int8":
        return shapes.matmul_params + 4 * (shapes.body_rows + shapes.head_rows)
    if form not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown weight form {form!r}")
    return round(shapes.matmul_params * BYTES_PER_WEIGHT[form])


def matmul_flops(shapes: ModelShapes, prompt_tokens: int, output_tokens: int, requests: int) -> float:
    """Matmul FLOPs of `requests` requests with these token totals (see the module's docstring)."""
    passes = prompt_tokens + output_tokens - requests
    return 2.0 * (shapes.body_params * passes + shapes.head_params * output_tokens)


def peak_for(calibration: dict[str, Any] | None, compute: str) -> tuple[str, float] | None:
    """(which peak, GFLOP/s) to compare a server computing in `compute` against: that dtype's
    measured peak, else the highest measured one; None without a calibration."""
    peaks = {k: v for k, v in ((calibration or {}).get("gflops") or {}).items() if v}
    if not peaks:
        return None
    if compute in peaks:
        return compute, float(peaks[compute])
    best = max(peaks, key=lambda k: peaks[k])
    return f"max={best}", float(peaks[best])


def point_figures(
    summary: Any, shapes: ModelShapes, compute: str, weight_bytes: int | None,
    calibration: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The roofline figures of one load point's `Summary` (None where the run lacks what a figure
    needs): achieved and prefill GFLOP/s, decode weight bytes/s, and their fractions of the
    calibrated peaks."""
    out: dict[str, Any] = {
        "gflops": None, "prefill_gflops": None, "decode_bytes_per_s": None,
        "peak": None, "gflops_fraction": None, "prefill_fraction": None, "decode_fraction": None,
    }  # fmt: skip
    n = summary.completed
    if n and summary.duration_s > 0:
        work = matmul_flops(shapes, summary.input_tokens, summary.output_tokens, n)
        out["gflops"] = work / summary.duration_s / 1e9
        if summary.ttft is not None and summary.ttft.median > 0:
            prefill = 2.0 * (shapes.body_params * summary.input_tokens / n + shapes.head_params)
            out["prefill_gflops"] = prefill / (summary.ttft.median / 1000.0) / 1e9
    if weight_bytes and summary.itl is not None and summary.itl.median > 0:
        out["decode_bytes_per_s"] = weight_bytes / (summary.itl.median / 1000.0)
    peak = peak_for(calibration, compute)
    if peak is not None:
        out["peak"] = peak[0]
        for key, frac in (("gflops", "gflops_fraction"), ("prefill_gflops", "prefill_fraction")):
            if out[key] is not None:
                out[frac] = out[key] / peak[1]
    bandwidth = (calibration or {}).get("memory_gb_s")
    if bandwidth and out["decode_bytes_per_s"] is not None:
        out["decode_fraction"] = out["decode_bytes_per_s"] / (bandwidth * 1e9)
    return out


def _timed(fn: Callable[[], Any], work: float, repeats: int, seconds: float) -> tuple[float, float]:
    """(best, median) rate of `work` units a second over one warm-up call and then up to
    `repeats` timed calls, fewer once `seconds` are spent (at least one)."""
    fn()  # the first call pays for allocation and kernel selection
    rates: list[float] = []
    stop = time.perf_counter() + seconds
    while len(rates) < repeats:
        t0 = time.perf_counter()
        fn()
        rates.append(work / (time.perf_counter() - t0))
        if time.perf_counter() > stop:
            break
    return max(rates), float(statistics.median(rates))


def memory_read_gb_s(mem_mb: int = 256, repeats: int = 5, seconds: float = 2.5) -> tuple[float, float]:
    """(best, median) GB/s of `.sum()` over `mem_mb` MiB of fp32 with torch's current thread count:
    a reduction reads at the memory system's streaming rate."""
    import torch

    x = torch.ones(mem_mb * (1 << 20) // 4, dtype=torch.float32)
    return _timed(lambda: x.sum(), x.numel() * 4 / 1e9, repeats, seconds)


def calibrate(
    threads: int, seconds_budget: float = 10.0, *, size: int = 2048, mem_mb: int = 256, repeats: int = 5
) -> dict[str, Any]:
    """This machine's measured peaks with `threads` torch threads (restored after): matmul GFLOP/s
    per dtype (`gflops`: fp32, bf16, int8; None where not measured, `skipped` says why) and memory
    read GB/s (`memory_gb_s`), best of the timed calls, medians beside them. Each of the four
    measurements gets a quarter of `seconds_budget`."""
    import torch

    share = seconds_budget / 4.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    best: dict[str, float | None] = {}
    median: dict[str, float | None] = {}
    skipped: dict[str, str] = {}
    try:
        gflop = 2.0 * size**3 / 1e9
        gen = torch.Generator().manual_seed(0)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(size, size, generator=gen).to(dtype)
            b = torch.randn(size, size, generator=gen).to(dtype)
            best[name], median[name] = _timed(lambda a=a, b=b: torch.mm(a, b), gflop, repeats, share)
        a8 = torch.randint(-128, 128, (size, size), dtype=torch.int8, generator=gen)
        b8 = torch.randint(-128, 128, (size, size), dtype=torch.int8, generator=gen)
        try:
            best["int8"], median["int8"] = _timed(lambda: torch._int_mm(a8, b8), gflop, repeats, share)
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            best["int8"] = median["int8"] = None
            skipped["int8"] = (
                f"torch._int_mm on the CPU: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            )
        mem_best, mem_median = memory_read_gb_s(mem_mb, repeats, share)
    finally:
        torch.set_num_threads(before)
    return {
        "method": (
            f"{threads} torch threads; matmul: torch.mm of two {size}x{size} matrices per dtype "
            f"(int8: torch._int_mm), 2 n^3 FLOPs a call; memory: .sum() over a {mem_mb} MiB fp32 "
            f"tensor; one warm-up and up to {repeats} timed calls each, peak = the best call"
        ),
        "threads": threads,
        "torch": str(torch.__version__),
        "gflops": best,
        "gflops_median": median,
        "memory_gb_s": mem_best,
        "memory_gb_s_median": mem_median,
        "skipped": skipped,
        "seconds": time.perf_counter() - t_start,
    }
