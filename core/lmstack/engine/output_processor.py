"""The way out: sampled tokens into sequences, stop conditions, text and `RequestOutput`s.

Per sequence it keeps an incremental detokenizer, what was already streamed (so outputs carry
deltas), and how far the text was searched for stop strings. Text that could still grow into
a stop string is held back from streaming until it either completes one or cannot any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmstack.model.detokenizer import IncrementalDetokenizer
from lmstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lmstack.sample.sampler import Sampled
from lmstack.sequence import FinishReason, Request, Sequence, SequenceStatus


@dataclass
class _SeqText:
    detok: IncrementalDetokenizer
    emitted_text: int = 0
    emitted_tokens: int = 0
    stop_checked: int = 0  # text offset up to which stop strings were searched


def holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class OutputProcessor:
    """Owns the text side of every live sequence. Runs on the engine's thread."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._text: dict[int, _SeqText] = {}

    def add(self, seq: Sequence) -> None:
        """Start tracking a new sequence (a fresh request's or an n > 1 fork)."""
        req = seq.request
        self._text[seq.seq_id] = _SeqText(
            IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )
        )
        # A fork copies its parent's tokens: its detokenizer must have seen them too.
        if seq.num_output_tokens:
            self._text[seq.seq_id].detok.step(seq.output_token_ids)

    def release(self, req: Request) -> None:
        for seq in req.seqs:
            self._text.pop(seq.seq_id, None)

    def max_tokens(self, seq: Sequence) -> int:
        """The request's output budget: max_tokens, or whatever the context leaves."""
        mt = seq.request.params.max_tokens
        return mt if mt is not None else self.max_model_len - seq.prompt_len

    def room(self, seq: Sequence) -> int:
        """How many more tokens the sequence may emit before max_tokens or the context ends it."""
        return min(self.max_tokens(seq) - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    # --- tokens in ----------------------------------------------------------------------------

    def append(self, seq: Sequence, sampled: list[Sampled]) -> FinishReason | None:
        """Append tokens (with their logprobs when asked for) until one ends the sequence;
        returns why it ended, or None. Tokens after a stop are dropped."""
        params = seq.request.params
        state = self._text[seq.seq_id]
        for s in sampled:
            seq.token_ids.append(s.token_id)
            if params.logprobs is not None:
                seq.logprobs.append({s.token_id: s.logprob, **s.top_logprobs})
                seq.cumulative_logprob += s.logprob
            state.detok.step([s.token_id])
            reason = self._stop_reason(seq, state, s.token_id)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, seq: Sequence, state: _SeqText, tok: int) -> FinishReason | None:
        p = seq.request.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return FinishReason.STOP
            if tok in self.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP
            if p.stop:
                text = state.detok.text
                # Only the new tail can complete a stop string.
                start = max(0, state.stop_checked - max(len(s) for s in p.stop) + 1)
                hits = [(i, s) for i, s in ((text.find(s, start), s) for s in p.stop) if i >= 0]
                state.stop_checked = len(text)
                if hits:
                    i, s = min(hits)
                    seq.output_text = text[:i]
                    seq.stop_reason = s
                    return FinishReason.STOP
        if n_out >= self.max_tokens(seq) or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark the sequence finished and settle its final text."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.draft_token_ids = []
        state = self._text.get(seq.seq_id)
        if state is not None and not isinstance(seq.stop_reason, str):  # a stop string already cut it
            state.detok.flush()  # a character cut off mid-bytes shows as U+FFFD, as in a full decode
            seq.output_text = state.detok.text

    @staticmethod
    def record_prompt_logprobs(req: Request, logits: torch.Tensor, position: int) -> None:
        """logits: [count, V], the rows at prompt positions position .. position + count - 1;
        each predicts the prompt token after it."""
        count = logits.shape[0]
        lps = torch.log_softmax(logits.float(), dim=-1)
        top_n = req.params.prompt_logprobs or 0
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # the first prompt token has no context
        targets = req.prompt_token_ids[position + 1 : position + 1 + count]
        chosen = lps.gather(1, torch.tensor(targets, device=lps.device).view(-1, 1)).view(-1).tolist()
        tops = torch.topk(lps, top_n) if top_n else None
        for i, (tok, lp) in enumerate(zip(targets, chosen, strict=True)):
            entry = {tok: lp}
            if tops is not None:
                entry.update(zip(tops.indices[i].tolist(), tops.values[i].tolist(), strict=True))
            req.prompt_logprobs.append(entry)

    # --- outputs ------------------------------------------------------------------------------

    def make_output(self, req: Request) -> RequestOutput:
        """The request as it stands: full text and tokens per sample, plus what changed since
        the previous output of this request."""
        outs = [self._completion(req, seq) for seq in req.seqs]
        outs.sort(key=lambda o: o.index)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.is_finished,
            error=req.error,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            num_cached_tokens=req.num_cached_tokens,
            metrics=RequestMetrics(
                req.arrival_time,
                req.first_scheduled_time,
                req.first_token_time,
                req.finished_time,
                sum(s.num_preemptions for s in req.seqs),
            ),
        )

    def _completion(self, req: Request, seq: Sequence) -> CompletionOutput:
        state = self._text.get(seq.seq_id)
        if seq.is_finished or state is None:
            text = seq.output_text
        else:
            text = state.detok.text
            if req.params.stop:
                text = text[: len(text) - holdback(text, req.params.stop)]
        out_ids = seq.output_token_ids
        emitted_text = state.emitted_text if state else 0
        emitted_tok = state.emitted_tokens if state else 0
        if state:
            state.emitted_text, state.emitted_tokens = len(text), len(out_ids)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(out_ids),
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob,
            text_delta=text[emitted_text:],
            token_ids_delta=list(out_ids[emitted_tok:]),
        )
