"""Requests and the sequences they sample. The engine owns their state; components read it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lmstack.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks (new, or preempted for recompute)
    RUNNING = "running"  # holds blocks, scheduled each step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class Sequence:
    """One sample of a request: its tokens and how many of them are in the KV cache.

    `token_ids` is prompt + output. `num_computed_tokens` counts tokens whose K/V are in the
    cache; the scheduler advances it chunk by chunk (prefill) or one by one (decode), and a
    preemption resets it to 0 (recompute). The allocator keys its block tables by `seq_id`.
    """

    seq_id: int
    request: Request
    token_ids: list[int]
    index: int = 0  # which of the request's n samples
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""
    num_preemptions: int = 0
    # Steps it waited through, decoding, that carried more prompt tokens than the scheduler's
    # pace allows (`continuous`: long_gap_share): the gaps between its tokens it was made to take.
    long_gaps: int = 0
    # Tokens proposed by a speculator, verified in the next step (empty without one).
    draft_token_ids: list[int] = field(default_factory=list)
    # How many drafts the speculator may propose this step (set before it is asked).
    draft_limit: int = 0
    # The expected tokens a further draft must bring to pay for the query token it adds this
    # step (the adaptive policy's break-even; 0 when not adaptive): for a speculator that
    # `stops_by_confidence`.
    draft_min_gain: float = 0.0

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.prompt_len :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token still has to enter the cache."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time


@dataclass
class Request:
    """A client request: one prompt, `params.n` sequences sampled from it.

    Metadata set when the request is made, for schedulers, caches and lifecycle hooks to read:

    - `request_id`: the engine's key for the request, unique among requests in flight.
    - `client_request_id`: the caller's own id for it (over HTTP: an adopted `X-Request-Id`
      header), or None. Not unique: two callers, or one retrying, may send the same one.
    - `tenant`: who the request is for (over HTTP: the tenant of the API key that
      authenticated it, or the `X-Tenant` header when the server has no keys), or None. Never
      the API key itself.
    - `priority`: lower runs first under priority scheduling.
    - `cache_salt`: requests with different salts never share cached KV blocks.
    - `streamed`: whether the caller reads tokens as they come (an SSE stream, a terminal).
      The scheduler bounds the gap between tokens only for those: a request read when it ends
      (`LLM.generate`, a non-streaming HTTP call) sees its total time, which that bound only
      lengthens.
    - `group`: the requests one call made (an HTTP request's several prompts share its id);
      a fair scheduler counts them as one. None: the request is a group of its own.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under priority scheduling; FCFS ignores it
    tenant: str | None = None
    client_request_id: str | None = None
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the engine aborted it (a failing logits processor, ...)
    # Tokens that end the request (EOS unless ignore_eos, plus stop_token_ids); set at admission.
    stop_ids: frozenset[int] = frozenset()
    # Mixed into the content hash of every KV block: requests with different salts never share
    # cached blocks (tenant isolation for prefix caching).
    cache_salt: str | None = None
    # Prompt tokens whose KV came from a prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    streamed: bool = True
    group: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return bool(self.seqs) and all(s.is_finished for s in self.seqs)
