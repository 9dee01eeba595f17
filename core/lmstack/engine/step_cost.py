"""What a step costs: t(T) = a + b * T seconds for T query tokens, measured as the engine runs.

Two decisions are made against it each step: how many draft tokens are worth verifying
(`lmstack.spec.draft_policy`) and how large a prefill chunk may ride along with running decodes
before it stalls them (the `continuous` scheduler's step-time target). Both need only the
fixed cost of a step (a: reading the weights, launching ops) and the marginal cost of one more
query token (b).

The engine records every step's query tokens and wall time (`StepCostModel.record`). Steps are
grouped into power-of-two buckets of T, each keeping a running mean; the line is fitted by least
squares over the bucket means, so every size counts once however often it runs, and a size the
engine stopped visiting is still remembered. A bucket's first step is a warm-up (kernels,
caches) and is replaced by its second. Until two sizes are measured nothing is known (`fit`
returns None).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

STEP_EMA = 0.2  # weight of a new step time in its bucket's mean


@dataclass
class _Bucket:
    tokens: float
    seconds: float
    samples: int = 1


@dataclass
class StepCostModel:
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    # False: the local lines through the raw bucket means, a falling one clamped flat at its low
    # end (as before 2026-12-05; `benchmarks/e2e/eagle.py --compare-old-pricing`).
    monotone: bool = True

    def record(self, num_tokens: int, seconds: float) -> None:
        """One step ran `num_tokens` query tokens in `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        key = int(math.log2(num_tokens))
        b = self._buckets.get(key)
        if b is None:
            self._buckets[key] = _Bucket(float(num_tokens), seconds)
        elif b.samples == 1:  # the first step of a size warms up (kernels, caches): replace it
            self._buckets[key] = _Bucket(float(num_tokens), seconds, 2)
        else:
            b.tokens += STEP_EMA * (num_tokens - b.tokens)
            b.seconds += STEP_EMA * (seconds - b.seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t(T) = a + b * T, or None until two sizes of step were measured past their
        warm-up. b >= 0 and a > 0 (noise never makes a token free of cost or a step negative)."""
        pts = [p for p in self._buckets.values() if p.samples > 1]
        if len(pts) < 2:
            return None
        n = len(pts)
        mx = sum(p.tokens for p in pts) / n
        my = sum(p.seconds for p in pts) / n
        sxx = sum((p.tokens - mx) ** 2 for p in pts)
        b = sum((p.tokens - mx) * (p.seconds - my) for p in pts) / sxx if sxx > 0 else 0.0
        b = max(b, 0.0)
        a = max(my - b * mx, 1e-6)
        return a, b

    def _measured(self) -> list[_Bucket]:
        """The sizes measured past their warm-up, smallest first, their times made non-decreasing
        (`_monotone`)."""
        pts = sorted((p for p in self._buckets.values() if p.samples > 1), key=lambda p: p.tokens)
        return _monotone(pts) if self.monotone else pts

    @staticmethod
    def _line(pts: list[_Bucket], xs: list[float], num_tokens: float) -> tuple[float, float]:
        """(a, b) through the two measured sizes around `num_tokens` (the nearest below and
        above it; at either end of the range, the two nearest); b >= 0, a > 0. The sizes are
        distinct: each bucket's mean lies in its own power-of-two range."""
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(pts) - 1)
        lo, hi = pts[i - 1], pts[i]
        b = max((hi.seconds - lo.seconds) / (hi.tokens - lo.tokens), 0.0)
        return max(lo.seconds - b * lo.tokens, 1e-6), b

    def fit_near(self, num_tokens: float) -> tuple[float, float] | None:
        """(a, b) of the line through the two measured sizes around `num_tokens` (the nearest
        below and above it; at either end of the measured range, the two nearest): the cost of
        one more token where the step is, which the global line averages over very different
        regimes (a memory-bound step of 2 tokens and a compute-bound one of 160). None until two
        sizes were measured past their warm-up; b >= 0, a > 0 as in `fit`."""
        pts = self._measured()
        if len(pts) < 2:
            return None
        return self._line(pts, [p.tokens for p in pts], num_tokens)

    def seconds_from(self, num_tokens: int, count: int) -> list[float] | None:
        """[t(num_tokens), t(num_tokens + 1), ..., t(num_tokens + count - 1)], each as `fit_near`
        prices it, one segment at a time (the draft policy prices every prefix of a step's
        draft slots: 128 sizes a step at 32 streams, where one bisection each cost ~0.1 ms).
        None until two sizes were measured."""
        pts = self._measured()
        if len(pts) < 2:
            return None
        xs = [p.tokens for p in pts]
        out: list[float] = []
        x, stop = num_tokens, num_tokens + count
        while x < stop:
            # `_line` takes the segment ending at the first measured size >= x (the top one
            # past the range): the same line for every size up to that end.
            i = bisect.bisect_left(xs, x)
            end = stop if i >= len(pts) - 1 else min(stop, math.floor(xs[max(i, 1)]) + 1)  # > x
            a, b = self._line(pts, xs, x)
            out += [a + b * t for t in range(x, end)]
            x = end
        return out

    def first_seconds(self) -> float | None:
        """The one step time known before `fit` can answer (None if nothing ran)."""
        for p in self._buckets.values():
            return p.seconds
        return None

    def predict(self, num_tokens: int) -> float | None:
        """Seconds for a step of `num_tokens` query tokens (None until the fit is known)."""
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most query tokens a step can run within `seconds` (None: unknown or unbounded,
        i.e. no fit yet or tokens measured free)."""
        ab = self.fit()
        if ab is None or ab[1] <= 0:
            return None
        a, b = ab
        return max(0, int((seconds - a) / b))


def _monotone(pts: list[_Bucket]) -> list[_Bucket]:
    """The bucket means (sorted by tokens) with their times made non-decreasing in tokens:
    where a larger size measured faster than a smaller one (noise, or a size last measured while
    the machine was busier), the run of sizes that disagree takes their mean time (isotonic
    regression, pooling adjacent violators). A step of more tokens never costs less, and the
    line through two such sizes is flat, not clamped at one end: clamped, t(T) jumped down past
    a size and a draft row at 32 streams priced below nothing (drafted there at a loss)."""
    blocks: list[tuple[float, int]] = []  # (sum of seconds, sizes) per pooled run
    for p in pts:
        total, count = p.seconds, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            before, n = blocks.pop()
            total, count = total + before, count + n
        blocks.append((total, count))
    means = [total / count for total, count in blocks for _ in range(count)]
    return [_Bucket(p.tokens, mean, p.samples) for p, mean in zip(pts, means, strict=True)]
