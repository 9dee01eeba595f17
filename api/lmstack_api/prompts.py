"""Prompt text to token ids without stalling the event loop.

The tokenizer's `encode` holds the GIL for its whole run (2.6 s for a 3.9 MB prompt here), so a
thread does not help; `encode_batch` releases it. Before any of that, a prompt whose byte length
alone proves it cannot fit the context is refused: every token of a byte-level BPE covers at
most `max_piece` bytes of text, so a prompt of B bytes has at least ceil(B / max_piece) tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmstack_api.errors import APIError, invalid


def max_piece_bytes(tokenizer: Any) -> int | None:
    """The longest token in bytes, when the bound above holds for this tokenizer (byte-level,
    no normalizer that could shrink the text); None otherwise."""
    backend = getattr(tokenizer, "backend", None)
    pieces = tokenizer.byte_pieces
    if pieces is None or backend is None or backend.normalizer is not None:
        return None
    return max((len(p) for p in pieces), default=0) or None


def context_error(tokens: int, limit: int, param: str, at_least: bool = False) -> APIError:
    bound = "at least " if at_least else ""
    return invalid(
        f"prompt has {bound}{tokens} tokens; this model's context is {limit} tokens, which must also "
        "hold at least one output token",
        param=param,
        code="context_length_exceeded",
    )


def check_text_fits(text: str, limit: int, max_piece: int | None, param: str) -> None:
    if max_piece is None:
        return
    # len(text) <= UTF-8 bytes; the exact byte count is only needed near the bound.
    if len(text) < limit * max_piece // 4:
        return
    n_bytes = len(text.encode("utf-8", errors="surrogatepass"))
    least = -(-n_bytes // max_piece)
    if least >= limit:
        raise context_error(least, limit, param, at_least=True)


async def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, as `Tokenizer.encode` (no special tokens added) would give them,
    computed in a thread that releases the GIL."""
    if not texts:  # token-id prompts: no trip through the default executor, which text ones share
        return []
    backend = tokenizer.backend

    def run() -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    return await asyncio.to_thread(run)
