"""`lmstack plan --profile`: a short measured profile of this machine for a stack — prefill
tokens/s and the decode step time at several batch sizes, through the real engine with dummy
prompts — cached under ~/.cache/lmstack/plan/, and the step-time model fitted to it.

The cache key is the stack as resolved (components, options, dtypes, model), the model's
configuration, the processor (CPU model, or the GPU's name), the usable cores and torch's
version: a profile is only reused where all of them match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BATCHES = (1, 2, 4, 8, 16, 32)
PROFILE_VERSION = 1


@dataclass
class DecodePoint:
    batch: int
    step_s: float  # mean wall time of a decode-only engine step (median over rounds)
    tokens_per_step: float  # tokens each sequence gained per step (1 without speculation)


@dataclass
class Profile:
    key: str
    processor: str
    torch: str
    threads: int
    prompt_tokens: int  # the prompt length of the decode runs (their context)
    prefill_tokens: int
    prefill_tok_s: float
    decode: list[DecodePoint] = field(default_factory=list)
    measured_at: str = ""
    version: int = PROFILE_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        points = [DecodePoint(**p) for p in data["decode"]]
        return cls(**{**data, "decode": points})


# --- the machine and the cache ------------------------------------------------------------------


def processor_name(device: torch.device) -> str:
    """The GPU's name on cuda, else the CPU's model name."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def profile_key(prepared: Any) -> str:
    """What a profile depends on, hashed (see the module's docstring)."""
    from lmstack.content_hash import config_digest
    from lmstack.kernels.hardware import usable_cpus

    described = prepared.resolved.describe()
    described.pop("auto_reasons", None)  # says how much memory is free now: not the stack
    described.pop("server", None)  # HTTP settings do not change a step
    parts = {
        "stack": described,
        "model_config": config_digest(prepared.model_config),
        "processor": processor_name(prepared.resolved.device),
        "cpus": usable_cpus(),
        "torch": torch.__version__,
        "version": PROFILE_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "lmstack" / "plan"


def load_profile(key: str) -> Profile | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        profile = Profile.from_json(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or unreadable: measure again
    return profile if profile.key == key and profile.version == PROFILE_VERSION else None


def save_profile(profile: Profile) -> Path:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.key}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    return path


# --- measuring through the engine ---------------------------------------------------------------


def _prompts(vocab: int, count: int, length: int, rng: random.Random) -> list[list[int]]:
    """Distinct random prompts: a prefix cache must find nothing to reuse."""
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _drain(engine: Any, reqs: list[Any]) -> None:
    for req in reqs:
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()


def measure_prefill(engine: Any, length: int, repeats: int, rng: random.Random) -> float:
    """Median prompt tokens/s of one `length`-token prompt prefilled alone (after a warm-up)."""
    from lmstack.sampling_params import SamplingParams

    rates = []
    for i in range(repeats + 1):
        (prompt,) = _prompts(engine.model_config.vocab_size, 1, length, rng)
        req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.enqueue(req)
        while not req.seqs[0].output_token_ids:
            engine.step()
        elapsed = time.perf_counter() - start
        _drain(engine, [req])
        if i:  # the first run warms the kernels up
            rates.append(length / elapsed)
    return statistics.median(rates)


def measure_decode(
    engine: Any, batch: int, prompt_len: int, steps: int, warmup: int, rng: random.Random
) -> tuple[float, float]:
    """`batch` requests prefilled, then `warmup` decode steps untimed and `steps` timed: the mean
    step time (what throughput follows) and the tokens each sequence gained per step."""
    from lmstack.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 4, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    reqs = [engine.make_request(p, params) for p in _prompts(vocab, batch, prompt_len, rng)]
    for req in reqs:
        engine.enqueue(req)
    seqs = [req.seqs[0] for req in reqs]
    while any(s.num_computed_tokens < s.prompt_len for s in seqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    before = sum(s.num_output_tokens for s in seqs)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    gained = sum(s.num_output_tokens for s in seqs) - before
    _drain(engine, reqs)
    return elapsed / steps, gained / (steps * batch)


def run_profile(
    engine: Any,
    key: str,
    batches: list[int],
    *,
    prompt_len: int = 64,
    prefill_len: int = 512,
    steps: int = 16,
    warmup: int = 3,
    rounds: int = 5,
    progress: Any = None,
) -> Profile:
    """Measure `engine` (built from the stack `key` names) at each of `batches`: `rounds` rounds
    over all the batch sizes (a burst of other load spreads over them instead of hitting one),
    the median of each batch's round means."""
    from lmstack.kernels.hardware import usable_cpus

    rng = random.Random(0)
    limit = engine.max_model_len - 1
    prefill_len = max(1, min(prefill_len, engine.limits.max_num_batched_tokens, limit))
    prompt_len = max(1, min(prompt_len, limit - warmup - steps - 4))
    if progress:
        progress(f"prefill: {prefill_len}-token prompts")
    prefill = measure_prefill(engine, prefill_len, rounds, rng)
    runs: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for r in range(rounds):
        if progress:
            progress(f"decode: batch {', '.join(map(str, batches))} (round {r + 1} of {rounds})")
        for b in batches:
            runs[b].append(measure_decode(engine, b, prompt_len, steps, warmup, rng))
    points = [
        DecodePoint(b, statistics.median(t for t, _ in runs[b]), statistics.fmean(g for _, g in runs[b]))
        for b in batches
    ]
    return Profile(
        key=key,
        processor=processor_name(engine.stack.device),
        torch=torch.__version__,
        threads=torch.get_num_threads() if engine.stack.device.type == "cpu" else usable_cpus(),
        prompt_tokens=prompt_len,
        prefill_tokens=prefill_len,
        prefill_tok_s=prefill,
        decode=points,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def profile_batches(max_batch: int) -> list[int]:
    """The standard batch sizes up to `max_batch` (the scheduler's and the KV cache's limit),
    and `max_batch` itself: the largest batch the stack runs is measured, not extrapolated."""
    out = [b for b in BATCHES if b <= max_batch]
    if max_batch not in out:
        out.append(max_batch)
    return out


# --- the step-time model --------------------------------------------------------------------


@dataclass(frozen=True)
class StepModel:
    """t(B): piecewise linear through the measured (batch, step time) points; below the first
    point its time, beyond the last the last segment's slope carried on (a single point: flat).
    A decode step's time grows with the batch in steps (weights read once, more rows of work),
    which a single line a + b*B fits badly at small batches on a CPU."""

    points: tuple[tuple[int, float], ...]
    gains: tuple[tuple[int, float], ...]  # (batch, tokens a sequence gains per step)

    @classmethod
    def fit(cls, profile: Profile) -> StepModel:
        pts = sorted((p.batch, p.step_s) for p in profile.decode)
        tps = sorted((p.batch, p.tokens_per_step) for p in profile.decode)
        if not pts:
            raise ValueError("the profile has no decode points")
        return cls(tuple(pts), tuple(tps))

    def step_s(self, batch: float) -> float:
        pts = self.points
        if batch <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (batch - b1)

    def tokens_per_step(self, batch: float) -> float:
        """Tokens a sequence gains per step, from the nearest measured batch (1 without a speculator)."""
        nearest = min(self.gains, key=lambda p: abs(p[0] - batch))
        return max(nearest[1], 1e-9)

    def tpot_s(self, batch: float) -> float:
        """Time per output token of one sequence at `batch`."""
        return self.step_s(batch) / self.tokens_per_step(batch)

    def linear(self) -> tuple[float, float]:
        """Least-squares a + b*B over the points (printed as a summary)."""
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        if len(xs) < 2:
            return ys[0], 0.0
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return my - b * mx, b
