"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmstack.errors import InvalidRequestError

if TYPE_CHECKING:
    from lmstack.sample.grammar import Grammar

# Requests with priority >= BATCH_PRIORITY are background work (the Batch API runs at this value):
# the `continuous` scheduler admits them only into capacity that interactive requests leave idle.
BATCH_PRIORITY = 100


@dataclass
class SamplingParams:
    """How to sample one request. Defaults are greedy-free: temperature 1.0, like OpenAI."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Restrict sampling to these token ids (applied per sequence; None = all tokens).
    allowed_token_ids: list[int] | None = None
    # Callables (token_ids_so_far, logits[V]) -> logits[V], applied to this sequence only.
    logits_processors: list = field(default_factory=list)
    # Structured output: a compiled grammar (e.g. `engine.grammar_compiler.json_schema(schema)`);
    # each sequence of the request is masked to follow it.
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > 128:
            raise bad("n", f"must be <= 128, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for lp_name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, lp_name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 20):
                raise bad(lp_name, f"must be an integer in [0, 20], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty")
        if self.grammar is not None:
            from lmstack.sample.grammar import Grammar  # no xgrammar import: that module loads it lazily

            if not isinstance(self.grammar, Grammar):
                raise bad("grammar", f"must be a compiled lmstack Grammar, got {type(self.grammar).__name__}")
