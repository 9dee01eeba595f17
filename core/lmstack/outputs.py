"""What the engine hands back: per request, one entry per sample, cumulative plus deltas."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per output token: chosen + top-n
    cumulative_logprob: float = 0.0
    # Since the previous output of this request (streaming).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine had to abort this request
    # Per prompt token (None for the first): its logprob and the top-n alternatives.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class EngineStats:
    """A metrics snapshot."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    prompt_tokens: int  # computed prompt tokens (prefill work), cumulative
    generation_tokens: int  # sampled tokens, cumulative
    num_finished: int
    num_steps: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    num_draft_tokens: int = 0  # speculative decoding: proposed
    num_accepted_tokens: int = 0  # and accepted
    # Verifications by the number of drafts accepted (0..num_draft_tokens): the histogram.
    spec_decode_accepted_lengths: dict[int, int] = field(default_factory=dict)
    spec_decode_draft_length: float = 0.0  # the mean draft limit of the last step (adaptive)

    def snapshot(self) -> EngineStats:
        """A copy that shares nothing mutable with this one: cheap enough to take every step
        (~5 us; the counters are flat, so a shallow copy plus copies of the dicts and lists)."""
        snap = copy.copy(self)
        for name, value in vars(snap).items():
            if isinstance(value, dict | list):
                setattr(snap, name, copy.copy(value))
        return snap
