"""Streaming token ids -> text, one step at a time, for server-sent events.

Byte-level tokenizers (GPT-2 style, SmolLM2, Llama 3) go through `_ByteStream`: each token is a
fixed byte string, so an incremental UTF-8 decoder gives exact deltas in O(new tokens); it holds
back an incomplete character until its last byte arrives. Other tokenizers (e.g. sentencepiece
with byte fallback) go through `_WindowDecode`, which re-decodes a short window of recent ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from lmstack.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Ids of context kept before the unread ones in window decoding: enough to settle merges of
# leading spaces and byte-fallback runs.
_WINDOW_CONTEXT = 6


class _ByteStream:
    """Exact for byte-level decoders: the text is the UTF-8 decode (invalid bytes -> U+FFFD) of
    the tokens' bytes joined, which is what `Tokenizer.decode` computes in one go."""

    def __init__(self, pieces: list[bytes], skip: frozenset[int]) -> None:
        self._pieces = pieces
        self._skip = skip
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, ids: Sequence[int]) -> str:
        n = len(self._pieces)
        data = b"".join(self._pieces[i] for i in ids if 0 <= i < n and i not in self._skip)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDecode:
    """Generic: decode ids[prefix:] and ids[prefix:read], emit what the longer one adds. Text that
    ends in U+FFFD is held back, as it may be a character whose bytes are still arriving."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Prompt ids give the first output tokens their context (a leading-space marker decodes
        # differently at the start of a text than after other tokens).
        self._ids = list(prompt_ids[-_WINDOW_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        # Drop ids no longer needed as context, so the window (and each decode) stays small.
        keep_from = max(len(self._ids) - _WINDOW_CONTEXT, 0)
        self._ids = self._ids[keep_from:]
        self._prefix = max(self._read - keep_from, 0)
        self._read = len(self._ids)
        return after[len(before) :]


class IncrementalDetokenizer:
    """Turns generated ids into text deltas.

    The deltas joined equal `tokenizer.decode(all_output_ids, skip_special_tokens)` (for byte-level
    tokenizers exactly, once `flush()` has been called at the end of the stream). A delta never
    ends in a partial character, and skipped special tokens never appear. `prompt_token_ids` only
    serve as decoding context for non-byte-level tokenizers; they are never part of the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        pieces = tokenizer.byte_pieces
        self._impl: _ByteStream | _WindowDecode = (
            _ByteStream(pieces, skip)
            if pieces is not None
            else _WindowDecode(tokenizer, prompt_token_ids or (), skip_special_tokens)
        )
        self._parts: list[str] = []

    def step(self, new_token_ids: Sequence[int]) -> str:
        """The text that `new_token_ids` complete ("" while a character is still incomplete)."""
        return self._record(self._impl.step(new_token_ids))

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, with an incomplete tail as U+FFFD."""
        return self._record(self._impl.flush())

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _record(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta
