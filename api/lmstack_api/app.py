"""The Litestar application: routes, error handling, and the glue between them and the engine."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Stream

from lmstack.errors import EngineDeadError, LmstackError
from lmstack.exec.rendezvous import STEP_TIMEOUT_S, default_step_timeout
from lmstack.stack.resolve import ResolvedStack
from lmstack_api import params as P
from lmstack_api import tools as T
from lmstack_api.batches.routes import batch_routes, open_batches
from lmstack_api.errors import APIError, clip, from_status
from lmstack_api.grammar_guard import bounded_grammar, bounded_schema_grammar
from lmstack_api.job import EngineFailure, Job
from lmstack_api.logs import get_logger
from lmstack_api.prompts import check_text_fits, context_error, encode_texts
from lmstack_api.render import SSE_DONE, TokenText, chat_logprobs, completion_logprobs, sse, to_json, usage
from lmstack_api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallOut,
)
from lmstack_api.state import ServerState, client_request_id
from lmstack_api.tokenization import detokenize_body, tokenize_body

log = get_logger()
JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> ServerState:
    return request.app.state["server"]


def _json(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=to_json(payload), status_code=status, media_type=JSON, headers=headers)


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def _read_body(request: Request) -> bytes:
    """The JSON body: 415 for another media type (no Content-Type is read as JSON, as curl
    and many clients send it that way), 408 when it does not arrive in time (slow clients)."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(
                415,
                f"Content-Type must be application/json, got {clip(media)!r}",
                code="unsupported_media_type",
            )
    timeout = _state(request).config.body_timeout_s
    try:
        return await asyncio.wait_for(request.body(), timeout)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s (server.body_timeout_s)",
            code="request_timeout",
            close=True,
        ) from None


async def _until_done_or_gone(request: Request, work: asyncio.Future) -> None:
    """Wait for `work`; if the client disconnects first, cancel it and answer 499."""
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise APIError(499, "the client closed the connection")


async def _grammar(request: Request, req) -> object | None:
    """The compiled grammar `response_format` or `structured_outputs` asks for (None: free
    text). A new one compiles within the server's bounds and is cancelled if the client leaves."""
    spec = P.grammar_spec(req)
    if spec is None:
        return None
    state = _state(request)
    cfg = state.config

    async def build() -> object:
        try:
            compiler = await asyncio.to_thread(state.grammar_compiler)
            if not state.grammar_cache_limited:
                compiler.limit_cache(cfg.grammar_cache_mib << 20)
                state.grammar_cache_limited = True
            if spec.kind == "json_object":
                return await asyncio.to_thread(compiler.json_object)
            if spec.kind == "json":
                if spec.param == P.SCHEMA_PARAM:
                    return await bounded_schema_grammar(
                        compiler,
                        state.grammar_guard,
                        spec.source,
                        max_bytes=cfg.grammar_max_schema_bytes,
                        max_properties=cfg.grammar_max_schema_properties,
                    )
                prepared = compiler.prepare(
                    spec.source,
                    max_bytes=cfg.grammar_max_schema_bytes,
                    max_properties=cfg.grammar_max_schema_properties,
                )._replace(param=spec.param)
            else:
                prepared = compiler.prepare_source(
                    spec.kind, spec.source, param=spec.param, max_bytes=cfg.grammar_max_schema_bytes
                )
            return await bounded_grammar(compiler, state.grammar_guard, prepared)
        except LmstackError as exc:
            raise P.as_request_error(exc, spec.param) from None

    work = asyncio.ensure_future(build())
    await _until_done_or_gone(request, work)
    return work.result()


async def _tool_grammar(request: Request, setup: T.ToolSetup) -> object:
    """The grammar forcing the calls of tool_choice required / a named function, compiled
    like a response_format schema (bounded, cancelled if the client leaves)."""
    state = _state(request)

    async def build() -> object:
        try:
            compiler = await asyncio.to_thread(state.grammar_compiler)
            if not state.grammar_cache_limited:
                compiler.limit_cache(state.config.grammar_cache_mib << 20)
                state.grammar_cache_limited = True
            return await T.tool_grammar(setup, compiler, state.grammar_guard, state.config)
        except LmstackError as exc:
            raise P.invalid(str(exc), param="tool_choice") from None

    work = asyncio.ensure_future(build())
    await _until_done_or_gone(request, work)
    return work.result()


async def _tokenize(state: ServerState, engine, texts: list[str], param: str) -> list[list[int]]:
    """Token ids of prompt texts, off the event loop; a prompt that cannot fit the context is
    refused before tokenizing when its length alone proves it."""
    limit = engine.max_model_len
    for text in texts:
        check_text_fits(text, limit, state.max_piece_bytes, param)
    ids = await encode_texts(engine.tokenizer, texts)
    for one in ids:
        if len(one) >= limit:
            raise context_error(len(one), limit, param)
    return ids


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(job: Job, request: Request) -> bool:
    """Run the job to the end; False if the client went away first (the job is then aborted)."""

    async def drain() -> None:
        async for _ in job.outputs():
            pass

    work = asyncio.create_task(drain())
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:  # the client left (or we were cancelled): abort the engine requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if gone:
        return False
    work.result()  # re-raise what the engine reported
    return True


def _stream_response(job: Job, frames: AsyncIterator[bytes]) -> Stream:
    body = _sse(job, frames)
    # If the body is never iterated (the client left before the headers went out), its
    # `finally` never runs: release the job's queue slot and reservation when it is collected.
    weakref.finalize(body, job.finish, "disconnected")
    return Stream(body, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": job.echo_id})


def _engine_error(job: Job, exc: EngineFailure | EngineDeadError) -> APIError:
    job.status = "engine_error"
    return APIError(500, f"the engine ended this request: {exc}", type="server_error")


async def _sse(job: Job, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body: the job's frames, an error event if it fails midway (the status line is
    long gone), `[DONE]`, and the job's bookkeeping however the stream ends."""
    try:
        async for frame in frames:
            yield frame
    except asyncio.CancelledError:  # the client went away: Litestar cancels the stream
        job.status = "disconnected"
        raise
    except (EngineFailure, EngineDeadError) as exc:
        yield sse(_engine_error(job, exc).body())
    except Exception:
        log.exception("stream failed", request_id=job.request_id)
        job.status = "error"
        yield sse(APIError(500, "internal error while streaming", type="server_error").body())
    finally:
        job.finish()
    yield SSE_DONE


async def _complete(job: Job, request: Request) -> bool:
    """Run a non-streamed job to the end; False when the client left first."""
    try:
        if not await _collect(job, request):
            job.status = "disconnected"
            return False
        return True
    except (EngineFailure, EngineDeadError) as exc:
        raise _engine_error(job, exc) from None
    finally:
        job.finish()


# --- chat ------------------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    key, tenant = state.caller(request.headers)
    engine = state.require_ready()
    req = P.decode_body(await _read_body(request), ChatCompletionRequest)
    state.check_model(req.model)
    P.check_unsupported_chat(req)
    messages = P.chat_messages(req)
    chat_tokenizer = state.chat_tokenizer(engine)  # server.chat_template, or the model's
    template = chat_tokenizer.chat_template
    tools = T.tool_setup(
        req,
        template=template,
        family=T.model_family(engine),
        parser_name=getattr(state.config, "tool_parser", None),
        model=state.model_name,
    )
    messages, template_tools = T.for_template(tools, messages, template)
    if req.top_logprobs is not None and not req.logprobs:
        raise P.invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    P.check_sequences(1, req.n, None, state.config.max_request_sequences)
    try:
        # Rendering grows with the input: off the event loop, like the tokenizing after it.
        text = await asyncio.to_thread(
            chat_tokenizer.apply_chat_template, messages, req.add_generation_prompt, template_tools
        )
    except LmstackError as exc:
        if tools is not None and tools.choice != "none":
            raise T.template_error(state.model_name, exc) from None
        raise P.invalid(str(exc), param="messages") from None
    (prompt,) = await _tokenize(state, engine, [text], "messages")
    grammar = await _grammar(request, req)
    if tools is not None and tools.constrained:
        if grammar is not None:
            raise P.invalid(
                "response_format / structured_outputs cannot be combined with tool_choice required "
                "or a named function",
                param="tool_choice",
            )
        grammar = await _tool_grammar(request, tools)
    top_n = req.top_logprobs or 0
    sp = P.sampling_params(
        req,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        default_max_tokens=None,
        max_tokens_cap=state.config.max_tokens,
        logprobs=top_n if req.logprobs else None,
        prompt_logprobs=None,
        vocab_size=engine.vocab_size,
        grammar=grammar,
        max_logit_bias_entries=state.config.max_logit_bias_entries,
        max_temperature=state.config.max_temperature,
    )
    # The body's id stays ours (unique and OpenAI-shaped) even when the caller sent an
    # X-Request-Id: that one may repeat across requests; it comes back in the header instead.
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = Job(state, "chat", rid, key, tenant=tenant, client_request_id=client_request_id(request.headers))
    job.admit(
        [prompt],
        sp,
        _client(request),
        cache_salt=req.cache_salt,
        streamed=req.stream,
        priority=P.request_priority(req, request.headers, P.key_policy(state.config, key)),
    )
    created = int(time.time())
    tt = TokenText(engine.tokenizer)
    model = state.model_name
    # One parser per choice; none when nothing is parsed (no tools, tool_choice none).
    calls = {i: T.ChoiceCalls(tools) for i in range(sp.n)} if tools is not None and tools.parser else {}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, use=None) -> bytes:
            return sse(ChatCompletionChunk(rid, created, model, choices, usage=use))

        def delta(c) -> tuple[Delta, str | None]:
            cc = calls.get(c.index)
            if cc is None:
                return Delta(content=c.text_delta), c.finish_reason
            content, new = cc.feed(c.text_delta)
            if c.finish_reason:
                rest, more = cc.finish()
                content, new = content + rest, new + more
            fragments = [
                ToolCallDelta(k, cid, "function", ToolCallFunction(call.name, call.arguments))
                for k, cid, call in new
            ]
            d = Delta(content=content or None, tool_calls=fragments or None)
            return d, T.finish_reason(c.finish_reason, cc)

        async def frames() -> AsyncIterator[bytes]:
            yield chunk([ChatChunkChoice(i, Delta(role="assistant", content="")) for i in range(sp.n)])
            async for _, out in job.outputs():
                choices = []
                for c in out.outputs:
                    if not (c.text_delta or c.finish_reason or c.token_ids_delta):
                        continue
                    end = len(c.token_ids)
                    lp = (
                        chat_logprobs(c, end - len(c.token_ids_delta), end, top_n, tt)
                        if req.logprobs
                        else None
                    )
                    d, reason = delta(c)
                    if calls and not (d.content or d.tool_calls or reason or lp):
                        continue  # held back by the parser: nothing to say yet
                    choices.append(ChatChunkChoice(c.index, d, reason, lp))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage(list(job.final.values())))

        return _stream_response(job, frames())

    if not await _complete(job, request):
        return Response(content=b"", status_code=499)  # nobody is listening any more
    out = job.final[0]
    choices = []
    for c in out.outputs:
        message, reason = AssistantMessage("assistant", c.text), c.finish_reason
        cc = calls.get(c.index)
        if cc is not None:
            content, made = cc.whole(c.text)
            made_calls = [
                ToolCallOut(cid, ToolCallFunction(call.name, call.arguments)) for _, cid, call in made
            ]
            message = AssistantMessage("assistant", content, made_calls or None)
            reason = T.finish_reason(c.finish_reason, cc)
        lp = chat_logprobs(c, 0, len(c.token_ids), top_n, tt) if req.logprobs else None
        choices.append(ChatChoice(c.index, message, reason, lp))
    return _json(
        ChatCompletion(rid, created, model, choices, usage([out])), headers={"X-Request-Id": job.echo_id}
    )


# --- completions -----------------------------------------------------------------------------


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    state = _state(request)
    key, tenant = state.caller(request.headers)
    engine = state.require_ready()
    req = P.decode_body(await _read_body(request), CompletionRequest)
    state.check_model(req.model)
    if req.suffix:
        raise P.unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
    if req.best_of is not None and req.best_of != req.n:
        raise P.unsupported("best_of", "only best_of equal to n (or absent) is accepted")
    prompts = P.completion_prompts(req, engine.max_model_len)
    # Before tokenizing: the count alone decides (SamplingParams bounds n and best_of).
    P.check_sequences(len(prompts), req.n, req.best_of, state.config.max_request_sequences)
    texts = {i: p for i, p in enumerate(prompts) if isinstance(p, str)}
    for i, ids in zip(texts, await _tokenize(state, engine, list(texts.values()), "prompt"), strict=True):
        prompts[i] = ids
    if req.echo and req.logprobs is not None:
        P.check_prompt_logprobs(
            [len(p) for p in prompts], req.logprobs, state.config.max_prompt_logprob_tokens
        )
    grammar = await _grammar(request, req)
    top_n = req.logprobs or 0
    sp = P.sampling_params(
        req,
        max_tokens=req.max_tokens,
        default_max_tokens=16,  # OpenAI's default for completions
        max_tokens_cap=state.config.max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
        vocab_size=engine.vocab_size,
        grammar=grammar,
        max_logit_bias_entries=state.config.max_logit_bias_entries,
        max_temperature=state.config.max_temperature,
    )
    rid = f"cmpl-{uuid.uuid4().hex}"  # ours, unique; see chat_completions
    job = Job(
        state, "completions", rid, key, tenant=tenant, client_request_id=client_request_id(request.headers)
    )
    job.admit(
        prompts,
        sp,
        _client(request),
        cache_salt=req.cache_salt,
        streamed=req.stream,
        priority=P.request_priority(req, request.headers, P.key_policy(state.config, key)),
    )
    created = int(time.time())
    tt = TokenText(engine.tokenizer)
    model, n = state.model_name, sp.n

    def echo_text(i: int) -> str:
        # Prompts were tokenized here, so the engine holds ids only: echo the client's text.
        return texts[i] if i in texts else engine.tokenizer.decode(job.reqs[i].prompt_token_ids)

    def logprobs_for(i: int, c, start: int, end: int, echo: bool):
        if req.logprobs is None:
            return None
        ids, entries = list(c.token_ids[start:end]), list(c.logprobs[start:end])
        if echo:
            out = job.final.get(i)
            plp = out.prompt_logprobs if out is not None else None
            r = job.reqs[i]
            ids = r.prompt_token_ids + ids
            entries = list(plp or [None] * r.prompt_len) + entries
        return completion_logprobs(ids, entries, top_n, tt)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, use=None) -> bytes:
            return sse(Completion(rid, created, model, choices, use))

        async def frames() -> AsyncIterator[bytes]:
            echoed: set[int] = set()
            async for i, out in job.outputs():
                choices = []
                for c in out.outputs:
                    idx = i * n + c.index
                    text = c.text_delta
                    if req.echo and idx not in echoed:
                        echoed.add(idx)
                        text = echo_text(i) + text
                    if not (text or c.finish_reason or c.token_ids_delta):
                        continue
                    end = len(c.token_ids)
                    lp = logprobs_for(i, c, end - len(c.token_ids_delta), end, False)
                    choices.append(CompletionChoice(idx, text, c.finish_reason, lp))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage(list(job.final.values())))

        return _stream_response(job, frames())

    if not await _complete(job, request):
        return Response(content=b"", status_code=499)  # nobody is listening any more
    choices = []
    for i in range(len(job.reqs)):
        for c in job.final[i].outputs:
            text = (echo_text(i) if req.echo else "") + c.text
            choices.append(
                CompletionChoice(
                    i * n + c.index, text, c.finish_reason, logprobs_for(i, c, 0, len(c.token_ids), req.echo)
                )
            )
    outs = [job.final[i] for i in range(len(job.reqs))]
    return _json(Completion(rid, created, model, choices, usage(outs)), headers={"X-Request-Id": job.echo_id})


# --- tokenize / detokenize ------------------------------------------------------------------


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response:
    state = _state(request)
    state.authenticate(request.headers)
    engine = state.require_ready()
    return _json(await tokenize_body(state, engine, await _read_body(request)))


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response:
    state = _state(request)
    state.authenticate(request.headers)
    engine = state.require_ready()
    return _json(await detokenize_body(state, engine, await _read_body(request)))


# --- models, stack, health, metrics ----------------------------------------------------------


@get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    state.authenticate(request.headers)
    max_len = state.engine.max_model_len if state.engine is not None else None
    return _json(ModelList([ModelCard(state.model_name, state.created, max_model_len=max_len)]))


@get("/v1/models/{model_id:str}")
async def model_card(request: Request) -> Response:
    # Read from the request rather than a `model_id` argument: Litestar 2.25 deprecates path
    # parameters inferred from a bare argument, and its replacement (`FromPath`) is missing
    # from the older Litestar versions this package accepts.
    state = _state(request)
    state.authenticate(request.headers)
    state.check_model(str(request.path_params["model_id"]))
    max_len = state.engine.max_model_len if state.engine is not None else None
    return _json(ModelCard(state.model_name, state.created, max_model_len=max_len))


# Option names that hold credentials or point at them (api_keys, hf_token, ssl_keyfile,
# password, ...). Only string values are withheld, so counts such as max_tokens still show.
_SECRET_NAME = re.compile(r"(key|token(?!izer)|secret|passw|credential|auth)", re.IGNORECASE)
REDACTED = "[redacted]"
# Where the server keeps files (a cache's disk_path, a draft model's folder) is no key holder's
# business: strings under a path-like name, or that look like a filesystem path, are withheld too.
_PATH_NAME = re.compile(r"(path|dir|directory|folder)$", re.IGNORECASE)
_PATH_VALUE = re.compile(r"^(/|~|\.{1,2}[/\\]|[A-Za-z]:[/\\])")


def redact(value: object, name: str = "") -> object:
    """`value` with every string under a credential-like or path-like name, and every string
    that looks like a filesystem path, replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, name) for v in value]
    if isinstance(value, str) and (
        _SECRET_NAME.search(name) or _PATH_NAME.search(name) or _PATH_VALUE.match(value)
    ):
        return REDACTED
    return value


@get("/v1/stack")
async def stack_info(request: Request) -> Response:
    """The resolved stack and the plugins behind each component (read-only, for operators).
    Never the API keys: any client holding one key may call this."""
    state = _state(request)
    state.authenticate(request.headers)
    stack = redact(state.stack.describe())
    server = stack.get("server") if isinstance(stack, dict) else None
    if isinstance(server, dict):
        server["api_keys"] = f"{len(state.api_keys)} configured"
    body = {"model": state.model_name, "stack": stack, "ready": state.engine is not None}
    if state.engine is not None:
        eng = state.engine
        body["engine"] = {
            "max_model_len": eng.max_model_len,
            "kv_cache_blocks": eng.num_kv_blocks,
            "block_size": eng.block_size,
            "max_num_seqs": eng.limits.max_num_seqs,
            "max_num_batched_tokens": eng.limits.max_num_batched_tokens,
        }
        # A cache with a lower tier may say how it is doing (`tiered`: its disk tier being off
        # or failing is no engine failure, so /health stays ok and this is where it shows).
        cache_status = getattr(getattr(eng.engine, "block_cache", None), "status", None)
        if callable(cache_status):
            body["engine"]["cache"] = redact(cache_status())
    return _json(body)


@get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.engine_error is not None:
        return _json({"status": "failed"}, 503)
    if state.draining:
        return _json({"status": "draining"}, 503, {"Retry-After": "5"})
    if state.engine is None:
        # Unauthenticated: the reason a load failed (plugin names, module errors) is in the log only.
        status = "failed" if state.load_error else "loading"
        return _json({"status": status}, 503, {"Retry-After": "5"})
    return _json({"status": "ok"})


def _not_ready(state: ServerState) -> tuple[str, str] | None:
    """(status, reason) when this server should get no traffic, else None. The reasons are
    fixed sentences: the probe is unauthenticated, so no load error or plugin text goes out."""
    if state.engine_error is not None or (state.engine is not None and state.engine.dead is not None):
        return "failed", "the engine stopped; the server is exiting"
    if state.load_error:
        return "failed", "the model failed to load"
    if state.engine is None:
        return "loading", "the model is still loading"
    if state.draining:
        return "draining", "the server is shutting down and admits no new requests"
    age = state.engine.loop_age()
    if age is None:
        return "failed", "the engine loop has ended"
    # The bound the multi-process step watchdog kills a stalled rank at; in one process nothing
    # kills a step stuck past it, so readiness takes the server out of rotation instead.
    try:
        bound = default_step_timeout()
    except LmstackError:  # a malformed LMSTACK_STEP_TIMEOUT_S: its own default
        bound = STEP_TIMEOUT_S
    if bound is not None and age > bound:
        return (
            "stalled",
            f"the engine has been in one step for {age:.0f} s (LMSTACK_STEP_TIMEOUT_S: {bound:g})",
        )
    return None


@get("/ready")
async def ready(request: Request) -> Response:
    """Readiness (a Kubernetes readinessProbe): 200 when the model is loaded, the engine loop is
    coming round (idle, or within a step's time bound) and the server is not draining; else 503
    with the reason. /health is liveness: it stays 200 through a slow step."""
    problem = _not_ready(_state(request))
    if problem is None:
        return _json({"status": "ready"})
    status, reason = problem
    return _json({"status": status, "reason": reason}, 503, {"Retry-After": "5"})


@get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(
        content=_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


# --- errors ----------------------------------------------------------------------------------


def _endpoint(request: Request) -> str:
    path = request.url.path
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path, "other")


def _error_response(request: Request, err: APIError) -> Response:
    state = request.app.state.get("server")
    if state is not None and _endpoint(request) != "other":
        state.metrics.requests.labels(_endpoint(request), str(err.status)).inc()
    if err.status >= 500 and err.status != 503:
        log.error("request failed", path=request.url.path, status=err.status, error=err.message)
    headers = err.headers()
    client_id = client_request_id(request.headers)
    if client_id is not None:  # a caller tracing its requests can match the failures too
        headers["X-Request-Id"] = client_id
    return Response(content=to_json(err.body()), status_code=err.status, media_type=JSON, headers=headers)


def _on_api_error(request: Request, exc: APIError) -> Response:
    return _error_response(request, exc)


def _on_http_exception(request: Request, exc: HTTPException) -> Response:
    message = exc.detail or "request failed"
    if exc.status_code == 413:
        limit = request.app.state["server"].config.max_body_bytes
        message = f"the request body is larger than this server's limit of {limit} bytes"
    elif exc.status_code == 404:
        message = f"no route for {clip(request.method)} {clip(request.url.path)}"
    elif exc.status_code == 405:
        message = f"method {clip(request.method)} is not allowed on {clip(request.url.path)}"
    return _error_response(request, from_status(exc.status_code, message))


def _on_unexpected(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log, never to the client.
    log.error("unhandled error", path=request.url.path, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return _error_response(request, APIError(500, "internal server error", type="server_error"))


# --- the app ---------------------------------------------------------------------------------


def create_app(stack: ResolvedStack, state: ServerState | None = None) -> Litestar:
    """An app serving `stack`. The engine loads in the background after startup (/health says
    when it is ready); pass a `state` holding an engine to skip that."""
    state = state or ServerState(stack)
    load_task: list[asyncio.Task] = []
    # The Batch API (server.batch_dir): its store opens now, so an unusable folder is one line
    # before the model loads; its runner starts with the app and stops before the engine.
    batches = open_batches(state)

    async def on_startup(app: Litestar) -> None:
        load_task.append(asyncio.create_task(state.load()))
        if batches is not None:
            batches.start(app)

    async def on_shutdown(app: Litestar) -> None:
        if batches is not None:
            await batches.stop()
        await state.grammar_guard.aclose()
        for t in load_task:
            if not t.done():
                await asyncio.gather(t, return_exceptions=True)
        await asyncio.to_thread(state.shutdown)

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            tokenize,
            detokenize,
            models,
            model_card,
            stack_info,
            health,
            ready,
            metrics,
            *batch_routes(state),
        ],
        exception_handlers={
            APIError: _on_api_error,
            HTTPException: _on_http_exception,
            Exception: _on_unexpected,
        },
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        request_max_body_size=state.config.max_body_bytes,
        state=State({"server": state, "batches": batches}),
        openapi_config=None,
        logging_config=None,
    )
