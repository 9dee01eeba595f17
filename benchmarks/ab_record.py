"""What the kernel A/B scripts (`cpu_kernel_ab.py`, `cpu_attention_ab.py`) share: kernel sources
read from a git revision, and the JSON record each writes (CPU named, command, medians)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

from lmstack.hardware import cpu_description

ROOT = Path(__file__).resolve().parent.parent


def git_show(rev: str, path: str, into: Path) -> Path:
    """The file `path` (relative to the repository) as it is at `rev`, written into `into`."""
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
    out = into / Path(path).name
    out.write_bytes(text)
    return out


def record_path(out: Path | None, name: str) -> Path:
    """`out`, or benchmarks/results/<name>-<today>/<name>.json; its folder made."""
    out = out or ROOT / "benchmarks" / "results" / f"{name}-{datetime.date.today()}" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def write_record(out: Path, before: str, threads: int, note: str, results: list[dict]) -> dict:
    """The A/B's record at `out`: this CPU, torch, the command line and every result."""
    summary = {
        **cpu_description(),
        "torch": torch.__version__,
        "threads": threads,
        "before": before,
        "after": "working tree",
        "command": " ".join(["python", *sys.argv]),
        "note": note,
        "results": results,
    }
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary
