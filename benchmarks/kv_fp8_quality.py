"""Quality of the FP8 KV cache: perplexity and greedy tokens, fp8_e4m3 vs an unquantized cache.

Same model, same fp32 compute, only `quant.kv_cache` differs. Perplexity: teacher-forced
prompt logprobs through `lmstack.LLM` over non-overlapping windows of a text (default: the
GPL-3 text, first 7,658 tokens, 512-token windows — the numbers the other quantizers quote).
Greedy tokens: the oracle test's prompts (tests/test_oracle.py: two raw-text prompts and six
chat questions through the chat template), 20 new tokens each; how many differ from the
unquantized cache's, and at which position each first differs.

    python benchmarks/kv_fp8_quality.py [--text FILE] [--max-tokens N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the oracle prompts


def _stack(model: str, kv: str) -> dict:
    return {
        "model": model,
        "dtype": "float32",
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 512},
        "quant": {"kv_cache": kv},
    }


def perplexity(llm, ids: list[int], window: int) -> tuple[float, int]:
    from lmstack import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, n = 0.0, 0
    chunks = [ids[s : s + window + 1] for s in range(0, len(ids) - 1, window)]
    chunks = [c for c in chunks if len(c) >= 2]
    for out in llm.generate(chunks, params):
        for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True):
            nll -= lp[t]
            n += 1
    return math.exp(nll / n), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--max-tokens", type=int, default=7658)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=None, help="folder for kv_fp8_quality.json (default: print only)")
    args = ap.parse_args()

    from test_oracle import MAX_NEW, QUESTIONS, RAW

    from lmstack import LLM, SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict = {
        "command": "python " + shlex.join(sys.argv),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        results["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    greedy: dict[str, list[list[int]]] = {}
    for kv in ("none", "fp8_e4m3"):
        t0 = time.perf_counter()
        llm = LLM(_stack(args.model, kv))
        tok = llm.tokenizer
        ids = tok.encode(Path(args.text).read_text())[: args.max_tokens]
        ppl, n = perplexity(llm, ids, args.window)
        prompts = [tok.encode(t) for t in RAW] + [
            tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS
        ]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
        greedy[kv] = [o.outputs[0].token_ids for o in outs]
        results[kv] = {"perplexity": ppl, "tokens": n, "seconds": time.perf_counter() - t0}
        llm.engine.shutdown()
        print(f"kv_cache {kv}: perplexity {ppl:.4f} over {n} tokens", flush=True)
    base, fp8 = results["none"]["perplexity"], results["fp8_e4m3"]["perplexity"]
    results["ppl_change"] = fp8 / base - 1
    first_diff = []
    for a, b in zip(greedy["none"], greedy["fp8_e4m3"], strict=True):
        first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    results["greedy"] = {
        "prompts": len(first_diff),
        "new_tokens": MAX_NEW,
        "prompts_differing": sum(d is not None for d in first_diff),
        "tokens_differing": sum(
            x != y for a, b in zip(greedy["none"], greedy["fp8_e4m3"]) for x, y in zip(a, b)
        ),
        "first_difference_at": first_diff,
    }
    results["target"] = "perplexity change <= +1 %"
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kv_fp8_quality.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
