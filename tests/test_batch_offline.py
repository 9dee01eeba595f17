"""`lmstack batch run`: a batch input file answered offline in the Batch API's line format, equal
to the same requests sent one by one over the API (greedy, fp32, tiny model), and resumable
after a SIGKILL with every custom_id answered exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytest.importorskip("lmstack_api")

from lmstack import cli  # noqa: E402


@pytest.fixture(scope="module")
def stack_file(tiny_model_path, tmp_path_factory):
    from lmstack.testing.kit import tiny_stack

    stack = tiny_stack(
        tiny_model_path,
        max_model_len=256,
        allocator={"name": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256},
        cache="none",
    )
    path = tmp_path_factory.mktemp("stack") / "stack.yaml"
    path.write_text(yaml.safe_dump(stack))
    return path


@pytest.fixture(scope="module")
def api(stack_file):
    """The HTTP API in process on the same stack: the one-by-one oracle."""
    from litestar.testing import TestClient

    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.engine.llm import LLM
    from lmstack_api.app import create_app
    from lmstack_api.state import ServerState

    llm = LLM(str(stack_file))
    app = create_app(llm.engine.stack, ServerState(llm.engine.stack, AsyncEngine(llm.engine)))
    with TestClient(app) as c:
        yield c


def _line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _read(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_answers_equal_the_api_one_by_one_and_bad_lines_are_errors(stack_file, api, tmp_path, capsys):
    requests = {
        f"chat-{i}": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 5 + i, "temperature": 0},
        )
        for i in range(4)
    }
    requests |= {
        f"cmpl-{i}": ("/v1/completions", {"prompt": f"one two {i}", "max_tokens": 6, "temperature": 0})
        for i in range(4)
    }
    lines = [_line(cid, url, body) for cid, (url, body) in requests.items()]
    lines += [
        "[1, 2]",
        _line("cmpl-0", "/v1/completions", {"prompt": "x"}),
        _line("bad-url", "/v1/embeddings", {"input": "x"}),
        _line("bad-model", "/v1/completions", {"prompt": "x", "model": "nope"}),
        _line("too-long", "/v1/completions", {"prompt": "ab " * 2000}),
    ]
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = ["batch", "run", str(src), "--out", str(out), "--errors", str(err), "--stack", str(stack_file)]
    assert cli.main(argv) == 0
    assert "batch [" in capsys.readouterr().err  # the progress bar
    answers = {r["custom_id"]: r for r in _read(out)}
    assert sorted(answers) == sorted(requests)
    for cid, (url, body) in requests.items():
        alone = api.post(url, json=body).json()
        got = answers[cid]["response"]
        assert got["status_code"] == 200 and answers[cid]["error"] is None
        key = "message" if url.endswith("chat/completions") else "text"
        want, have = alone["choices"][0][key], got["body"]["choices"][0][key]
        assert (have["content"] if key == "message" else have) == (
            want["content"] if key == "message" else want
        )
        assert got["body"]["usage"] == alone["usage"]
    errors = _read(err)
    codes = [
        (r["custom_id"], (r["error"] or {}).get("code") or r["response"]["body"]["error"]["code"])
        for r in errors
    ]
    assert sorted(codes, key=str) == sorted(
        [
            (None, "invalid_request"),
            ("cmpl-0", "duplicate_custom_id"),
            ("bad-url", "invalid_url"),
            ("bad-model", "model_not_found"),
            ("too-long", "context_length_exceeded"),
        ],
        key=str,
    )
    # Run again: everything is answered, nothing runs, nothing is written twice.
    assert cli.main(argv) == 0
    assert len(_read(out)) == len(requests) and len(_read(err)) == 5


def test_killed_run_resumes_and_answers_every_line_once(stack_file, tmp_path):
    body = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}
    lines = [_line(f"k{i}", "/v1/completions", {**body, "prompt": f"n {i}"}) for i in range(24)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    err = out.with_name("out.errors.jsonl")  # the default
    src.write_text("\n".join(lines[:3] + ["{oops"] + lines[3:]))
    cmd = [
        sys.executable,
        "-m",
        "lmstack",
        "batch",
        "run",
        str(src),
        "--out",
        str(out),
        "--stack",
        str(stack_file),
    ]
    proc = subprocess.Popen([*cmd, "--max-inflight", "2"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(_read(out)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    first = _read(out)
    assert 3 <= len(first) < 24
    with open(out, "a") as f:  # a line cut short by the kill is dropped, not kept
        f.write('{"id": "batch_req_x", "custom_')
    assert cli.main(cmd[3:]) == 0
    final = _read(out)
    assert final[: len(first)] == first  # nothing answered before was redone or rewritten
    assert sorted(r["custom_id"] for r in final) == sorted(f"k{i}" for i in range(24))
    assert [r["error"]["code"] for r in _read(err)] == ["invalid_json"]
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in final}
    assert texts["k0"] != texts["k1"]  # different prompts, different greedy text (not a stuck run)


def test_cli_errors_are_one_line(stack_file, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert (
        cli.main(
            ["batch", "run", str(tmp_path / "missing.jsonl"), "--out", str(out), "--stack", str(stack_file)]
        )
        != 0
    )
    assert "cannot read" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    assert cli.main(["batch", "run", str(src), "--out", str(src), "--stack", str(stack_file)]) != 0
    assert "three different files" in capsys.readouterr().err
