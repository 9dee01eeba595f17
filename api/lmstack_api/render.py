"""Engine outputs in the OpenAI wire format: choices, logprobs, usage, SSE frames."""

from __future__ import annotations

import msgspec

from lmstack.outputs import CompletionOutput, RequestOutput
from lmstack_api.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

_encoder = msgspec.json.Encoder()


def sse(payload: object) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def to_json(payload: object) -> bytes:
    return _encoder.encode(payload)


class TokenText:
    """Token id -> its text and bytes, as logprobs report them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pieces = tokenizer.byte_pieces

    def bytes(self, tok: int) -> bytes:
        if self.pieces is not None and 0 <= tok < len(self.pieces):
            return self.pieces[tok]
        return self.tokenizer.decode([tok], skip_special_tokens=False).encode()

    def text(self, tok: int) -> str:
        return self.bytes(tok).decode("utf-8", errors="replace")


def chat_logprobs(
    out: CompletionOutput, start: int, end: int, top_n: int, tt: TokenText
) -> ChatLogprobs | None:
    """Logprobs of output tokens [start, end)."""
    if out.logprobs is None:
        return None
    content = []
    for tok, entry in zip(out.token_ids[start:end], out.logprobs[start:end], strict=True):
        tops = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: -x[1])[:top_n] if top_n else []
        content.append(
            TokenLogprob(
                token=tt.text(tok),
                logprob=max(entry[tok], -9999.0),
                bytes=list(tt.bytes(tok)),
                top_logprobs=[TopLogprob(tt.text(t), max(lp, -9999.0), list(tt.bytes(t))) for t, lp in tops],
            )
        )
    return ChatLogprobs(content)


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    top_n: int,
    tt: TokenText,
) -> CompletionLogprobs:
    """The legacy completions format; `entries[i]` is None where no logprob exists (the first
    prompt token)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = 0
    for tok, entry in zip(token_ids, entries, strict=True):
        text = tt.text(tok)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(max(entry[tok], -9999.0))
        best = sorted(entry.items(), key=lambda x: -x[1])[:top_n] if top_n else []
        tops.append({tt.text(t): max(lp, -9999.0) for t, lp in best} if top_n else None)
    return CompletionLogprobs(tokens, lps, tops, offsets)


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))
