"""The engine loop: schedule -> plan -> execute -> sample / verify -> outputs, one step at a time.

It wires the rooms that do the work: `InputProcessor` (requests in), `plan_step` (the step plan
and its logits rows), the executor's model runner (tensors, forward), `StepSampler` with the
`RejectionSampler` (tokens, draft verification) and `OutputProcessor` (stops, text, outputs)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pluggy
import torch

from lmstack.engine.input_processor import InputProcessor
from lmstack.engine.output_processor import OutputProcessor
from lmstack.engine.planner import PlannedStep, plan_step
from lmstack.outputs import EngineStats, RequestOutput
from lmstack.sample.grammar import GrammarCompiler
from lmstack.sample.sampler import Sampled, Sampler
from lmstack.sample.step_sampler import Choice, StepSampler
from lmstack.sample.verification import RejectionSampler
from lmstack.sampling_params import SamplingParams
from lmstack.sequence import FinishReason, Request, Sequence, SequenceStatus
from lmstack.spec.drafts import DraftBook
from lmstack.stack.build import build_stack
from lmstack.stack.prepare import StackSource, prepare_stack

Prompt = str | list[int]


class LLMEngine:
    """Owns the components of a resolved stack and runs the step loop. Not thread-safe: one
    thread drives it (`AsyncEngine` serialises access); only `make_request` and
    `grammar_compiler` may be called from other threads."""

    def __init__(self, stack: StackSource, *, plugin_manager: pluggy.PluginManager | None = None) -> None:
        # One pass through the stack (`lmstack.stack.prepare`): a caller that prepared it
        # (`lmstack serve`) hands over its plugins, resolution and open model.
        prepared = prepare_stack(stack, plugin_manager=plugin_manager)
        self.pm = prepared.plugin_manager
        self.stack = resolved = prepared.resolved
        self.models = prepared.models  # architectures: the checkpoint picked one
        self.source = prepared.source
        self.model_config = mc = self.source.config
        self.tokenizer = self.source.tokenizer

        built = build_stack(resolved, mc, self.models, source=self.source)
        self.components, self.executor, self.limits = built.components, built.executor, built.limits
        c = self.components
        self.quantizer, self.parallel = c["quantizer"], c["parallel"]
        self.prefill_backend, self.decode_backend = c["attention_prefill"], c["attention_decode"]
        self.allocator, self.scheduler, self.speculator = c["allocator"], c["scheduler"], c["speculator"]
        self.cache = c["cache"]
        # The cache the allocator reports to (None under cache `none`): it may move blocks
        # between tiers each step.
        self.block_cache = built.ctx.block_cache
        self.sampler = Sampler(mc.vocab_size, seed=resolved.config.seed)

        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.input_processor = InputProcessor(
            self.tokenizer, mc.vocab_size, self.limits, self.eos_token_ids, self.requests
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.step_sampler = StepSampler(self.sampler, RejectionSampler(self.sampler))
        # Every step's query tokens and wall time (the scheduler's step-time target reads it;
        # the draft policy keeps its own of decode-only steps, `DraftBook.step_timed`).
        self.step_cost = built.ctx.step_cost
        self.drafts = DraftBook(self.output_processor, self.speculator)
        # Target layers whose outputs each step returns at the sampled rows (a drafter that
        # conditions on target hidden states asks for them; `Speculator.observe` gets them).
        self.hidden_state_layers: tuple[int, ...] = tuple(getattr(self.speculator, "hidden_state_layers", ()))
        self.all_hidden_rows = getattr(self.speculator, "hidden_state_positions", "sampled") == "all"
        self._seq_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        blocks = self.allocator.num_blocks
        self.stats = EngineStats(0, 0, 0.0, blocks, blocks, 0, 0, 0, 0, 0)
        self.pm.hook.lmstack_engine_started(engine=self)

    # --- requests --------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this model (thread-safe). Raises
        InvalidRequestError if xgrammar is not installed."""
        return self.input_processor.grammar_compiler

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, **kw: Any) -> Request:
        """Validate and tokenize (keywords: request_id, priority, arrival_time, tenant,
        client_request_id); raises InvalidRequestError naming the field. Thread-safe."""
        return self.input_processor.make_request(prompt, params, **kw)

    def enqueue(self, req: Request) -> None:
        seq = self._new_seq(req, list(req.prompt_token_ids), 0)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, **kw: Any) -> str:
        req = self.make_request(prompt, params, **kw)
        self.enqueue(req)
        return req.request_id

    def _new_seq(self, req: Request, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, token_ids, index=index)
        req.seqs.append(seq)
        self.output_processor.add(seq)
        self.step_sampler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now. False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._abort_seqs(req)
        req.finished_time = time.monotonic()
        out = self.output_processor.make_output(req)
        self._pending_outputs.append(out)
        self._retire(req, out)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    # --- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that changed."""
        started = time.perf_counter()
        self.drafts.propose(self.speculator, self.scheduler.running_seqs())
        sched = self.scheduler.schedule()
        outputs, self._pending_outputs = self._pending_outputs, []
        if sched.is_empty:
            return outputs
        now = time.monotonic()
        planned = plan_step(
            sched.scheduled,
            sched.blocks_to_copy,
            self.allocator.block_table,
            self.hidden_state_layers,
            self.all_hidden_rows,
        )
        if self.block_cache is not None:
            planned.plan.swap_in, planned.plan.swap_out = self.block_cache.take_transfers()
        result = self.executor.execute(planned.plan)
        if self.all_hidden_rows and result.hidden_states:
            rows = next(iter(result.hidden_states.values())).shape[0]
            if rows != planned.plan.num_tokens:
                raise RuntimeError(
                    f"the executor returned hidden states at {rows} rows, not at all "
                    f"{planned.plan.num_tokens} of the step (StepPlan.hidden_state_rows): this "
                    "parallel layout cannot serve a speculator that reads every position's state"
                )
        if planned.plan.swap_out:
            self.block_cache.offloaded(planned.plan.swap_out, result.swapped_out)
        for item in sched.scheduled:
            seq, req = item.seq, item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                # Before the first step only a prefix cache (attach_cached_prefix) advances it.
                req.num_cached_tokens = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens <= seq.prompt_len:
                self.stats.prompt_tokens += item.num_tokens
        for r in planned.prompt_logprobs:
            rows = result.logits[r.logits_index : r.logits_index + r.count]
            self.output_processor.record_prompt_logprobs(r.request, rows, r.position)
        touched: dict[str, Request] = {}
        self._sample(planned, result.logits, result.hidden_states, touched)
        elapsed = time.perf_counter() - started
        self.step_cost.record(sched.num_batched_tokens, elapsed)
        self.drafts.step_timed(sched.num_batched_tokens, elapsed)
        self.drafts.step_done(self.speculator)
        self.stats.num_steps += 1
        self.stats.spec_decode_draft_length = self.drafts.policy.last_mean_limit
        done = time.monotonic()
        for req in touched.values():
            if req.is_finished and req.finished_time is None:
                req.finished_time = done
            out = self.output_processor.make_output(req)
            outputs.append(out)
            if req.is_finished:
                self._retire(req, out)
        self.pm.hook.lmstack_step_finished(engine=self, stats=self.get_stats())
        return outputs

    def _sample(
        self,
        planned: PlannedStep,
        logits: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        touched: dict[str, Request],
    ) -> None:
        choices: list[Choice] = []
        span_of: dict[int, int] = {}  # a forked sample's seq_id -> the seq_id whose rows it shares
        for row in planned.samples:
            seq, req = row.seq, row.seq.request
            if row.drafts:
                choices.append(Choice(seq, row.logits_index, self.drafts.take(seq, row.drafts)))
                continue
            for i in range(len(req.seqs), req.params.n):  # prefill done: fork the other samples now
                child = self._new_seq(req, list(seq.token_ids), i)
                child.num_computed_tokens, child.status = seq.num_computed_tokens, SequenceStatus.RUNNING
                span_of[child.seq_id] = seq.seq_id
                self.allocator.fork(seq, child)
                self.scheduler.add(child)
                choices.append(Choice(child, row.logits_index))
            choices.append(Choice(seq, row.logits_index))
        for choice, result in zip(choices, self.step_sampler.choose(choices, logits), strict=True):
            seq = choice.seq
            if seq.is_finished:  # a sibling's failing processor already ended the request
                continue
            if result.error is not None:
                self._fail(seq, result.error, touched)
                continue
            drafted = len(choice.draft) if choice.draft else 0
            if choice.draft:
                # The KV of rejected drafts is dropped: the cache keeps the tokens before the
                # first rejection (accepted drafts included); the final token is computed next step.
                seq.num_computed_tokens = seq.num_tokens + result.num_accepted
                self.allocator.truncate(seq, seq.num_computed_tokens)
                seq.draft_token_ids = []
                self.stats.num_draft_tokens += drafted
                self.stats.num_accepted_tokens += result.num_accepted
                self.stats.spec_decode_accepted_lengths[result.num_accepted] = (
                    self.stats.spec_decode_accepted_lengths.get(result.num_accepted, 0) + 1
                )
            start = seq.num_tokens - 1  # the newest token's position, before this step's
            appended = self._append(seq, result.tokens, touched)
            if self.all_hidden_rows:
                span = planned.spans[span_of.get(seq.seq_id, seq.seq_id)]
                start = span.position
                kept = span.num_tokens - drafted + result.num_accepted  # a prompt chunk, or 1 + accepted
                states = {layer: h[span.row : span.row + kept] for layer, h in hidden.items()}
            else:
                first = choice.logits_index
                states = {layer: h[first : first + result.num_accepted + 1] for layer, h in hidden.items()}
            self.drafts.verified(seq, drafted, result.num_accepted, appended, states, start)
        if self.all_hidden_rows and hidden:
            # Prompt chunks that stop short of the prompt's end sample nothing, but a drafter
            # reading every position's state still needs theirs.
            sampled = {row.seq.seq_id for row in planned.samples}
            for span in planned.spans.values():
                if span.seq.seq_id in sampled or span.seq.is_finished:
                    continue
                rows = slice(span.row, span.row + span.num_tokens)
                self.drafts.verified(
                    span.seq, 0, 0, [], {k: h[rows] for k, h in hidden.items()}, span.position
                )

    def _append(self, seq: Sequence, sampled: list[Sampled], touched: dict[str, Request]) -> list[int]:
        """Append the step's tokens (a stop may keep fewer); returns those appended."""
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        touched[req.request_id] = req
        before = seq.num_tokens
        reason = self.output_processor.append(seq, sampled)
        self.stats.generation_tokens += seq.num_tokens - before
        if reason is not None:
            self._finish(seq, reason)
        return seq.token_ids[before:]

    def _fail(self, seq: Sequence, error: str, touched: dict[str, Request]) -> None:
        req = seq.request
        req.error = error
        touched[req.request_id] = req
        self._abort_seqs(req)

    def _abort_seqs(self, req: Request) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.output_processor.finish(seq, reason)
        self.scheduler.finish(seq)
        key = reason.value
        self.stats.finished_by_reason[key] = self.stats.finished_by_reason.get(key, 0) + 1

    def _retire(self, req: Request, output: RequestOutput) -> None:
        self.requests.pop(req.request_id, None)
        self.output_processor.release(req)
        for seq in req.seqs:
            self.step_sampler.drop(seq)
            self.drafts.drop(seq)
        self.stats.num_finished += 1
        self.pm.hook.lmstack_request_finished(engine=self, output=output)

    # --- metrics ---------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """A snapshot of the metrics: a copy that later steps leave as it is."""
        s, sched = self.stats, self.scheduler
        s.num_running, s.num_waiting = sched.num_running(), sched.num_waiting()
        s.num_preemptions = sched.num_preemptions
        s.num_free_kv_blocks, s.kv_usage = self.allocator.num_free_blocks(), self.allocator.usage()
        return s.snapshot()

    def shutdown(self) -> None:
        self.cache.close()
        self.executor.shutdown()
