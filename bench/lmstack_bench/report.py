"""A benchmark's results: JSON on disk, a text table, and plots (latency CDFs; sweep curves)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmstack_bench.metrics import SLO, RequestRecord, Stats, Summary, summarize
from lmstack_bench.runner import LoadSpec


def _round_us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


@dataclass
class RunResult:
    load: LoadSpec
    records: list[RequestRecord]
    summary: Summary

    @classmethod
    def of(cls, load: LoadSpec, records: list[RequestRecord], slo: SLO | None) -> RunResult:
        return cls(load=load, records=records, summary=summarize(records, slo))

    def to_json(self) -> dict[str, Any]:
        t0 = min(r.start for r in self.records)
        us = _round_us
        return {
            "load": dataclasses.asdict(self.load),
            "summary": dataclasses.asdict(self.summary),
            "requests": [
                {
                    "start_s": us(r.start - t0),
                    "ttft_s": us(r.ttft),
                    "tpot_s": us(r.tpot),
                    "e2e_s": us(r.e2e),
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.output_tokens,
                    "itls_s": [us(g) for g in r.itls],
                    "error": r.error,
                    "turn": r.turn,
                    "cached_tokens": r.cached_tokens,
                }
                for r in self.records
            ],
        }


@dataclass
class BenchResult:
    """Everything one `lmstack bench serve` invocation measured against one server."""

    label: str
    base_url: str
    model: str
    config: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "base_url": self.base_url,
            "model": self.model,
            "config": self.config,
            "runs": [r.to_json() for r in self.runs],
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")


def _ms(stats: Stats | None, which: str) -> str:
    return "-" if stats is None else f"{getattr(stats, which):.0f}"


def table(results: Sequence[BenchResult]) -> str:
    """One row per (server, load point): throughput, then median / P99 of each latency (ms)."""
    head = (
        "server", "load", "ok", "fail", "req/s", "out tok/s",
        "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99", "goodput",
    )  # fmt: skip
    rows = [head]
    for res in results:
        for run in res.runs:
            s = run.summary
            rows.append(
                (
                    res.label,
                    run.load.label,
                    str(s.completed),
                    str(s.failed),
                    f"{s.request_throughput:.2f}",
                    f"{s.output_throughput:.1f}",
                    _ms(s.ttft, "median"),
                    _ms(s.ttft, "p99"),
                    _ms(s.tpot, "median"),
                    _ms(s.tpot, "p99"),
                    _ms(s.itl, "median"),
                    _ms(s.itl, "p99"),
                    _ms(s.e2e, "median"),
                    _ms(s.e2e, "p99"),
                    "-" if s.goodput is None else f"{s.goodput:.2f} ({s.slo_attainment:.0%})",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return (
        "\n".join(lines)
        + "\n(latencies in ms; goodput in req/s meeting every SLO, and the share of requests)"
    )


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (imported late: the CLI works without a display
    and pays for matplotlib only when it plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: list[float], label: str, **style: Any) -> None:
    if not values:
        return
    xs = sorted(v * 1000.0 for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, **style)


def plot_cdfs(results: Sequence[BenchResult], path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E), one line per server and load point."""
    import matplotlib.ticker

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot]), ("ITL", lambda r: r.itls),
              ("E2E latency", lambda r: [r.e2e]))  # fmt: skip
    styles = ("-", "--", "-.", ":")
    for ax, (name, values_of) in zip(axes.flat, panels):
        for i, res in enumerate(results):
            for j, run in enumerate(res.runs):
                values = [v for r in run.records if r.ok for v in values_of(r) if v is not None]
                style = {"color": f"C{i % 10}", "linestyle": styles[j % len(styles)]}
                _cdf(ax, values, f"{res.label}, {run.load.label}", **style)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: Sequence[BenchResult], path: Path) -> None:
    """Output throughput against P99 TTFT and P99 TPOT: one curve per server, points labelled by
    their concurrency or rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (name, attr) in zip(axes, (("P99 TTFT", "ttft"), ("P99 TPOT", "tpot"))):
        for res in results:
            pts = [
                (run.summary.output_throughput, getattr(run.summary, attr).p99, run.load)
                for run in res.runs
                if getattr(run.summary, attr) is not None
            ]
            if not pts:
                continue
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=res.label)[0]
            for x, y, load in pts:
                tag = f"c{load.concurrency}" if load.concurrency is not None else f"{load.rate:g}/s"
                ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=line.get_color())  # fmt: skip
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput against tail latency")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_result(path: Path) -> BenchResult:
    """Read a result written by `write_json` back (records rebuilt from their timings)."""
    return result_from_json(json.loads(Path(path).read_text()))


def result_from_json(data: dict[str, Any]) -> BenchResult:
    """The inverse of `BenchResult.to_json`."""
    slo_cfg = data["config"].get("slo")
    slo = SLO(**slo_cfg) if slo_cfg else None
    res = BenchResult(
        label=data["label"], base_url=data["base_url"], model=data["model"], config=data["config"]
    )
    for run in data["runs"]:
        records = []
        for r in run["requests"]:
            rec = RequestRecord(
                start=r["start_s"],
                end=r["start_s"] + r["e2e_s"],
                prompt_tokens=r["prompt_tokens"],
                output_tokens=r["output_tokens"],
                error=r["error"],
                turn=r.get("turn", 0),
                cached_tokens=r.get("cached_tokens"),
            )
            if r["ttft_s"] is not None:
                t = rec.start + r["ttft_s"]
                rec.first_token = t
                rec.chunk_times = [t]
                for gap in r["itls_s"]:
                    t += gap
                    rec.chunk_times.append(t)
            records.append(rec)
        res.runs.append(RunResult.of(LoadSpec(**run["load"]), records, slo))
    return res
