"""From a decoded request body to what the engine takes: prompt token ids and SamplingParams.

Everything a client can get wrong is reported here as a 400 naming the parameter, before the
request reaches the engine.
"""

from __future__ import annotations

import hmac
import re
from typing import Any, NamedTuple, TypeVar

import msgspec
import torch

from lmstack.errors import InvalidRequestError, LmstackError
from lmstack.sample.grammar import choice_ebnf
from lmstack.sampling_params import SamplingParams
from lmstack_api.config import ApiKey, ServerConfig
from lmstack_api.errors import APIError, invalid, unsupported
from lmstack_api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from lmstack_api.tools import message_tool_fields

T = TypeVar("T")

_PATH = re.compile(r"at `\$\.?([^`]*)`")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def decode_body(body: bytes, type_: type[T]) -> T:
    """Parse JSON into `type_`; a malformed body or a wrong type is a 400 naming the field."""
    if not body.strip():
        raise invalid("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match.group(1) if match and match.group(1) else None
        if param is None and text.startswith("Expected `object`"):
            text = "the request body must be a JSON object"
        raise invalid(f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec guards its recursion with the interpreter's limit (~1,000 levels): a deeper
        # body is refused while decoding, before anything walks it.
        raise invalid("the request body is nested too deeply") from None


def check_unsupported_chat(req: ChatCompletionRequest) -> None:
    # tools, tool_choice, functions and function_call: lmstack_api.tools.tool_setup.
    if req.audio is not None:
        raise unsupported("audio")
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "only text output is available")
    if req.prediction is not None:
        raise unsupported("prediction")
    if req.web_search_options is not None:
        raise unsupported("web_search_options")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role + text content."""
    if not req.messages:
        raise invalid("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
                param=f"messages[{i}].role",
            )
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise unsupported(
                        f"messages[{i}].content[{j}]",
                        f"only text parts are accepted, got type {part.get('type')!r}",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        entry = {"role": "system" if m.role == "developer" else m.role, "content": content}
        out.append(entry | message_tool_fields(m.role, m.tool_calls, m.tool_call_id, m.name, i))
    return out


def completion_prompts(req: CompletionRequest, max_len: int | None = None) -> list[str | list[int]]:
    """`prompt` as a list of prompts: texts or token-id lists. A token-id list of `max_len` or
    more ids cannot fit the context and is refused before its ids are checked one by one."""
    p = req.prompt
    if p is None:
        raise invalid("prompt is required", param="prompt")
    if isinstance(p, str):
        return [p]
    if not p:
        raise invalid("prompt must not be an empty list", param="prompt")
    if max_len is not None:
        too_long = len(p) >= max_len and isinstance(p[0], int)
        longest = max((len(x) for x in p if isinstance(x, list)), default=0)
        if too_long or longest >= max_len:
            n = len(p) if too_long else longest
            raise invalid(
                f"prompt has {n} tokens; this model's context is {max_len} tokens, which must also "
                "hold at least one output token",
                param="prompt",
                code="context_length_exceeded",
            )
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [list(p)]
    if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        return [list(x) for x in p]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        param="prompt",
    )


def check_sequences(prompts: int, n: int, best_of: int | None, limit: int) -> None:
    """400 naming the limit when a request asks for more than `limit` sequences: every prompt
    samples max(n, best_of) of them, each a slot in the engine's batch for its whole life."""
    per_prompt, total = max(n, best_of or 1), prompts * max(n, best_of or 1)
    if total > limit:
        what = f"{prompts} prompts x {per_prompt} = {total}" if prompts > 1 else f"{total}"
        raise invalid(
            f"this request asks for {what} sequences, more than this server's "
            f"limit of {limit} sequences per request (max_request_sequences)",
            param="n" if prompts == 1 else "prompt",
            code="too_many_sequences",
        )


def check_prompt_logprobs(prompt_lens: list[int], top_n: int, limit: int) -> None:
    """400 naming the limit when echo + logprobs would compute prompt logprobs for more than
    `limit` prompt tokens (over all the request's prompts): each is a full-vocabulary row of
    the head and `top_n` + 1 entries kept until the request ends."""
    total = sum(prompt_lens)
    if total > limit:
        raise invalid(
            f"echo with logprobs={top_n} computes logprobs for {total} prompt tokens, more than this "
            f"server's limit of {limit} prompt tokens per request (max_prompt_logprob_tokens)",
            param="logprobs",
            code="too_many_prompt_logprobs",
        )


class _LogitBias:
    """Adds a per-token bias to the logits of one sequence (OpenAI's `logit_bias`)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = list(bias)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(self.ids, device=logits.device)
        logits[idx] += self.values.to(logits.device, logits.dtype)
        return logits


def _logit_bias(raw: dict[str, float], vocab_size: int, max_entries: int) -> _LogitBias:
    if len(raw) > max_entries:
        # Each entry is work on every decode step of every sequence batched with this one.
        raise invalid(
            f"logit_bias has {len(raw)} entries, more than this server's limit of {max_entries}",
            param="logit_bias",
        )
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise invalid(
                f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias[tok] = float(value)
    return _LogitBias(bias)


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    max_tokens_cap: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    grammar: Any = None,
    max_logit_bias_entries: int = 300,
    max_temperature: float = 2.0,
) -> SamplingParams:
    """`max_tokens` is what the client asked for (None: `default_max_tokens`, then the cap)."""
    if req.temperature is not None and not 0.0 <= req.temperature <= max_temperature:
        raise invalid(
            f"temperature must be between 0 and {max_temperature:g}, got {req.temperature:g}",
            param="temperature",
        )
    if max_tokens is not None and max_tokens_cap is not None and max_tokens > max_tokens_cap:
        raise invalid(
            f"max_tokens={max_tokens} exceeds this server's limit of {max_tokens_cap}", param="max_tokens"
        )
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_tokens_cap
    if grammar is not None and req.min_tokens:
        # Once the JSON is complete the grammar allows only the end token, which min_tokens forbids.
        raise unsupported(
            "min_tokens",
            "it cannot be combined with structured output (response_format json_schema / "
            "json_object, structured_outputs, forced tool calls)",
        )
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop is not None else [])
    processors = [_logit_bias(req.logit_bias, vocab_size, max_logit_bias_entries)] if req.logit_bias else []
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logits_processors=processors,
            grammar=grammar,
        )
    except InvalidRequestError as exc:
        raise invalid(str(exc), param=exc.param) from None


def schema_request(req: SamplingFields) -> tuple[str, Any] | None:
    """What `response_format` asks for: None (free text), ("json_object", None) or
    ("json_schema", schema)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json_object", None
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid(
                "response_format.json_schema.schema is required for type json_schema",
                param="response_format.json_schema.schema",
            )
        return "json_schema", fmt.json_schema.schema
    raise invalid(
        f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
        param="response_format.type",
    )


class GrammarSpec(NamedTuple):
    """The structured output a request asks for."""

    kind: str  # "json_object", "json" (a schema), "regex" or "ebnf"
    source: Any  # the schema, the regex or the EBNF text (None for json_object)
    param: str  # the request field its errors name


_SO_FIELDS = ("regex", "grammar", "choice", "json")
SCHEMA_PARAM = "response_format.json_schema.schema"


def grammar_spec(req: SamplingFields) -> GrammarSpec | None:
    """What `response_format` or vLLM's `structured_outputs` asks for (None: free text).
    `structured_outputs` takes exactly one of regex, grammar (EBNF), choice and json."""
    fmt = schema_request(req)
    so = req.structured_outputs
    if so is None:
        if fmt is None:
            return None
        if fmt[0] == "json_object":
            return GrammarSpec("json_object", None, "response_format")
        return GrammarSpec("json", fmt[1], SCHEMA_PARAM)
    given = [name for name in _SO_FIELDS if getattr(so, name) is not None]
    if len(given) != 1:
        got = ", ".join(given) if given else "none"
        raise invalid(
            f"structured_outputs must set exactly one of {', '.join(_SO_FIELDS)}; got {got}",
            param="structured_outputs",
        )
    if fmt is not None:
        raise invalid(
            "structured_outputs cannot be combined with response_format json_schema / json_object",
            param="structured_outputs",
        )
    (name,) = given
    param = f"structured_outputs.{name}"
    if name == "regex":
        return GrammarSpec("regex", so.regex, param)
    if name == "grammar":
        return GrammarSpec("ebnf", so.grammar, param)
    if name == "json":
        return GrammarSpec("json", so.json, param)
    choices = list(dict.fromkeys(so.choice or []))
    if not choices:
        raise invalid("structured_outputs.choice must be a non-empty list of strings", param=param)
    if "" in choices:
        raise invalid("structured_outputs.choice must not contain an empty string", param=param)
    return GrammarSpec("ebnf", choice_ebnf(choices), param)


_PRIORITY = re.compile(r"-?[0-9]{1,18}")


def key_policy(cfg: ServerConfig, key: str | None) -> ApiKey | None:
    """The `{key, tenant, priority, min_priority}` entry of the key a request authenticated
    with; None for no key, a plain-string key or one from LMSTACK_API_KEYS (whose requests
    take any priority, 0 by default)."""
    if key is None:
        return None
    given = key.encode()
    found = None
    for entry in cfg.api_keys:  # every entry compared, as in ServerState.caller
        if isinstance(entry, ApiKey) and hmac.compare_digest(entry.key.encode(), given) and found is None:
            found = entry
    return found


def request_priority(req: SamplingFields, headers: Any, key: ApiKey | None = None) -> int:
    """The request's scheduling priority (lower runs first; >= BATCH_PRIORITY is background
    work): the body's `priority`, else the `X-Priority` header, else the key's default `priority`
    (0 without one); never more urgent than the key's `min_priority` (clamped, see ApiKey)."""
    asked = req.priority
    if asked is None:
        raw = headers.get("x-priority")
        if raw is not None:
            if not _PRIORITY.fullmatch(raw.strip()):
                raise invalid("the X-Priority header must be an integer", param="X-Priority")
            asked = int(raw)
    if key is None:
        return 0 if asked is None else asked
    return key.clamp(asked)


def as_request_error(exc: LmstackError, param: str = "response_format") -> APIError:
    """A structured-output failure (xgrammar missing, a tokenizer it cannot use, a source it
    rejects) as a 400 naming `param`, the request field that asked for it, unless the error
    names a field of its own."""
    own = exc.param if isinstance(exc, InvalidRequestError) else None
    if own in (None, SCHEMA_PARAM, "response_format"):
        own = param
    return invalid(str(exc), param=own)


def request_error(exc: InvalidRequestError) -> APIError:
    """The engine's admission errors (context length, token ids) as 400s."""
    code = "context_length_exceeded" if "context" in str(exc) else None
    return invalid(str(exc), param=exc.param, code=code)
