"""Turns logits into tokens, one row per sampling sequence, without rows affecting each other.

Per row: the grammar mask (structured output), logits processors and allowed-token sets (this
sequence only), repetition / presence / frequency penalties, min_tokens (end tokens masked), then
greedy or temperature + top-k + top-p + min-p sampling. A seeded row draws its noise from a
generator keyed by (seed, sample index, output position), so its tokens do not depend on the batch
it shares, on preemption, or on how many steps it took to get there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmstack.model.layer_ops import argmax_rows
from lmstack.sample.grammar import GrammarError
from lmstack.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lmstack.sample.grammar import GrammarState


@dataclass
class SampleRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (what penalties and processors see)
    prompt_len: int
    sample_index: int  # which of the request's n samples (seeds differ per sample)
    stop_ids: frozenset[int] = frozenset()  # masked while fewer than min_tokens were produced
    error: str | None = None  # set when this row's own processing failed
    grammar: GrammarState | None = None  # structured output: this sequence's grammar position

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = field(default_factory=dict)


_NEG_INF = float("-inf")


def _seed_for(row: SampleRow) -> int:
    # Distinct streams per (seed, sample, position); stays in int64 range.
    return (row.params.seed * 1_000_003 + row.sample_index * 7_919 + row.num_output) % (2**63 - 1)


def needs_processing(row: SampleRow) -> bool:
    """Whether anything edits the row's logits before it samples (a grammar, a processor, a
    penalty, min_tokens holding back its stop tokens)."""
    p = row.params
    return bool(
        row.grammar is not None
        or p.logits_processors
        or p.allowed_token_ids is not None
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or (row.num_output < p.min_tokens and row.stop_ids)
    )


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def _process_row(self, logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
        """Row-local logit edits, applied in place on a row of a batch copy."""
        p = row.params
        if row.grammar is not None:
            # First, so processors and penalties only ever see the tokens the grammar allows.
            row.grammar.apply(logits, row.token_ids[row.prompt_len :])
        for proc in p.logits_processors:
            logits = proc(row.token_ids, logits)
        if p.allowed_token_ids is not None:
            mask = torch.full_like(logits, _NEG_INF)
            idx = torch.tensor(p.allowed_token_ids, device=logits.device)
            mask[idx] = 0.0
            logits = logits + mask
        if p.repetition_penalty != 1.0 and row.token_ids:
            seen = torch.tensor(sorted(set(row.token_ids)), device=logits.device)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.num_output > 0:
            out = torch.tensor(row.token_ids[row.prompt_len :], device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if row.num_output < p.min_tokens and row.stop_ids:
            logits[torch.tensor(sorted(row.stop_ids), device=logits.device)] = _NEG_INF
        return logits

    @staticmethod
    def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on one row; returns probabilities."""
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, _NEG_INF)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()

    def _draw(self, probs: torch.Tensor, row: SampleRow) -> int:
        """Exponential race: argmax(p / E) with E ~ Exp(1) is a sample from p."""
        gen = self.generator if row.params.seed is None else torch.Generator().manual_seed(_seed_for(row))
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen).to(probs.device)
        return int(torch.argmax(probs / noise))

    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The logits each row samples from (processors, masks and penalties applied)."""
        todo = [i for i, row in enumerate(rows) if needs_processing(row)]
        if not todo:
            return logits.float()
        logits = logits.float().clone()  # the caller's tensor stays untouched
        for i in todo:
            row = rows[i]
            try:
                logits[i] = self._process_row(logits[i], row)
            except Exception as exc:  # a user-supplied processor must not fail the batch
                what = "structured output" if isinstance(exc, GrammarError) else "logits processor"
                row.error = f"{what} failed: {type(exc).__name__}: {exc}"
        return logits

    def probs(self, logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution a processed row samples from (one-hot for greedy)."""
        if params.greedy:
            return torch.nn.functional.one_hot(logits_row.argmax(), logits_row.shape[0]).float()
        return self._filter(logits_row, params)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
        """logits: [N, V], one row per entry of `rows`."""
        logits = self.process(logits, rows)
        if all(r.params.greedy and r.params.logprobs is None for r in rows):
            # The common greedy batch: one argmax over it, no per-row work.
            return [Sampled(tok, 0.0) for tok in argmax_rows(logits).tolist()]
        greedy = argmax_rows(logits).tolist()
        need_lp = [r.params.logprobs is not None for r in rows]
        logprobs = torch.log_softmax(logits, dim=-1) if any(need_lp) else None
        out: list[Sampled] = []
        for i, row in enumerate(rows):
            p = row.params
            tok = greedy[i] if p.greedy else self._draw(self._filter(logits[i], p), row)
            out.append(
                self.with_logprobs(
                    tok, logprobs[i] if logprobs is not None and need_lp[i] else None, p.logprobs or 0
                )
            )
        return out

    @staticmethod
    def with_logprobs(tok: int, logprobs: torch.Tensor | None, top_n: int) -> Sampled:
        """`tok` with its logprob and the `top_n` best alternatives from a processed row's
        log-softmax (`logprobs`: [V]; None when the request wants no logprobs)."""
        if logprobs is None:
            return Sampled(tok, 0.0)
        top: dict[int, float] = {}
        if top_n:
            vals, ids = torch.topk(logprobs, top_n)
            top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        return Sampled(tok, float(logprobs[tok]), top)
