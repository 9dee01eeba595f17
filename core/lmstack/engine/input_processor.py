"""The way in: validation, tokenization, the chat template and request creation.

Thread-safe, so HTTP handler threads validate and tokenize while the engine thread steps.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Container
from typing import Any

from lmstack.errors import InvalidRequestError
from lmstack.interfaces import EngineLimits
from lmstack.sample.grammar import GrammarCompiler
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request


class InputProcessor:
    """Turns prompts (text, token ids or chat messages) and sampling parameters into validated
    `Request`s. Errors are `InvalidRequestError`s naming the offending field."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        limits: EngineLimits,
        eos_token_ids: frozenset[int],
        live_request_ids: Container[str],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        # The engine's table of requests in flight: a new id must not collide with one of them.
        self._live = live_request_ids
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this model (created on first use, once even
        when handler threads race). Raises InvalidRequestError if xgrammar is not installed."""
        if self._grammar_compiler is None:
            with self._grammar_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer, self.vocab_size, self.eos_token_ids
                    )
        return self._grammar_compiler

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """The model's chat template over `messages`, tokenized (assistant turn opened)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)

    def tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """(token ids, prompt text or None) for a text or token-id prompt, checked non-empty
        and inside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            return self.tokenizer.encode(prompt), prompt
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return ids, None

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Limits a request must fit: the context, the grammar's model, n vs max_num_seqs."""
        limit = self.limits.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {limit} tokens, which must also hold "
                "at least one output token",
                param="prompt",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the context "
                f"length {limit}; lower max_tokens to at most {limit - len(ids)}",
                param="max_tokens",
            )
        if params.grammar is not None and params.grammar.vocab_size != self.vocab_size:
            raise InvalidRequestError(
                "grammar was compiled for another model (use this engine's grammar_compiler)", param="grammar"
            )
        if params.n > self.limits.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds the scheduler's max_num_seqs ({self.limits.max_num_seqs})", param="n"
            )

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
        client_request_id: str | None = None,
        cache_salt: str | None = None,
        streamed: bool = True,
    ) -> Request:
        """Validate and tokenize; raises InvalidRequestError naming the field. `tenant` and
        `client_request_id` are carried on the Request for components to read (see `Request`); `cache_salt`
        keeps the request's KV blocks apart from those of requests with another salt; `streamed`:
        whether the caller reads tokens as they come (see `Request`)."""
        params = params or SamplingParams()
        ids, text = self.tokenize(prompt)
        self.check(ids, params)
        if request_id is None:
            with self._ids_lock:
                request_id = f"req-{next(self._ids)}"
        if request_id in self._live:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = Request(
            request_id,
            ids,
            params,
            priority=priority,
            prompt=text,
            tenant=tenant,
            client_request_id=client_request_id,
            cache_salt=check_cache_salt(cache_salt),
            streamed=streamed,
        )
        req.stop_ids = (frozenset() if params.ignore_eos else self.eos_token_ids) | frozenset(
            params.stop_token_ids
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req


MAX_CACHE_SALT_LENGTH = 1024


def check_cache_salt(salt: object) -> str | None:
    """A cache salt is None or a non-empty string of at most 1024 characters."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_LENGTH:
        raise InvalidRequestError(
            f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_LENGTH} are allowed",
            param="cache_salt",
        )
    return salt
