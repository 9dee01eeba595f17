"""The search of `lmstack tune`: which stacks to try, in which order, and which one wins.

Pure logic, no servers: a stack is a mapping (a stack file's contents), a candidate is that
mapping with some keys set (`lmstack.stack.overrides.apply_overrides`, as `--set` does), and
measuring one is a function the caller passes in (`lmstack_bench.tune` starts a server and runs
the benchmark; tests pass a fake).

The search is coordinate descent from the given stack: one knob at a time, the others held at
the best values found so far. An ordered knob (max_num_seqs, ...) is walked from its current
value one rung at a time in one direction while each step wins, then the other direction if the
first step lost; a categorical knob (the quantizer, the KV dtype, speculation) tries each value.
Knobs come most promising first, so a budget that ends early has spent itself where it pays
most. Passes repeat while a pass improved something and the budget lasts.

Winning: more goodput at the SLO. Goodputs within `tie` of each other (relative) are a tie, on a
machine whose runs differ by a few per cent from noise alone; a tie goes to more output tok/s
(beyond the same margin; a tie on both keeps the incumbent, the stack the candidate would change).
A candidate that could not be measured (rejected by `lmstack check`, failed to start, every
request failed) never wins and is kept as one line of the record. At the end a rematch measures
the winner and the start stack once more and decides on the means (`search`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmstack.stack.overrides import apply_overrides


class CandidateFailed(Exception):
    """A candidate could not be measured; the message is its one line in the record."""


@dataclass(frozen=True)
class Knob:
    """One dimension of the search: a dotted stack key (`scheduler.max_num_seqs`) and the values
    to try. `ordered`: the values are a ladder (tried as neighbours of the current one);
    otherwise each is tried. `current`: the value the start stack has (resolved defaults too)."""

    path: str
    values: tuple[Any, ...]
    current: Any
    ordered: bool = False

    def __post_init__(self) -> None:
        if self.current not in self.values:
            raise ValueError(f"{self.path}: the current value {self.current!r} is not among {self.values}")


@dataclass(frozen=True)
class Measurement:
    """What one measured candidate achieved."""

    goodput: float  # requests / s meeting every SLO
    output_throughput: float  # output tokens / s of successful requests
    details: dict[str, Any] = field(default_factory=dict)  # latency percentiles, counts, ...


@dataclass
class Trial:
    """One candidate: the keys it sets over the start stack, and its measurement or error."""

    index: int
    changes: dict[str, Any]
    stack: dict[str, Any]
    measurement: Measurement | None = None  # the mean of `runs`
    error: str | None = None
    seconds: float = 0.0
    runs: list[Measurement] = field(default_factory=list)  # one, or two after the rematch

    def add_run(self, m: Measurement) -> None:
        self.runs.append(m)
        n = len(self.runs)
        self.measurement = Measurement(
            goodput=sum(r.goodput for r in self.runs) / n,
            output_throughput=sum(r.output_throughput for r in self.runs) / n,
            details={**m.details, "runs": [[r.goodput, r.output_throughput] for r in self.runs]}
            if n > 1
            else m.details,
        )

    @property
    def ok(self) -> bool:
        return self.measurement is not None

    @property
    def label(self) -> str:
        if not self.changes:
            return "start stack"
        return ", ".join(f"{k}={_short(v)}" for k, v in self.changes.items())

    def line(self) -> str:
        """The candidate as one line of the record."""
        if self.measurement is None:
            return f"{self.label}: {self.error}"
        m = self.measurement
        runs = f" (mean of {len(self.runs)} runs)" if len(self.runs) > 1 else ""
        return f"{self.label}: goodput {m.goodput:.3f} req/s, {m.output_throughput:.1f} output tok/s{runs}"

    def to_json(self) -> dict[str, Any]:
        m = self.measurement
        return {
            "index": self.index,
            "label": self.label,
            "changes": self.changes,
            "goodput": None if m is None else m.goodput,
            "output_throughput": None if m is None else m.output_throughput,
            "details": None if m is None else m.details,
            "error": self.error,
            "seconds": round(self.seconds, 1),
            "runs": [[r.goodput, r.output_throughput] for r in self.runs],
        }


def beats(a: Trial, b: Trial | None, tie: float = 0.03) -> bool:
    """Whether `a` is better than `b`: measured where `b` is not; else more goodput beyond a
    relative `tie`; within it, more output tok/s beyond the same margin. Within both, `a` is
    not better: a change must show itself above the noise to replace what it would change."""
    if a.measurement is None:
        return False
    if b is None or b.measurement is None:
        return True
    for key in ("goodput", "output_throughput"):
        x, y = getattr(a.measurement, key), getattr(b.measurement, key)
        if abs(x - y) > tie * max(x, y):
            return x > y
    return False


@dataclass
class SearchResult:
    trials: list[Trial]
    best: Trial | None  # None: no candidate could be measured
    stopped: str  # why the search ended, one line


Measure = Callable[[dict[str, Any], float], Measurement]
"""measure(stack, deadline) -> Measurement: runs the candidate and returns by `deadline` (a
`clock()` time), or raises CandidateFailed."""
Validate = Callable[[dict[str, Any]], str | None]
"""validate(stack) -> None, or why the stack is rejected (one line) before anything starts."""


def search(
    start: Mapping[str, Any],
    knobs: list[Knob],
    measure: Measure,
    *,
    budget_s: float,
    validate: Validate | None = None,
    tie: float = 0.03,
    max_passes: int = 3,
    clock: Callable[[], float] = time.monotonic,
    on_trial: Callable[[Trial], None] | None = None,
    rematch: bool = True,
) -> SearchResult:
    """Coordinate descent over `knobs` from `start` (module docstring), measuring each candidate
    once, within `budget_s` seconds of `clock`. A candidate is started only while the time left
    covers what the latest one took (not the longest: the first start may compile kernels);
    `measure` itself is given the deadline and must return by it.

    `rematch`: once the search ends, the winner and the start stack (when they differ) are each
    measured once more, back to back, and compared on the mean of their two runs: the winner of
    one short run on a noisy machine may have won by luck, and the start stack is what it must
    beat. While the best so far is not the start stack, the descent keeps the time for that."""
    deadline = clock() + budget_s
    trials: list[Trial] = []
    seen: dict[str, Trial] = {}
    latest = 0.0  # seconds the latest measured candidate took: what the next one is expected to take
    stopped = ""
    first: Trial | None = None  # the start stack's trial

    def attempt(keys: dict[str, Any]) -> Trial | None:
        """The trial of the stack with `keys` set (measured now, or earlier); None when the budget
        is spent."""
        nonlocal latest, stopped
        stack = apply_overrides(dict(start), keys) if keys else dict(start)
        key = json.dumps(stack, sort_keys=True, default=str)
        if key in seen:
            return seen[key]
        left = deadline - clock()
        reserve = 2 * latest if rematch and best is not first else 0.0
        if left <= 0 or left < latest + reserve:
            kept = f" (and {reserve:.0f} s kept for the rematch)" if reserve else ""
            stopped = f"budget: {max(left, 0):.0f} s left, the latest candidate took {latest:.0f} s{kept}"
            return None
        trial = Trial(index=len(trials), changes=dict(keys), stack=stack)
        began = clock()
        reason = validate(stack) if validate is not None else None
        if reason is not None:
            trial.error = f"rejected by check: {reason}"
        else:
            try:
                trial.add_run(measure(stack, deadline))
            except CandidateFailed as exc:
                trial.error = str(exc)
            trial.seconds = clock() - began
            latest = trial.seconds
        trials.append(trial)
        seen[key] = trial
        if on_trial is not None:
            on_trial(trial)
        return trial

    best: Trial | None = None
    best = first = attempt({})
    changes: dict[str, Any] = {}  # the best trial's keys over the start stack
    values = {k.path: k.current for k in knobs}  # the best trial's value of each knob

    def step(knob: Knob, value: Any) -> bool | None:
        """Try `knob` at `value` over the best so far; adopt it when it wins. None: out of budget."""
        nonlocal best
        keys = {**changes, knob.path: value}
        if value == knob.current:
            del keys[knob.path]  # back to the start stack's own value (perhaps a default unwritten)
        trial = attempt(keys)
        if trial is None:
            return None
        if not beats(trial, best, tie):
            return False
        best, values[knob.path] = trial, value
        changes.clear()
        changes.update(keys)
        return True

    for _ in range(max_passes):
        if best is None:
            break
        improved = False
        for knob in knobs:
            if knob.ordered:
                won = _walk(knob, values[knob.path], step)
            else:
                won = None if stopped else False
                for value in knob.values:
                    if value != values[knob.path] and not stopped:
                        won = step(knob, value) or won
            improved = improved or bool(won)
            if stopped:
                break
        if stopped or not improved:
            break
    if not stopped:
        stopped = "converged: a full pass over the knobs improved nothing" if trials else "nothing to measure"
    if rematch and best is not None and first is not None and best is not first and best.ok and first.ok:
        done = 0
        for trial in (best, first):  # the start stack last: the later run gets no warmer machine
            if deadline - clock() < trial.seconds:
                break
            try:
                trial.add_run(measure(trial.stack, deadline))
            except CandidateFailed as exc:
                # A second run that fails counts as nothing met: the mean halves.
                trial.add_run(Measurement(0.0, 0.0, {"error": str(exc)}))
            done += 1
            if on_trial is not None:
                on_trial(trial)
        if done == 2:
            stopped += "; rematch: " + (
                "the start stack won" if beats(first, best, tie) else "the winner held"
            )
            if beats(first, best, tie):
                best = first
        else:
            stopped += "; no time left for the rematch"
    if best is not None and not best.ok:
        best = None
    return SearchResult(trials=trials, best=best, stopped=stopped)


def _walk(knob: Knob, current: Any, step: Callable[[Knob, Any], bool | None]) -> bool:
    """An ordered knob: from `current` one rung down at a time while each wins, then (only if
    the first rung down lost) up the same way. Whether any rung won."""
    i = knob.values.index(current)
    for direction in (-1, 1):
        j, moved = i + direction, False
        while 0 <= j < len(knob.values):
            won = step(knob, knob.values[j])
            if not won:
                break
            moved, j = True, j + direction
        if moved or won is None:
            return moved
    return False


def _short(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"name"}:
        return str(value["name"])
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)
