"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

/tokenize takes a text (`prompt`) or a conversation (`messages`, rendered with the chat template
chat requests use) and returns its token ids, their count and the model's context length;
/detokenize turns token ids back into text. Both need the same API key as generation (the
routes are in `lmstack_api.app`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from lmstack.errors import LmstackError
from lmstack_api import params as P
from lmstack_api.errors import invalid
from lmstack_api.schemas import ChatMessage


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's defaults: special tokens (a BOS) for a text; none for a chat, whose template writes them.
    add_special_tokens: bool | None = None


class DetokenizeRequest(msgspec.Struct):
    model: str | None = None
    tokens: list[int] | None = None


async def tokenize_body(state: Any, engine: Any, body: bytes) -> dict[str, Any]:
    req = P.decode_body(body, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        if not req.messages:
            raise invalid("messages must be a non-empty list", param="messages")
        tokenizer = state.chat_tokenizer(engine)
        try:
            text = await asyncio.to_thread(
                tokenizer.apply_chat_template, P.chat_messages(req), req.add_generation_prompt
            )
        except LmstackError as exc:
            raise invalid(str(exc), param="messages") from None
        special = bool(req.add_special_tokens)
    backend = engine.tokenizer.backend

    def run() -> list[int]:
        # encode_batch releases the GIL (encode holds it): long texts do not stall the server.
        return backend.encode_batch([text], add_special_tokens=special)[0].ids

    ids = await asyncio.to_thread(run)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


async def detokenize_body(state: Any, engine: Any, body: bytes) -> dict[str, Any]:
    req = P.decode_body(body, DetokenizeRequest)
    state.check_model(req.model)
    if req.tokens is None:
        raise invalid("tokens is required", param="tokens")
    vocab = engine.tokenizer.vocab_size
    for i, tok in enumerate(req.tokens):
        if not 0 <= tok < vocab:
            raise invalid(f"tokens[{i}] = {tok} is outside the vocabulary [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens, False)
    return {"prompt": text}
