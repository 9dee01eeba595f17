"""vLLM's `structured_outputs` (regex, EBNF grammar, choice, json), logit_bias, priority,
/tokenize and /detokenize and server.chat_template, through the HTTP app in-process on the
session's SmolLM2 engine. Outputs are checked against oracles independent of xgrammar: Python's
`re`, a regex equivalent to the grammar, membership, the tokenizer itself."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_structured_output import STACK

pytest.importorskip("xgrammar")

PHONE = r"[0-9]{3}-[a-z]{2,4}"
# A bounded arithmetic grammar (GBNF) and the regular expression for the same language.
ARITH = """root ::= term (op term)?
op ::= "+" | "-"
term ::= digit digit? | "(" digit "*" digit ")"
digit ::= [0-9]
"""
ARITH_RE = r"(\d\d?|\(\d\*\d\))([+-](\d\d?|\(\d\*\d\)))?"
COLORS = ["red", "green", "blue", "light yellow"]
ASK = [{"role": "user", "content": "Give me an answer."}]


def server_stack(llm, **server):
    """`llm`'s stack with server-section options changed."""
    import dataclasses

    import msgspec

    from lmstack_api.config import SECTION

    stack = llm.engine.stack
    cfg = msgspec.structs.replace(stack.sections[SECTION], **server)
    return dataclasses.replace(stack, sections={**stack.sections, SECTION: cfg})


@pytest.fixture(scope="module")
def llm(shared_llm):
    return shared_llm(STACK)


@pytest.fixture(scope="module")
def client(llm):
    """The app serving the shared engine. One per module: two AsyncEngine loops must never
    step one engine at once."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    stack = llm.engine.stack
    # The engine stays shared_llm's: the app's shutdown stops only the AsyncEngine loop.
    with TestClient(create_app(stack, ServerState(stack, AsyncEngine(llm.engine)))) as c:
        yield c


def chat(client, so: dict, **extra) -> dict:
    body = {"messages": ASK, "structured_outputs": so, "max_tokens": 16, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sampled(client, so: dict, count: int = 20) -> list[str]:
    """`count` seeded temperature-1 completions of a short prompt, sent at once (the engine
    batches them)."""

    def one(seed: int) -> dict:
        body = {"prompt": "Answer:", "structured_outputs": so, "max_tokens": 16}
        r = client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": seed})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(count) as pool:
        outs = list(pool.map(one, range(count)))
    assert all(out["finish_reason"] == "stop" for out in outs), outs
    return [out["text"] for out in outs]


def test_regex_holds_on_sampled_requests(client):
    texts = sampled(client, {"regex": PHONE})
    assert all(re.fullmatch(PHONE, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not one forced answer


def test_grammar_holds_on_sampled_requests(client):
    texts = sampled(client, {"grammar": ARITH})
    assert all(re.fullmatch(ARITH_RE, t) for t in texts), texts


def test_choice_holds_on_sampled_requests(client):
    texts = sampled(client, {"choice": COLORS})
    assert set(texts) <= set(COLORS), texts


def test_json_and_completions_endpoint(client):
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = chat(client, {"json": schema}, max_tokens=24, temperature=0)
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["n"], int)
    r = client.post(
        "/v1/completions",
        json={"prompt": "Phone:", "structured_outputs": {"regex": PHONE}, "max_tokens": 16, "seed": 3},
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch(PHONE, r.json()["choices"][0]["text"])


def test_n_2_each_choice_holds(client):
    out = chat(client, {"regex": PHONE}, n=2, temperature=1.0, seed=11)
    texts = [c["message"]["content"] for c in out["choices"]]
    assert len(texts) == 2 and all(re.fullmatch(PHONE, t) for t in texts), texts


@pytest.mark.parametrize(
    ("so", "param", "says"),
    [
        ({"regex": "(a|b"}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"grammar": "root ::= foo"}, "structured_outputs.grammar", 'Rule "foo" is not defined'),
        ({"grammar": 'root ::= "a'}, "structured_outputs.grammar", "string literal"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
        ({}, "structured_outputs", "exactly one"),
        ({"choice": []}, "structured_outputs.choice", "non-empty"),
        ({"json": "[1,"}, "structured_outputs.json", "not valid JSON"),
    ],
)
def test_bad_structured_outputs_are_400(client, so, param, says):
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        r = client.post(path, json={**body, "structured_outputs": so, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err


def test_structured_outputs_with_response_format_is_400(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "structured_outputs": {"regex": "a"},
            "response_format": {"type": "json_object"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def greedy_token(client, **extra) -> tuple[int, str]:
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    r = client.post("/v1/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_logit_bias_reaches_sampling(client, llm):
    tok = llm.tokenizer
    first = greedy_token(client)
    (banned,) = tok.encode(first)
    assert greedy_token(client, logit_bias={str(banned): -100}) != first
    forced = tok.encode(" banana")[0]
    assert greedy_token(client, logit_bias={str(forced): 100}) == tok.decode([forced])


class PriorityRecorder:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.priorities: list[int] = []

    def add(self, seq) -> None:
        self.priorities.append(seq.request.priority)
        self.inner.add(seq)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_priority_reaches_the_scheduler(client, llm, monkeypatch):
    recorder = PriorityRecorder(llm.engine.scheduler)
    monkeypatch.setattr(llm.engine, "scheduler", recorder)
    one = {"max_tokens": 1, "temperature": 0}
    calls = [
        ("/v1/chat/completions", {"messages": ASK, "priority": -3}, {}),
        ("/v1/completions", {"prompt": "Hi", "priority": 7}, {}),
        ("/v1/completions", {"prompt": "Hi"}, {"X-Priority": "5"}),
        ("/v1/chat/completions", {"messages": ASK, "priority": 2}, {"X-Priority": "9"}),  # body wins
        ("/v1/completions", {"prompt": "Hi"}, {}),
    ]
    for path, body, headers in calls:
        r = client.post(path, json={**body, **one}, headers=headers)
        assert r.status_code == 200, r.text
    assert recorder.priorities == [-3, 7, 5, 2, 0]
    r = client.post("/v1/completions", json={"prompt": "Hi", **one}, headers={"X-Priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"
    r = client.post("/v1/completions", json={"prompt": "Hi", "priority": "high", **one})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert recorder.priorities == [-3, 7, 5, 2, 0]


def test_tokenize_detokenize_round_trip(client, llm):
    tok = llm.tokenizer
    text = "Hello, world! Ünïcode and <|im_start|> too."
    r = client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == llm.engine.max_model_len
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi there"}]
    r = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(messages, True))
    for bad in ([-1], [tok.vocab_size], [1, 2**40]):
        r = client.post("/detokenize", json={"tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    r = client.post("/detokenize", json={"tokens": ["a"]})
    assert r.status_code == 400
    r = client.post("/tokenize", json={"prompt": "a", "messages": messages})
    assert r.status_code == 400


def test_chat_template_override(client, llm, tmp_path, monkeypatch):
    from lmstack_api.state import ServerState

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}]
    state = client.app.state["server"]
    for value in (str(path), path.read_text()):
        # Read from the config when the server starts (a file, or inline text)...
        template = ServerState(server_stack(llm, chat_template=value)).chat_template
        assert template == path.read_text()
        # ...and used for chat requests and /tokenize.
        monkeypatch.setattr(state, "chat_template", template)
        monkeypatch.setattr(state, "_chat_tokenizer", None)
        r = client.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert client.post("/detokenize", json=r.json()).json()["prompt"] == "<<user:Hi>>"
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("<<user:Hi>>"))
    assert llm.tokenizer.chat_template != template  # the engine's own tokenizer is untouched


def test_missing_chat_template_file_is_a_config_error(llm, tmp_path):
    from lmstack.errors import ConfigError
    from lmstack_api.state import ServerState

    with pytest.raises(ConfigError, match="server.chat_template: cannot read"):
        ServerState(server_stack(llm, chat_template=str(tmp_path / "nope.jinja")))
    with pytest.raises(ConfigError, match="does not compile"):
        ServerState(server_stack(llm, chat_template="{% for m in messages %}"))


def test_regex_holds_with_ngram_drafts(client, llm, monkeypatch):
    """The n-gram drafter proposes what the prompt continues with (", " after each item), which
    the regex forbids: the verifier rejects those drafts and the output still matches."""
    ngram = pytest.importorskip("lmstack_ngram.speculator")
    drafter = ngram.NgramSpeculator(ngram.NgramOptions(num_draft_tokens=4, adaptive=False))
    monkeypatch.setattr(llm.engine, "speculator", drafter)
    pattern = r"[0-9]{3}-[a-z]{3}( [0-9]{3}-[a-z]{3}){1,2}"
    prompt = [{"role": "user", "content": "Repeat: 123-abc, 456-def, 123-abc, 456-def, 123-abc"}]
    before = llm.engine.stats.num_draft_tokens
    for seed in range(4):
        body = {"messages": prompt, "structured_outputs": {"regex": pattern}, "max_tokens": 40}
        temp = {"temperature": 0} if seed == 0 else {"temperature": 1.0, "seed": seed}
        r = client.post("/v1/chat/completions", json={**body, **temp})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert re.fullmatch(pattern, text), text
    assert llm.engine.stats.num_draft_tokens > before  # drafts were proposed and verified


@pytest.mark.parametrize("choice", ['say "hi"', "back\\slash", "two\nlines", "tab\there", "café ☕"])
def test_choice_grammar_spells_each_choice_exactly(llm, choice):
    """The EBNF built from a choice list accepts each choice's text exactly: quotes,
    backslashes, control characters and non-ASCII text survive the escaping."""
    import xgrammar as xgr

    from lmstack.sample.grammar import choice_ebnf

    others = ["plain", choice + "x"]
    grammar = llm.engine.grammar_compiler.ebnf(choice_ebnf([choice, "plain"]))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar._compiled)
        return bool(m.accept_string(text)) and m.is_completed()

    assert accepts(choice) and accepts(others[0]) and not accepts(others[1])
    assert not accepts(choice[:-1])


def test_regex_and_grammar_sources_are_bounded_and_checked_in_the_guard(llm):
    """Regexes and grammars go through the schema's bounds: the size limit, and the killable
    child compile whose rejection is xgrammar's message naming the field."""
    import asyncio

    from lmstack.errors import InvalidRequestError
    from lmstack_api.errors import APIError
    from lmstack_api.grammar_guard import CompileGuard

    compiler = llm.engine.grammar_compiler
    with pytest.raises(InvalidRequestError, match="grammar_max_schema_bytes") as e:
        compiler.prepare_source(
            "ebnf", 'root ::= "' + "a" * 100 + '"', param="structured_outputs.grammar", max_bytes=64
        )
    assert e.value.param == "structured_outputs.grammar"
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        compiler.prepare_source("regex", "", param="structured_outputs.regex")

    async def run() -> tuple[int, APIError]:
        guard = CompileGuard(timeout_s=300, memory_bytes=1 << 30)
        try:
            ok = compiler.prepare_source("regex", "[0-9]{3}", param="structured_outputs.regex")
            nbytes = await guard.check(compiler, ok)
            with pytest.raises(APIError) as e:
                bad = compiler.prepare_source("ebnf", "root ::= foo", param="structured_outputs.grammar")
                await guard.check(compiler, bad)
            return nbytes, e.value
        finally:
            await guard.aclose()

    nbytes, err = asyncio.run(run())
    assert nbytes > 0
    assert err.status == 400 and err.param == "structured_outputs.grammar"
    assert err.message.startswith("invalid grammar:") and 'Rule "foo" is not defined' in err.message
