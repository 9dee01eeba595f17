"""The engine loop: schedule -> execute -> sample -> postprocess, one step at a time."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

import pluggy
import torch

from lmstack.batch import AttentionMetadata, ModelInput
from lmstack.config import StackConfig, load_stack
from lmstack.errors import InvalidRequestError
from lmstack.executor import ExecutorSpec
from lmstack.grammar import GrammarCompiler, GrammarState
from lmstack.interfaces import BuildContext, EngineLimits, ScheduledSeq
from lmstack.model.architecture import build_model_registry
from lmstack.model.detokenizer import IncrementalDetokenizer
from lmstack.model.source import open_model_source
from lmstack.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from lmstack.plugins import build_registry, make_plugin_manager
from lmstack.resolve import ResolvedStack, check_model, resolve
from lmstack.sampler import Sampled, Sampler, SampleRow
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import FinishReason, Request, Sequence, SequenceStatus

StackSource = str | PathLike | Mapping[str, Any] | StackConfig | ResolvedStack


@dataclass
class _SeqState:
    """Per-sequence text state: incremental detokenizer and what was already streamed."""

    detok: IncrementalDetokenizer
    emitted_text: int = 0
    emitted_tokens: int = 0
    stop_checked: int = 0  # text offset up to which stop strings were searched
    grammar: GrammarState | None = None  # structured output: where this sequence is in its grammar


@dataclass
class _StepRow:
    """A logits row the step samples from."""

    seq: Sequence
    logits_index: int
    drafts: list[int] = field(default_factory=list)


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class LLMEngine:
    """Owns the components of a resolved stack and runs the step loop. Not thread-safe: one
    thread drives it (`AsyncEngine` serialises access)."""

    def __init__(self, stack: StackSource, *, plugin_manager: pluggy.PluginManager | None = None) -> None:
        self.pm = plugin_manager or make_plugin_manager()
        if isinstance(stack, ResolvedStack):
            resolved = stack
        else:
            cfg = stack if isinstance(stack, StackConfig) else load_stack(stack)
            resolved = resolve(cfg, build_registry(self.pm))
        self.stack = resolved
        self.models = build_model_registry(self.pm)  # architectures: the checkpoint picks one
        self.source = open_model_source(resolved.model, models=self.models)
        self.model_config = mc = self.source.config
        check_model(resolved, mc)  # before any weight loads
        self.tokenizer = self.source.tokenizer

        ctx = BuildContext(mc, resolved.device, resolved.dtype, resolved.kv_cache_dtype)

        def build(sel):
            return sel.component.factory(sel.options, ctx)

        self.quantizer = build(resolved.quantizer)
        self.prefill_backend = build(resolved.attention_prefill)
        same = (
            resolved.attention_decode.component is resolved.attention_prefill.component
            and resolved.attention_decode.options == resolved.attention_prefill.options
        )
        self.decode_backend = self.prefill_backend if same else build(resolved.attention_decode)
        self.parallel = build(resolved.parallel)
        max_pos = min(mc.max_position_embeddings, resolved.config.max_model_len or mc.max_position_embeddings)
        self.executor = self.parallel.create_executor(
            ExecutorSpec(
                model=resolved.model,
                model_config=mc,
                dtype=resolved.dtype,
                device=resolved.device,
                kv_cache_dtype=resolved.kv_cache_dtype,
                max_positions=max_pos,
                quantizer=self.quantizer,
                prefill=self.prefill_backend,
                decode=self.decode_backend,
                stack=resolved,
                models=self.models,
            )
        )
        self.executor.load_model()

        block_size = getattr(resolved.allocator.options, "block_size", 16)
        ctx.kv_bytes_per_block = self.executor.kv_cache_bytes_per_block(block_size)
        self.allocator = build(resolved.allocator)
        self.executor.init_kv_cache(self.allocator.num_blocks, self.allocator.block_size)

        sched_opts = resolved.scheduler.options
        self.limits = EngineLimits(
            max_model_len=min(max_pos, self.allocator.num_blocks * self.allocator.block_size),
            max_num_seqs=getattr(sched_opts, "max_num_seqs", 256),
            max_num_batched_tokens=getattr(sched_opts, "max_num_batched_tokens", 2048),
        )
        ctx.limits, ctx.allocator = self.limits, self.allocator
        self.scheduler = build(resolved.scheduler)
        self.speculator = build(resolved.speculator)
        self.sampler = Sampler(mc.vocab_size, seed=resolved.config.seed)

        self.requests: dict[str, Request] = {}
        self._states: dict[int, _SeqState] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._eos = frozenset(mc.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.stats = EngineStats(
            0, 0, 0.0, self.allocator.num_blocks, self.allocator.num_blocks, 0, 0, 0, 0, 0
        )
        self.pm.hook.lmstack_engine_started(engine=self)

    # --- requests --------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this model (created on first use; thread-safe,
        so request handlers may compile schemas while the engine thread steps). Raises
        InvalidRequestError if xgrammar is not installed."""
        if self._grammar_compiler is None:
            with self._grammar_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer, self.model_config.vocab_size, self._eos
                    )
        return self._grammar_compiler

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize; raises InvalidRequestError naming the field. Thread-safe."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            if not ids:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt"
                )
        limit = self.max_model_len
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
        if params.grammar is not None and params.grammar.vocab_size != self.model_config.vocab_size:
            raise InvalidRequestError(
                "grammar was compiled for another model (use this engine's grammar_compiler)", param="grammar"
            )
        if params.n > self.limits.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds the scheduler's max_num_seqs ({self.limits.max_num_seqs})", param="n"
            )
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        req = Request(rid, ids, params, priority=priority, prompt=text)
        req.stop_ids = (frozenset() if params.ignore_eos else self._eos) | frozenset(params.stop_token_ids)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req

    def enqueue(self, req: Request) -> None:
        seq = self._new_seq(req, list(req.prompt_token_ids), 0)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, **kw: Any) -> str:
        req = self.make_request(prompt, params, **kw)
        self.enqueue(req)
        return req.request_id

    def _new_seq(self, req: Request, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, token_ids, index=index)
        req.seqs.append(seq)
        grammar = req.params.grammar
        self._states[seq.seq_id] = _SeqState(
            IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            ),
            # Every sequence, n > 1 forks included, walks the grammar on its own.
            grammar=grammar.new_state() if grammar is not None else None,
        )
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now. False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        self._pending_outputs.append(self._output(req))
        self._retire(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    # --- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that changed."""
        self._propose_drafts()
        sched = self.scheduler.schedule()
        outputs, self._pending_outputs = self._pending_outputs, []
        if sched.is_empty:
            return outputs
        now = time.monotonic()
        rows, prompt_rows, model_input = self._prepare(sched.scheduled, sched.blocks_to_copy)
        result = self.executor.execute(model_input)
        touched: dict[str, Request] = {}
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            if item.seq.request.first_scheduled_time is None:
                item.seq.request.first_scheduled_time = now
            if item.seq.num_computed_tokens <= item.seq.prompt_len:
                self.stats.prompt_tokens += item.num_tokens
        self._record_prompt_logprobs(prompt_rows, result.logits)
        self._sample(rows, result.logits, touched)
        self.stats.num_steps += 1
        for req in touched.values():
            outputs.append(self._output(req))
            if req.is_finished:
                self._retire(req)
        self._refresh_stats()
        self.pm.hook.lmstack_step_finished(engine=self, stats=self.stats)
        return outputs

    def _propose_drafts(self) -> None:
        if not self.speculator.num_draft_tokens:
            return
        decoding = [s for s in self.scheduler.running_seqs() if s.num_uncomputed_tokens == 1]
        if not decoding:
            return
        proposals = self.speculator.propose(decoding)
        for seq in decoding:
            drafts = proposals.get(seq.seq_id, [])
            # Never draft past max_tokens or the context.
            room = min(self._max_tokens(seq) - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            seq.draft_token_ids = list(drafts[: max(0, room)])

    def _max_tokens(self, seq: Sequence) -> int:
        mt = seq.request.params.max_tokens
        return mt if mt is not None else self.max_model_len - seq.prompt_len

    def _prepare(
        self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]
    ) -> tuple[list[_StepRow], ModelInput]:
        # Decodes (query length 1) first, so kernels can split the batch.
        order = sorted(scheduled, key=lambda s: s.num_tokens != 1)
        ids: list[int] = []
        pos: list[int] = []
        rows: list[_StepRow] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (request, logits row, position, count)
        logits_idx: list[int] = []
        for item in order:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n]
            if len(tokens) < n:  # the query runs on into this step's drafts
                tokens += seq.draft_token_ids[: n - len(tokens)]
            base = len(ids)
            ids += tokens
            pos += range(start, start + n)
            req = seq.request
            if req.params.prompt_logprobs is not None and seq.index == 0:
                # Rows at prompt positions p predict prompt token p + 1; a recompute after
                # preemption skips the positions already recorded.
                first_pos = max(start, len(req.prompt_logprobs or [None]) - 1)
                last_pos = min(start + n, seq.prompt_len - 1)
                if first_pos < last_pos:
                    prompt_rows.append((req, len(logits_idx), first_pos, last_pos - first_pos))
                    logits_idx += range(base + first_pos - start, base + last_pos - start)
            if start + n >= seq.num_tokens:  # the step reaches the newest token: sample
                first = base + (seq.num_tokens - 1 - start)
                drafts = seq.draft_token_ids if start + n == seq.num_tokens + len(seq.draft_token_ids) else []
                rows.append(_StepRow(seq, len(logits_idx), drafts))
                logits_idx += range(first, first + 1 + len(drafts))
            else:
                seq.draft_token_ids = []
        attn = AttentionMetadata.build(
            [s.num_tokens for s in order],
            [s.seq.num_computed_tokens for s in order],
            [self.allocator.block_table(s.seq) for s in order],
            self.allocator.block_size,
            device=self.stack.device,
        )
        dev = self.stack.device
        return (
            rows,
            prompt_rows,
            ModelInput(
                input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                positions=torch.tensor(pos, dtype=torch.long, device=dev),
                attn=attn,
                logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
                blocks_to_copy=copies,
            ),
        )

    @staticmethod
    def _record_prompt_logprobs(
        prompt_rows: list[tuple[Request, int, int, int]], logits: torch.Tensor
    ) -> None:
        for req, row, position, count in prompt_rows:
            lps = torch.log_softmax(logits[row : row + count].float(), dim=-1)
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

    def _row(self, seq: Sequence, extra: list[int] = ()) -> SampleRow:  # type: ignore[assignment]
        req = seq.request
        tokens = seq.token_ids + list(extra) if extra else seq.token_ids  # read-only for the sampler
        # The grammar state syncs itself to `tokens` (accept, roll back or replay), so the draft
        # tokens `_verify` passes in `extra` need nothing special here.
        grammar = self._states[seq.seq_id].grammar
        return SampleRow(req.params, tokens, seq.prompt_len, seq.index, req.stop_ids, grammar=grammar)

    def _sample(self, rows: list[_StepRow], logits: torch.Tensor, touched: dict[str, Request]) -> None:
        plain: list[tuple[Sequence, int]] = []  # (sequence, logits row)
        for row in rows:
            seq, req = row.seq, row.seq.request
            if row.drafts:
                self._verify(row, logits, touched)
                continue
            if len(req.seqs) < req.params.n:  # prefill done: fork the other samples now
                for i in range(len(req.seqs), req.params.n):
                    child = self._new_seq(req, list(seq.token_ids), i)
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.status = SequenceStatus.RUNNING
                    self.allocator.fork(seq, child)
                    self.scheduler.add(child)
                    plain.append((child, row.logits_index))
            plain.append((seq, row.logits_index))
        if not plain:
            return
        idx = torch.tensor([i for _, i in plain], device=logits.device)
        sample_rows = [self._row(s) for s, _ in plain]
        sampled = self.sampler.sample(logits[idx], sample_rows)
        for (seq, _), s, r in zip(plain, sampled, sample_rows, strict=True):
            if r.error is not None:  # this request's own processor failed: only it ends
                self._fail(seq, r.error, touched)
            else:
                self._append(seq, [s], touched)

    def _fail(self, seq: Sequence, error: str, touched: dict[str, Request]) -> None:
        req = seq.request
        req.error = error
        touched[req.request_id] = req
        for s in req.seqs:
            if not s.is_finished:
                self._finish(s, FinishReason.ABORT)

    def _verify(self, row: _StepRow, logits: torch.Tensor, touched: dict[str, Request]) -> None:
        """Lossless verification of a deterministic drafter's tokens (q one-hot): accept draft x
        with probability p(x); on rejection sample from p with x removed; all accepted ->
        one bonus token from p. Greedy: accept while the draft equals the argmax."""
        seq = row.seq
        accepted: list[Sampled] = []
        for j in range(len(row.drafts) + 1):
            sample_row = self._row(seq, [s.token_id for s in accepted])
            raw = logits[row.logits_index + j : row.logits_index + j + 1]
            if j == len(row.drafts):  # every draft accepted: a bonus token from the target
                accepted.append(self.sampler.sample(raw, [sample_row])[0])
                break
            lg = self.sampler.process(raw, [sample_row])[0]
            if sample_row.error is not None:
                self._fail(seq, sample_row.error, touched)
                return
            draft = row.drafts[j]
            p = self.sampler.probs(lg, seq.request.params)
            if seq.request.params.greedy:
                ok = bool(p[draft] > 0)
            else:
                gen = (
                    torch.Generator().manual_seed(
                        hash((seq.request.params.seed, seq.index, seq.num_output_tokens + j)) & 0x7FFFFFFF
                    )
                    if seq.request.params.seed is not None
                    else self.sampler.generator
                )
                ok = float(torch.rand((), generator=gen)) < float(p[draft])
            if ok:
                accepted.append(Sampled(draft, float(torch.log_softmax(lg, -1)[draft])))
                continue
            residual = p.clone()
            residual[draft] = 0.0
            if residual.sum() <= 0:
                residual = p
            tok = (
                int(torch.multinomial(residual / residual.sum(), 1, generator=self.sampler.generator))
                if not seq.request.params.greedy
                else int(lg.argmax())
            )
            accepted.append(Sampled(tok, float(torch.log_softmax(lg, -1)[tok])))
            break
        # The KV of rejected drafts is dropped: the cache holds the tokens before the first
        # rejection (accepted drafts included); the final token is computed next step.
        n_kept = len(accepted) - 1
        seq.num_computed_tokens = seq.num_tokens + n_kept
        self.allocator.truncate(seq, seq.num_computed_tokens)
        seq.draft_token_ids = []
        self.stats.num_draft_tokens += len(row.drafts)
        self.stats.num_accepted_tokens += n_kept
        self._append(seq, accepted, touched)

    def _append(self, seq: Sequence, sampled: list[Sampled], touched: dict[str, Request]) -> None:
        req = seq.request
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        touched[req.request_id] = req
        state = self._states[seq.seq_id]
        for s in sampled:
            seq.token_ids.append(s.token_id)
            self.stats.generation_tokens += 1
            if p.logprobs is not None:
                seq.logprobs.append({s.token_id: s.logprob, **s.top_logprobs})
                seq.cumulative_logprob += s.logprob
            state.detok.step([s.token_id])
            reason = self._stop_reason(seq, state, s.token_id)
            if reason is not None:
                self._finish(seq, reason)
                return

    def _stop_reason(self, seq: Sequence, state: _SeqState, tok: int) -> FinishReason | None:
        p = seq.request.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return FinishReason.STOP
            if tok in self._eos and not p.ignore_eos:
                return FinishReason.STOP
            if p.stop:
                text = state.detok.text
                # Only the new tail can complete a stop string.
                start = max(0, state.stop_checked - max(len(s) for s in p.stop) + 1)
                hits = [(text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                state.stop_checked = len(text)
                if hits:
                    i, s = min(hits)
                    seq.output_text = text[:i]
                    seq.stop_reason = s
                    return FinishReason.STOP
        if n_out >= self._max_tokens(seq) or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.draft_token_ids = []
        self.scheduler.finish(seq)
        if not isinstance(seq.stop_reason, str):  # a stop string already cut the text
            detok = self._states[seq.seq_id].detok
            detok.flush()  # a character cut off mid-bytes shows as U+FFFD, as in a full decode
            seq.output_text = detok.text
        key = reason.value
        self.stats.finished_by_reason[key] = self.stats.finished_by_reason.get(key, 0) + 1

    def _retire(self, req: Request) -> None:
        if req.finished_time is None:
            req.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._states.pop(seq.seq_id, None)
        self.stats.num_finished += 1
        self.pm.hook.lmstack_request_finished(engine=self, output=req)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            state = self._states.get(seq.seq_id)
            if seq.is_finished:
                text = seq.output_text
            else:
                text = state.detok.text
                stops = req.params.stop
                if stops:
                    text = text[: len(text) - _holdback(text, stops)]
            out_ids = seq.output_token_ids
            emitted_text = state.emitted_text if state else 0
            emitted_tok = state.emitted_tokens if state else 0
            outs.append(
                CompletionOutput(
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
            )
            if state:
                state.emitted_text, state.emitted_tokens = len(text), len(out_ids)
        outs.sort(key=lambda o: o.index)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.is_finished,
            error=req.error,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            metrics=RequestMetrics(
                req.arrival_time,
                req.first_scheduled_time,
                req.first_token_time,
                req.finished_time,
                sum(s.num_preemptions for s in req.seqs),
            ),
        )

    # --- metrics ---------------------------------------------------------------------------

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = self.scheduler.num_running()
        s.num_waiting = self.scheduler.num_waiting()
        s.num_free_kv_blocks = self.allocator.num_free_blocks()
        s.kv_usage = self.allocator.usage()
        s.num_preemptions = self.scheduler.num_preemptions

    def get_stats(self) -> EngineStats:
        self._refresh_stats()
        return self.stats

    def shutdown(self) -> None:
        self.executor.shutdown()
