"""Splitting one step's plan into micro-batches that follow each other through the pipeline.

Cuts fall between sequences (a sequence's query stays in one micro-batch), as even in tokens as
the sequences allow; the plan's order is kept, so decodes still come first in each micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmstack.batch import SeqPlan, StepPlan


@dataclass
class MicroBatch:
    plan: StepPlan
    # Positions in the step's `logits_indices` whose rows this micro-batch computes, in the
    # order of its own `plan.logits_indices`.
    rows: list[int] = field(default_factory=list)


def split_points(lengths: list[int], parts: int) -> list[int]:
    """Boundaries [0, ..., len(lengths)] cutting `lengths` into at most `parts` non-empty
    contiguous groups whose sums are close to equal."""
    n = len(lengths)
    parts = max(1, min(parts, n))
    total = sum(lengths)
    bounds = [0]
    done = 0
    for i, length in enumerate(lengths[:-1]):
        done += length
        groups_left = parts - len(bounds)  # cuts still to place
        seqs_left = n - (i + 1)
        if groups_left and (done * parts >= total * len(bounds) or seqs_left == groups_left):
            bounds.append(i + 1)
    bounds.append(n)
    return bounds


def split_plan(plan: StepPlan, parts: int) -> list[MicroBatch]:
    """`plan` as up to `parts` micro-batches. Block copies and swap-ins ride with the first
    (they must land before any micro-batch reads the cache), swap-outs with the last."""
    bounds = split_points([len(s.token_ids) for s in plan.seqs], parts)
    starts = [0]
    for s in plan.seqs:
        starts.append(starts[-1] + len(s.token_ids))
    batches: list[MicroBatch] = []
    for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        seqs: list[SeqPlan] = plan.seqs[a:b]
        t0, t1 = starts[a], starts[b]
        first, last = j == 0, b == len(plan.seqs)
        mb = MicroBatch(
            StepPlan(
                seqs=seqs,
                logits_indices=[],
                blocks_to_copy=list(plan.blocks_to_copy) if first else [],
                hidden_state_layers=tuple(plan.hidden_state_layers),
                swap_in=list(plan.swap_in) if first else [],
                swap_out=list(plan.swap_out) if last else [],
            )
        )
        for pos, row in enumerate(plan.logits_indices):
            if t0 <= row < t1:
                mb.plan.logits_indices.append(row - t0)
                mb.rows.append(pos)
        batches.append(mb)
    return batches
