"""Resident weight bytes of SmolLM2-135M-Instruct served with `quant: {weights: int8}` against
the unquantized model in bf16: the loaded model's parameters and buffers, shared storage
(the tied embedding / head) counted once.

    OMP_NUM_THREADS=1 python benchmarks/int8_resident_bytes.py

Writes benchmarks/results/int8_perplexity-<date>/resident_bytes.json and prints it.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from torch import nn


def resident(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters and of buffers (each storage once), and of the RoPE tables among
    the buffers (computed, not weights)."""
    seen: set[int] = set()
    out = {"parameters": 0, "buffers": 0, "rope_buffers": 0}
    for kind, named in (("parameters", model.named_parameters()), ("buffers", model.named_buffers())):
        for name, t in named:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.numel() == 0:
                continue
            seen.add(ptr)
            out[kind] += t.untyped_storage().nbytes()
            if kind == "buffers" and name.startswith("rope"):
                out["rope_buffers"] += t.untyped_storage().nbytes()
    out["weights"] = out["parameters"] + out["buffers"] - out["rope_buffers"]
    return out


def measure(dtype: str, weights: str) -> dict[str, int]:
    from lmstack.llm import LLM

    stack = {
        "model": "smollm2-135m-instruct",
        "dtype": dtype,
        "device": "cpu",
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 16},
        "quant": {"weights": weights},
    }
    llm = LLM(stack)
    try:
        return resident(llm.engine.executor.runner.model)
    finally:
        llm.engine.shutdown()


def main() -> None:
    runs = {
        "bfloat16/none": measure("bfloat16", "none"),
        "bfloat16/int8": measure("bfloat16", "int8"),
        "float32/int8": measure("float32", "int8"),
    }
    base = runs["bfloat16/none"]["weights"]
    from lmstack.hardware import cpu_name

    summary = {
        "cpu": cpu_name(),
        "command": " ".join(["python", *sys.argv]),
        "runs": runs,
        "weights_ratio_vs_bf16": {k: round(v["weights"] / base, 4) for k, v in runs.items()},
    }
    out = (
        Path(__file__).parent / "results" / f"int8_perplexity-{datetime.date.today()}" / "resident_bytes.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
