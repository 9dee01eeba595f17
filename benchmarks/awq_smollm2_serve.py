"""SmolLM2-135M-Instruct under rtn-int4 (examples/stacks/rtn-int4.yaml, or a stack given):
load time, resident weight bytes against bf16, and a greedy completion.
Usage: python benchmarks/awq_smollm2_serve.py [stack.yaml]"""

from __future__ import annotations

import sys
import time

from lmstack.config import load_stack
from lmstack.llm import LLM
from lmstack.sampling_params import SamplingParams

BF16_BYTES = 2 * 134_515_008  # SmolLM2-135M's parameters (tied embedding counted once), in bf16


def resident_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def main() -> None:
    stack = load_stack(sys.argv[1] if len(sys.argv) > 1 else "examples/stacks/rtn-int4.yaml")
    t = time.time()
    llm = LLM(stack)
    load = time.time() - t
    model = llm.engine.executor.runner.model
    size = resident_bytes(model)
    rope = sum(b.untyped_storage().nbytes() for n, b in model.named_buffers() if "rope" in n)
    print(
        f"load {load:.1f} s; weights {size / 1e6:.1f} MB (of which RoPE tables {rope / 1e6:.1f} MB) = {(size - rope) / BF16_BYTES:.3f} x bf16 without RoPE tables"
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    t = time.time()
    out = llm.generate(["The capital of France is"], sp)[0]
    print(f"{time.time() - t:.1f} s: {out.outputs[0].text!r}")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
