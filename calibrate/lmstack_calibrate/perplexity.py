"""`lmstack eval perplexity`: how well the served model predicts a text.

The text is tokenized with the model's own tokenizer (no special tokens added) and cut into
non-overlapping windows of `window` predicted tokens: window i is tokens [i*W, i*W + W] (W + 1
tokens), whose first token is context only, so every token after the first is predicted exactly
once, from at most W tokens of context (the same windowing as the usual "strided, stride =
window" perplexity scripts for transformers). Each window is one request to the engine built
from the stack, with `prompt_logprobs=0` and one generated token: the logits come from the
served model runner itself, so the stack's quantizer, KV-cache dtype, attention kernels and
chunked prefill are all part of what is measured. Perplexity = exp(mean negative log-likelihood
over the predicted tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmstack.commands.progress import Progress
from lmstack.errors import ConfigError

DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # tokens predicted
    windows: int
    window: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "perplexity": self.perplexity,
            "nll": self.nll,
            "tokens": self.tokens,
            "windows": self.windows,
            "window": self.window,
        }


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of `window` predicted tokens (window + 1 tokens each, sharing
    one token with the previous window as context); the last may be shorter."""
    out = []
    for start in range(0, max(len(ids) - 1, 0), window):
        chunk = ids[start : start + window + 1]
        if len(chunk) >= 2:
            out.append(chunk)
    return out


def perplexity(
    engine: Any,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of `engine` (an `LLMEngine`) over `text`; `max_tokens` caps the tokens read
    from the start of the text."""
    from lmstack.sampling_params import SamplingParams

    if window < 1:
        raise ConfigError(f"--window must be >= 1, got {window}")
    if window + 2 > engine.max_model_len:
        raise ConfigError(
            f"--window {window} needs {window + 2} positions (window, its context token and one "
            f"generated token) but the stack allows {engine.max_model_len}; pick a smaller window"
        )
    ids = engine.tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    chunks = windows_of(ids, window)
    if not chunks:
        raise ConfigError("the text has fewer than 2 tokens: nothing to predict")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    reqs = [engine.make_request(chunk, params) for chunk in chunks]
    for r in reqs:
        engine.enqueue(r)
    bar = Progress(sum(len(c) - 1 for c in chunks), "perplexity", "tokens") if progress else None
    results: dict[str, Any] = {}
    while len(results) < len(reqs):
        for out in engine.step():
            if out.finished and out.request_id not in results:
                if out.error:
                    raise ConfigError(f"the engine aborted a window: {out.error}")
                results[out.request_id] = out
                if bar is not None:
                    bar.update(len(out.prompt_token_ids) - 1)
    if bar is not None:
        bar.close()
    total_nll, count = 0.0, 0
    for req, chunk in zip(reqs, chunks, strict=True):
        lps = results[req.request_id].prompt_logprobs
        assert lps is not None and len(lps) == len(chunk)
        for tok, entry in zip(chunk[1:], lps[1:], strict=True):
            assert entry is not None
            total_nll -= entry[tok]
            count += 1
    nll = total_nll / count
    return PerplexityResult(math.exp(nll), nll, count, len(chunks), window)


def run_cli(args: Any) -> int:
    """`lmstack eval perplexity`: prints the perplexity (or one JSON object with --json)."""
    import json

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.kernels.hardware import cpu_description
    from lmstack.stack.resolve import DTYPE_NAMES
    from lmstack_calibrate.calibration_text import read_text
    from lmstack_calibrate.quantize import load_stack_with_model

    text = read_text(args.text)
    engine = LLMEngine(load_stack_with_model(args.stack, args.model, args.overrides))
    try:
        result = perplexity(engine, text, window=args.window, max_tokens=args.max_tokens)
    finally:
        engine.shutdown()
    quant = engine.stack.selected["quantizer"]
    report = result.as_dict() | {
        "text": str(args.text),
        "stack": str(args.stack),
        "model": engine.stack.model,
        "quantizer": quant.component.name,
        "quantizer_options": {k: v for k, v in quant.describe().get("options", {}).items()},
        "dtype": DTYPE_NAMES[engine.stack.dtype],
        "kv_cache_dtype": DTYPE_NAMES.get(engine.stack.kv_cache_dtype),
        "checkpoint_format": _checkpoint_format(engine),
        **cpu_description(),  # a result file names the CPU it ran on (fp32 sums differ by kernel)
    }
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(
            f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
            f"({result.windows} windows of {result.window}); model {report['model']}, "
            f"quantizer {report['quantizer']}, dtype {report['dtype']}, KV cache {report['kv_cache_dtype']}"
        )
    return 0


def _checkpoint_format(engine: Any) -> str:
    from lmstack.quant.formats import checkpoint_format_id

    return checkpoint_format_id(engine.model_config.quantization)
