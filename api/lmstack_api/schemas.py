"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests ignore fields they do not know (clients send many); fields we know but cannot honour
are rejected by `lmstack_api.params` with a 400 that names them. Value ranges are checked by
`lmstack.SamplingParams`, so the Python API and HTTP give the same messages.
"""

from __future__ import annotations

from typing import Any

import msgspec

# --- requests --------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JSONSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    regex: str | None = None
    grammar: str | None = None  # EBNF / GBNF (xgrammar's dialect), start rule `root`
    choice: list[str] | None = None
    json: dict[str, Any] | str | None = None  # a JSON schema, or its text


class ChatMessage(msgspec.Struct):
    role: str
    # A string, or a list of content parts ({"type": "text", "text": ...}).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class SamplingFields(msgspec.Struct):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    # Requests with different salts never share cached KV blocks (vLLM's field).
    cache_salt: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Lower runs first under a priority scheduler (vLLM's field; header X-Priority too).
    priority: int | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (lmstack_api.tools checks them).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Known but not supported: a non-empty value is a 400.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    # A text, a list of texts, a list of token ids, or a list of token-id lists.
    prompt: str | list[Any] | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    function: ToolCallFunction
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One call in a stream: lmstack sends each call whole, in one fragment (id, name and
    arguments together), which OpenAI's clients assemble like any other."""

    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "lmstack"
    object: str = "model"
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
