"""The options of `continuous` (`lmstack.components.continuous`): budgets, chunking, the step-time
target, and the priority classes' aging and background rules (`priority_classes`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmstack.errors import ConfigError


class ContinuousOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, msgspec.Meta(description="the most sequences running at once")] = 64
    max_num_batched_tokens: Annotated[
        int, msgspec.Meta(description="the most tokens one step computes, prompt chunks and decodes together")
    ] = 2048
    # Split long prompts into chunks that share steps with running decodes.
    chunked_prefill: Annotated[
        bool, msgspec.Meta(description="split long prompts into chunks that share steps with running decodes")
    ] = True
    # Cap one prompt's chunk so a single long prompt cannot take the whole budget (0: no cap).
    max_prefill_chunk: Annotated[
        int, msgspec.Meta(description="the most tokens of one prompt per step (0: no cap)")
    ] = 0
    # While streams decode, a step carrying prefill is predicted to take at most this many
    # times the decode-only step (measured step cost; 0: no limit). Bounds the gap between a
    # stream's tokens (ITL P99) at the price of more steps per prompt (TTFT).
    max_step_ratio: Annotated[
        float, msgspec.Meta(description="a step with prefill over a decode-only one, at most (0: no limit)")
    ] = 2.5
    # Unless a request waiting for its first token would miss this target at that pace: then the
    # step takes the prompt tokens that keep every waiting request within it (up to the budget).
    ttft_target_ms: Annotated[
        float,
        msgspec.Meta(
            description="time to first token that overrides max_step_ratio when it would be missed (0: never)"
        ),
    ] = 1000.0
    # ... and such a catch-up step is predicted to take at most this many times the decode-only
    # step (0: up to the budget), the rest of the backlog spread over the next steps. Off by
    # default: a trade, not a gain (A/B, 2-core Zen 4, 32 streams of a Q4_K_M file at 4: ITL P99
    # 224 vs 400 ms, TTFT P50 1.7 vs 2.6 s, but TTFT P99 5.1 vs 4.1 s and 9 % fewer tokens a
    # second; the default SmolLM2 stack at 8 / 16 / 32 streams: TTFT P99 worse at each, ITL P99
    # no better). For a server that must bound the gap between a stream's tokens.
    ttft_max_step_ratio: Annotated[
        float,
        msgspec.Meta(
            description="a step ttft_target_ms enlarges over a decode-only one, at most (0: no limit)"
        ),
    ] = 0.0
    # A streamed request may wait through a step of a whole prompt (the budget) instead of the
    # paced chunks, as long as such long gaps stay within this share of its tokens (counting
    # those to come, up to max_tokens and at most LONG_GAP_LOOKAHEAD ahead): a burst of
    # arrivals is then prefilled at once when every decoding stream can afford the gap, which
    # keeps the gaps past the pace under 1 % (ITL P99) with less time to first token than
    # pacing the burst through many longer steps (0: always paced).
    long_gap_share: Annotated[
        float,
        msgspec.Meta(
            description="share of a stream's token gaps that may exceed the max_step_ratio pace (0: none)"
        ),
    ] = 0.008
    # An absolute bound on such a step, in milliseconds (0: none).
    max_step_ms: Annotated[
        float, msgspec.Meta(description="the longest such step, in milliseconds (0: no bound)")
    ] = 0.0
    # Starvation bound for priority classes (`lmstack.components.priority_classes`).
    priority_aging_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds of waiting per one-class priority gain, up to the most urgent present (0: off)"
        ),
    ] = 60.0
    # Background work (priority >= BATCH_PRIORITY) beside interactive work (`priority_classes`).
    # 0 by default: on a CPU a step is compute-bound from a few dozen tokens, so every
    # background token lengthens it (measured: 10 % allowed by the curve cost interactive
    # steps ~45 %). Where extra rows are nearly free (a GPU's memory-bound decode) a slack lets
    # background decodes ride along.
    background_slack: Annotated[
        float,
        msgspec.Meta(
            description="how much background work may lengthen an interactive step, as a fraction (0: none)"
        ),
    ] = 0.0
    # (c) without interactive work: how long a background step may be, so that an interactive
    # request arriving meanwhile waits at most about this long for its first step.
    background_max_step_ms: Annotated[
        float,
        msgspec.Meta(
            description="background-only steps with prompt chunks take at most this many ms (0: no bound)"
        ),
    ] = 100.0
    # A closed-loop client sends its next request a moment after its last one ends (a few ms
    # through HTTP): without this, every such gap would start a background step, which the next
    # request then waits behind.
    background_grace_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds after the last interactive work that background keeps to the slack"
        ),
    ] = 0.1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", f"scheduler.{name}")
        if self.max_prefill_chunk < 0:
            raise ConfigError("must be >= 0", "scheduler.max_prefill_chunk")
        if self.max_step_ratio != 0 and self.max_step_ratio < 1:
            raise ConfigError(
                f"must be 0 (off) or >= 1, got {self.max_step_ratio}", "scheduler.max_step_ratio"
            )
        if self.ttft_max_step_ratio != 0 and self.ttft_max_step_ratio < 1:
            raise ConfigError(
                f"must be 0 (off) or >= 1, got {self.ttft_max_step_ratio}", "scheduler.ttft_max_step_ratio"
            )
        if not 0 <= self.long_gap_share < 1:
            raise ConfigError(f"must be in [0, 1), got {self.long_gap_share}", "scheduler.long_gap_share")
        if self.max_step_ms < 0:
            raise ConfigError("must be >= 0", "scheduler.max_step_ms")
        if self.priority_aging_s < 0:
            raise ConfigError("must be >= 0 (0: no aging)", "scheduler.priority_aging_s")
        if self.ttft_target_ms < 0:
            raise ConfigError("must be >= 0 (0: never)", "scheduler.ttft_target_ms")
        if self.background_slack < 0:
            raise ConfigError("must be >= 0", "scheduler.background_slack")
        if self.background_max_step_ms < 0:
            raise ConfigError("must be >= 0 (0: no bound)", "scheduler.background_max_step_ms")
        if self.background_grace_s < 0:
            raise ConfigError("must be >= 0", "scheduler.background_grace_s")
