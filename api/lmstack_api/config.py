"""The stack file's `server:` section, which this distribution declares and owns.

The core knows nothing of HTTP: lmstack-api registers the section through
`lmstack_register_stack_sections` (see `lmstack_api.plugin`), and the core converts it into
`ServerConfig` when the stack is resolved (`resolved.sections["server"]`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import msgspec

from lmstack.stack.resolve import ResolvedStack

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]

SECTION = "server"

# A tenant name, as configured for a key or sent in `X-Tenant`: safe in logs, metric labels
# and file names.
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}\Z"
TenantName = Annotated[str, msgspec.Meta(pattern=TENANT_PATTERN)]


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A key with the tenant its requests belong to (`{key: sk-..., tenant: acme}`); several
    keys may name one tenant (rotation, one key per service of a customer).

    Scheduling priority (lower runs first; >= 100 is background work): `priority` is what the
    key's requests get when they name none (body `priority`, `X-Priority`); `min_priority` is
    the most urgent one they may name: a more urgent request is clamped to it, not refused, so
    a client that always sends a priority (or a Batch API line) keeps working when its key is
    demoted."""

    key: Annotated[str, msgspec.Meta(min_length=1)]
    tenant: TenantName
    priority: Annotated[
        int, msgspec.Meta(description="the priority of this key's requests that name none (lower runs first)")
    ] = 0
    min_priority: Annotated[
        int | None,
        msgspec.Meta(
            description="the most urgent priority this key's requests may ask; more urgent ones are "
            "clamped to it (null: any)"
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.min_priority is not None and self.priority < self.min_priority:
            # ", got" keeps the entry (and so the key) from being quoted in the message.
            raise ValueError(
                "an api_keys entry's priority may not be more urgent than its min_priority, got "
                f"priority {self.priority} and min_priority {self.min_priority}"
            )

    def clamp(self, priority: int | None) -> int:
        """A request's priority under this key: its default when the request names none, never
        more urgent than `min_priority`."""
        p = self.priority if priority is None else priority
        return p if self.min_priority is None else max(p, self.min_priority)


class RateLimitConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per API key (per client address when no keys are configured); null means unlimited.
    Token buckets refill continuously at the per-minute rate and hold at most one minute."""

    requests_per_minute: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="requests per minute per API key or client (null: unlimited)"),
    ] = None
    input_tokens_per_minute: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="prompt tokens per minute per API key or client (null: unlimited)"),
    ] = None
    output_tokens_per_minute: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="generated tokens per minute per API key or client (null: unlimited)"),
    ] = None


class SLOConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Service-level objectives: a finished request meeting both counts toward goodput."""

    ttft_ms: Annotated[
        PositiveFloat, msgspec.Meta(description="time-to-first-token objective for goodput, in milliseconds")
    ] = 2000.0
    tpot_ms: Annotated[
        PositiveFloat,
        msgspec.Meta(description="time-per-output-token objective for goodput, in milliseconds"),
    ] = 200.0


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: Annotated[str, msgspec.Meta(description="address to bind")] = "127.0.0.1"
    port: Annotated[Port, msgspec.Meta(description="port to bind (0: any free one)")] = 8000
    # The name clients send as `model`; defaults to the stack's `model`.
    served_model_name: Annotated[
        str | None, msgspec.Meta(description="the model name clients send (null: the stack's model)")
    ] = None
    # Bearer keys clients must send; empty means no authentication. `LMSTACK_API_KEYS`
    # (comma-separated) adds keys without writing them into the stack file. A key's requests
    # carry its tenant (`Request.tenant`): the one a `{key, tenant}` entry names, else an id
    # derived from the key (`key_tenant`). With keys configured, `X-Tenant` is ignored.
    api_keys: Annotated[
        list[str | ApiKey],
        msgspec.Meta(description="bearer keys, each a string or {key, tenant} (empty: no authentication)"),
    ] = msgspec.field(default_factory=list)
    # Admission: past either bound a new request gets 503 with Retry-After.
    max_waiting_requests: Annotated[
        PositiveInt, msgspec.Meta(description="requests waiting for admission; past it, 503 with Retry-After")
    ] = 256
    max_queued_tokens: Annotated[
        PositiveInt,
        msgspec.Meta(description="prompt tokens waiting for admission; past it, 503 with Retry-After"),
    ] = 262_144
    # The largest max_tokens a request may ask for (null: the context length).
    max_tokens: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="the largest max_tokens a request may ask for (null: the context length)"),
    ] = None
    max_body_bytes: Annotated[PositiveInt, msgspec.Meta(description="the largest request body, in bytes")] = (
        4 * 1024 * 1024
    )
    # Work one request may ask for, so that one call cannot own the engine: a 20 KB body of
    # 4,000 prompts with n = 32 is 128,000 sequences; echo with logprobs runs the head over
    # every prompt token. Past either bound: 400 naming it.
    max_request_sequences: Annotated[
        PositiveInt,
        msgspec.Meta(description="the most sequences one request may ask for: prompts x n (x best_of)"),
    ] = 256
    max_prompt_logprob_tokens: Annotated[
        PositiveInt,
        msgspec.Meta(
            description="the most prompt tokens, over a request's prompts, whose logprobs echo computes"
        ),
    ] = 4096
    rate_limit: RateLimitConfig = msgspec.field(default_factory=RateLimitConfig)
    slo: SLOConfig = msgspec.field(default_factory=SLOConfig)
    # SIGTERM: stop admitting, let in-flight requests finish for up to this long, then exit.
    drain_timeout_s: Annotated[
        PositiveFloat, msgspec.Meta(description="on SIGTERM, seconds in-flight requests get to finish")
    ] = 30.0
    # --- hostile-input bounds -----------------
    # Structured output: a json_schema past any of these is a 400 naming the bound. Size is
    # checked before compiling; time and memory bound the compile itself, which runs first in
    # a separate process that is killed at the bound (or when its request or the server ends).
    grammar_max_schema_bytes: Annotated[
        PositiveInt, msgspec.Meta(description="the largest json_schema for structured output, in bytes")
    ] = 65_536
    grammar_max_schema_properties: Annotated[
        PositiveInt, msgspec.Meta(description="the most properties in a json_schema, over all its maps")
    ] = 1_000
    grammar_compile_timeout_s: Annotated[
        PositiveFloat, msgspec.Meta(description="seconds a grammar may take to compile")
    ] = 10.0
    grammar_compile_memory_mib: Annotated[
        PositiveInt, msgspec.Meta(description="MiB the grammar compiler's process may grow by")
    ] = 1024
    # Compiled grammars are cached (LRU) up to this many MiB of xgrammar's own size estimate.
    grammar_cache_mib: Annotated[
        PositiveInt, msgspec.Meta(description="compiled-grammar cache (LRU), in MiB of xgrammar's estimate")
    ] = 256
    # Slow clients: the request line and headers must arrive within header_timeout_s of the
    # connection opening (or of the previous response); the body within body_timeout_s of
    # the handler asking for it. Past either the client gets 408 and the connection closes.
    header_timeout_s: Annotated[
        PositiveFloat,
        msgspec.Meta(description="seconds for the request line and headers to arrive (then 408)"),
    ] = 10.0
    body_timeout_s: Annotated[
        PositiveFloat, msgspec.Meta(description="seconds for a request body to arrive once read (then 408)")
    ] = 30.0
    # Sampling bounds. OpenAI allows at most 300 logit_bias entries and temperature in [0, 2];
    # raise max_temperature (the engine accepts up to 100) for clients written against vLLM.
    max_logit_bias_entries: Annotated[
        NonNegativeInt, msgspec.Meta(description="the most logit_bias entries a request may send")
    ] = 300
    max_temperature: Annotated[
        float, msgspec.Meta(ge=0, le=100, description="the highest temperature a request may ask for")
    ] = 2.0
    # Tool calling: the parser that reads calls out of the model's text (`lmstack plugins` lists
    # them); null picks one from the chat template, then the model's family.
    tool_parser: Annotated[
        str | None,
        msgspec.Meta(description="tool-call parser by name (null: chosen from the chat template or family)"),
    ] = None
    chat_template: Annotated[
        str | None,
        msgspec.Meta(
            description="a Jinja chat template file, or the template text, used instead of the model's"
        ),
    ] = None

    # --- Batch API (lmstack_api.batches) -----------------
    # Off unless set: its state must outlive the process and belong to one server (a lock file
    # keeps a second server off it), so no implicit location is right for everyone.
    batch_dir: Annotated[
        str | None,
        msgspec.Meta(description="folder for /v1/files and /v1/batches state (null: the Batch API is off)"),
    ] = None
    batch_max_upload_bytes: Annotated[
        PositiveInt, msgspec.Meta(description="the largest file POST /v1/files accepts, in bytes (then 413)")
    ] = 100 * 1024 * 1024
    batch_max_inflight: Annotated[
        PositiveInt | None,
        msgspec.Meta(description="batch lines running at once (null: the scheduler's max_num_seqs)"),
    ] = None

    def __post_init__(self) -> None:
        tenants: dict[str, str | None] = {}
        for entry in self.api_keys:
            key, tenant = (entry, None) if isinstance(entry, str) else (entry.key, entry.tenant)
            if key in tenants and tenants[key] != tenant:
                # Reported at `server`; the ", got" part keeps the section (and so the keys)
                # from being quoted in the message (lmstack.stack.config.config_error).
                first, second = (t or "derived from the key" for t in (tenants[key], tenant))
                raise ValueError(
                    f"api_keys lists one key twice, got it with tenant {first!r} and {second!r}; "
                    "keep one entry per key"
                )
            tenants[key] = tenant


SECRET_FIELDS = ("api_keys",)


def key_tenant(key: str) -> str:
    """The tenant of a key configured without one: stable across restarts and servers (so a
    disk cache salted with it stays valid) and not reversible to the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def key_tenants(cfg: ServerConfig, env_keys: list[str]) -> list[tuple[str, str]]:
    """(key, tenant) for every configured key: the stack file's, then the environment's."""
    out = [(e, key_tenant(e)) if isinstance(e, str) else (e.key, e.tenant) for e in cfg.api_keys]
    return out + [(k, key_tenant(k)) for k in env_keys]


def public_view(cfg: ServerConfig) -> dict[str, Any]:
    """What readers of the resolved stack see: never the keys, only how many there are."""
    out = msgspec.to_builtins(cfg)
    for name in SECRET_FIELDS:
        out[name] = f"{len(getattr(cfg, name))} configured"
    return out


def server_config(stack: ResolvedStack) -> ServerConfig:
    """The stack's `server:` section (its defaults when the stack has none)."""
    return stack.sections[SECTION]
