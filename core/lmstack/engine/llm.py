"""`LLM`: the offline API — generate or chat over a batch of prompts, run to completion."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from lmstack.engine.llm_engine import LLMEngine, StackSource
from lmstack.outputs import EngineStats, RequestOutput
from lmstack.sample.grammar import Grammar
from lmstack.sampling_params import SamplingParams
from lmstack.stack.config import load_stack

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """`LLM(stack)` with a stack file path, a mapping, a `StackConfig`, or a model alone (a known
    name, a .gguf file, a Hugging Face folder or Hub id); or, as vLLM's, `LLM(model="org/name")`.
    Other keywords set the stack's top-level keys over it, as `--set` does (`dtype="float32"`,
    `scheduler={"name": "continuous", "max_num_seqs": 8}`: a section given replaces the stack's).
    `plugin_manager` is the engine's (the installed plugins when None)."""

    def __init__(
        self,
        stack: StackSource = None,  # type: ignore[assignment]
        *,
        model: str | None = None,
        plugin_manager: Any = None,
        **overrides: Any,
    ) -> None:
        if model is not None:
            overrides["model"] = model
        if overrides:
            stack = load_stack(stack if stack is not None else {}, overrides)
        self.engine = LLMEngine(stack if stack is not None else {}, plugin_manager=plugin_manager)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Prompts as text or token ids; one params for all or one per prompt. Results come back
        in prompt order. Requests with different `cache_salt`s never share cached KV blocks."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        if len(params) != len(plist):
            raise ValueError(f"got {len(params)} SamplingParams for {len(plist)} prompts")
        # Validate everything before anything runs, so one bad prompt fails the call cleanly.
        # Results come back whole: no stream's gap between tokens needs bounding (`Request.streamed`).
        reqs = [
            self.engine.make_request(p, sp, cache_salt=cache_salt, streamed=False)
            for p, sp in zip(plist, params, strict=True)
        ]
        for r in reqs:
            self.engine.enqueue(r)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(reqs):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]

    def chat(
        self,
        messages: list[Message] | Seq[list[Message]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or several; the model's chat template
        renders each, with the assistant turn opened."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        prompts = [self.engine.input_processor.render_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def json_schema(self, schema: dict | str, *, strict: bool = True) -> Grammar:
        """A structured-output grammar for `schema`, for `SamplingParams(grammar=...)`; compiled
        once per schema. Needs xgrammar (`pip install lmstack[structured]`)."""
        return self.engine.grammar_compiler.json_schema(schema, strict=strict)

    def get_stats(self) -> EngineStats:
        """A metrics snapshot: later generate calls do not change it."""
        return self.engine.get_stats()
