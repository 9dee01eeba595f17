"""`lmstack eval perplexity`: how well the served model predicts a text.

Two ways to cut the text, `--method`:

- `windows` (the default): the text is tokenized with the model's own tokenizer (no special
  tokens added) and cut into non-overlapping windows of `window` predicted tokens: window i is
  tokens [i*W, i*W + W] (W + 1 tokens), whose first token is context only, so every token after
  the first is predicted exactly once, from at most W tokens of context (the same windowing as
  the usual "strided, stride = window" perplexity scripts for transformers).
- `chunks`: what llama.cpp's `llama-perplexity -c N` computes (tools/perplexity/perplexity.cpp),
  so the two can be compared on the same GGUF file and text: the text loses one trailing
  newline (its `-f` does that), is tokenized with the model's special tokens added (a BOS where
  the model's `add_bos` says so) and special-token strings in it read as plain text; it is cut
  into floor(tokens / N) chunks of exactly N tokens (the rest is dropped; fewer than 2N tokens is
  an error, as there), at most `--chunks` of them; each chunk's first token is replaced by the BOS
  when the model adds one; only the second half of each chunk is scored: the tokens at positions
  N/2 + 1 .. N - 1, N - N/2 - 1 per chunk.

Each window or chunk is one request to the engine built from the stack, with `prompt_logprobs=0`
and one generated token: the logits come from the served model runner itself, so the stack's
quantizer, KV-cache dtype, attention kernels and chunked prefill are all part of what is
measured. Perplexity = exp(mean negative log-likelihood over the scored tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmstack.commands.progress import Progress
from lmstack.errors import ConfigError

DEFAULT_WINDOW = 512
DEFAULT_CTX = 512  # llama-perplexity's default -c
METHODS = ("windows", "chunks")


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int  # windows (or chunks) run
    window: int  # predicted tokens per window (chunks: tokens per chunk, llama-perplexity's -c)
    method: str = "windows"

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "perplexity": self.perplexity,
            "nll": self.nll,
            "tokens": self.tokens,
            **(
                {"chunks": self.windows, "ctx": self.window}
                if self.method == "chunks"
                else {"windows": self.windows, "window": self.window}
            ),
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


def chunks_of(ids: list[int], ctx: int, bos: int | None, max_chunks: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks: floor(len / ctx) chunks of exactly `ctx` tokens (at most
    `max_chunks`), each starting with `bos` when the model adds one (None: it does not)."""
    if len(ids) < 2 * ctx:
        raise ConfigError(
            f"the text tokenizes to {len(ids)} tokens; --method chunks with --ctx {ctx} needs at "
            f"least {2 * ctx} (as llama-perplexity does)"
        )
    n = len(ids) // ctx if max_chunks is None else min(max_chunks, len(ids) // ctx)
    chunks = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def chunk_first_scored(ctx: int) -> int:
    """The first scored position of a chunk: llama-perplexity scores the logits from position
    ctx/2 on, each predicting the next token."""
    return ctx // 2 + 1


def llama_cpp_tokens(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama-perplexity takes them, and the BOS it puts at the start of every
    chunk (None when the model adds none): one trailing newline dropped, special tokens added
    as the model says (llama.cpp's `add_bos`), special-token strings in the text not parsed."""
    if text.endswith("\n"):
        text = text[:-1]
    backend = tokenizer.backend
    parsed = backend.encode_special_tokens
    backend.encode_special_tokens = True  # llama.cpp tokenizes with parse_special = false
    try:
        ids = tokenizer.encode(text, add_special_tokens=True)
        bare = tokenizer.encode("a")
        marked = tokenizer.encode("a", add_special_tokens=True)
    finally:
        backend.encode_special_tokens = parsed
    bos = tokenizer.bos_token_id
    if marked == bare:
        return ids, None
    if bos is not None and marked == [bos, *bare]:
        return ids, bos
    raise ConfigError(
        "the tokenizer adds special tokens other than a leading BOS; llama-perplexity refuses such models"
    )


def _scored_nll(engine: Any, chunks: list[list[int]], first: int, progress: bool) -> tuple[float, int]:
    """Run every chunk through the engine (one request each, prompt log-probabilities on) and
    sum the negative log-likelihood of each chunk's tokens from position `first` on."""
    from lmstack.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    reqs = [engine.make_request(chunk, params) for chunk in chunks]
    for r in reqs:
        engine.enqueue(r)
    bar = Progress(sum(len(c) for c in chunks), "perplexity", "tokens") if progress else None
    results: dict[str, Any] = {}
    while len(results) < len(reqs):
        for out in engine.step():
            if out.finished and out.request_id not in results:
                if out.error:
                    raise ConfigError(f"the engine aborted a window: {out.error}")
                results[out.request_id] = out
                if bar is not None:
                    bar.update(len(out.prompt_token_ids))
    if bar is not None:
        bar.close()
    total_nll, count = 0.0, 0
    for req, chunk in zip(reqs, chunks, strict=True):
        lps = results[req.request_id].prompt_logprobs
        assert lps is not None and len(lps) == len(chunk)
        for tok, entry in zip(chunk[first:], lps[first:], strict=True):
            assert entry is not None
            total_nll -= entry[tok]
            count += 1
    return total_nll, count


def _check_fits(engine: Any, positions: int, what: str) -> None:
    if positions > engine.max_model_len:
        raise ConfigError(
            f"{what} needs {positions} positions (with one generated token) but the stack allows "
            f"{engine.max_model_len}; pick a smaller one"
        )


def perplexity(
    engine: Any,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of `engine` (an `LLMEngine`) over `text` in windows; `max_tokens` caps the
    tokens read from the start of the text."""
    if window < 1:
        raise ConfigError(f"--window must be >= 1, got {window}")
    _check_fits(engine, window + 2, f"--window {window} (its context token too)")
    ids = engine.tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    chunks = windows_of(ids, window)
    if not chunks:
        raise ConfigError("the text has fewer than 2 tokens: nothing to predict")
    total_nll, count = _scored_nll(engine, chunks, 1, progress)
    nll = total_nll / count
    return PerplexityResult(math.exp(nll), nll, count, len(chunks), window)


def llama_cpp_perplexity(
    engine: Any, text: str, *, ctx: int = DEFAULT_CTX, max_chunks: int | None = None, progress: bool = True
) -> PerplexityResult:
    """Perplexity of `engine` over `text` as `llama-perplexity -c ctx [--chunks max_chunks]`
    computes it (the module's docstring says how)."""
    if ctx < 4:
        raise ConfigError(f"--ctx must be >= 4, got {ctx}")
    _check_fits(engine, ctx + 1, f"--ctx {ctx}")
    ids, bos = llama_cpp_tokens(engine.tokenizer, text)
    chunks = chunks_of(ids, ctx, bos, max_chunks)
    total_nll, count = _scored_nll(engine, chunks, chunk_first_scored(ctx), progress)
    nll = total_nll / count
    return PerplexityResult(math.exp(nll), nll, count, len(chunks), ctx, "chunks")


def run_cli(args: Any) -> int:
    """`lmstack eval perplexity`: prints the perplexity (or one JSON object with --json)."""
    import json

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.kernels.hardware import cpu_description
    from lmstack.stack.resolve import DTYPE_NAMES
    from lmstack_calibrate.calibration_text import read_text
    from lmstack_calibrate.quantize import load_stack_with_model

    method = method_options(args)
    text = read_text(args.text)
    engine = LLMEngine(load_stack_with_model(args.stack, args.model, args.overrides))
    try:
        if method == "chunks":
            result = llama_cpp_perplexity(engine, text, ctx=args.ctx or DEFAULT_CTX, max_chunks=args.chunks)
        else:
            window = args.window or DEFAULT_WINDOW
            result = perplexity(engine, text, window=window, max_tokens=args.max_tokens)
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
        cut = (
            f"the second halves of {result.windows} chunks of {result.window}, as llama-perplexity -c {result.window}"
            if method == "chunks"
            else f"{result.windows} windows of {result.window}"
        )
        print(
            f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
            f"({cut}); model {report['model']}, "
            f"quantizer {report['quantizer']}, dtype {report['dtype']}, KV cache {report['kv_cache_dtype']}"
        )
    return 0


def method_options(args: Any) -> str:
    """The method the command line asks for, refusing options of the other method (one line)."""
    method = getattr(args, "method", "windows")
    given = {
        "--window": getattr(args, "window", None),
        "--max-tokens": getattr(args, "max_tokens", None),
        "--ctx": getattr(args, "ctx", None),
        "--chunks": getattr(args, "chunks", None),
    }
    foreign = ("--ctx", "--chunks") if method == "windows" else ("--window", "--max-tokens")
    for option in foreign:
        if given[option] is not None:
            raise ConfigError(f"{option} does not apply to --method {method}")
    return method


def _checkpoint_format(engine: Any) -> str:
    from lmstack.quant.formats import checkpoint_format_id

    return checkpoint_format_id(engine.model_config.quantization)
