"""From the scheduler's choice to a `StepPlan`, and which logits rows the engine reads back.

The plan holds only ints and lists (the model runner builds tensors from it on its own
device); the rows say, for each sequence that samples this step and each prompt-logprob slice,
where in the returned logits its rows start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lmstack.batch import SeqPlan, StepPlan
from lmstack.interfaces import ScheduledSeq
from lmstack.sequence import Request, Sequence


@dataclass
class SampleRows:
    """A sequence that samples this step: logits rows [logits_index, + 1 + len(drafts))."""

    seq: Sequence
    logits_index: int
    drafts: list[int] = field(default_factory=list)  # verified against rows 0..len(drafts) - 1


@dataclass
class PromptLogprobRows:
    """Rows [logits_index, + count) predict prompt tokens position + 1 .. position + count."""

    request: Request
    logits_index: int
    position: int
    count: int


@dataclass
class Span:
    """Where a scheduled sequence's query sits: rows [row, row + num_tokens) of the flattened
    batch, positions from `position`."""

    seq: Sequence
    row: int
    num_tokens: int
    position: int


@dataclass
class PlannedStep:
    plan: StepPlan
    samples: list[SampleRows]
    prompt_logprobs: list[PromptLogprobRows]
    # seq_id -> where each scheduled sequence's rows are (hidden states at every position).
    spans: dict[int, Span] = field(default_factory=dict)


def plan_step(
    scheduled: list[ScheduledSeq],
    blocks_to_copy: list[tuple[int, int]],
    block_table: Callable[[Sequence], list[int]],
    hidden_state_layers: tuple[int, ...] = (),
    all_hidden_rows: bool = False,
) -> PlannedStep:
    """Lay out one step. A sequence whose query stops short of its newest token (a prefill
    chunk) does not sample, and drafts it had can no longer be verified: they are dropped.
    `all_hidden_rows`: the hidden states come back at every row, not only the sampled ones."""
    # Decodes (query length 1) first, so kernels can split the batch.
    order = sorted(scheduled, key=lambda s: s.num_tokens != 1)
    seqs: list[SeqPlan] = []
    samples: list[SampleRows] = []
    prompt_rows: list[PromptLogprobRows] = []
    logits_idx: list[int] = []
    base = 0  # the sequence's first row in the flattened batch
    spans: dict[int, Span] = {}
    for item in order:
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        spans[seq.seq_id] = Span(seq, base, n, start)
        tokens = seq.token_ids[start : start + n]
        if len(tokens) < n:  # the query runs on into this step's drafts
            tokens += seq.draft_token_ids[: n - len(tokens)]
        seqs.append(SeqPlan(tokens, start, block_table(seq)))
        req = seq.request
        if req.params.prompt_logprobs is not None and seq.index == 0:
            # Rows at prompt positions p predict prompt token p + 1; a recompute after
            # preemption skips the positions already recorded.
            first_pos = max(start, len(req.prompt_logprobs or [None]) - 1)
            last_pos = min(start + n, seq.prompt_len - 1)
            if first_pos < last_pos:
                prompt_rows.append(PromptLogprobRows(req, len(logits_idx), first_pos, last_pos - first_pos))
                logits_idx += range(base + first_pos - start, base + last_pos - start)
        if start + n >= seq.num_tokens:  # the step reaches the newest token: sample
            first = base + (seq.num_tokens - 1 - start)
            drafts = seq.draft_token_ids if start + n == seq.num_tokens + len(seq.draft_token_ids) else []
            samples.append(SampleRows(seq, len(logits_idx), list(drafts)))
            logits_idx += range(first, first + 1 + len(drafts))
        else:
            seq.draft_token_ids = []
        base += n
    plan = StepPlan(seqs, logits_idx, list(blocks_to_copy), tuple(hidden_state_layers))
    if all_hidden_rows and hidden_state_layers:
        plan.hidden_state_rows = list(range(base))
    return PlannedStep(plan, samples, prompt_rows, spans)
