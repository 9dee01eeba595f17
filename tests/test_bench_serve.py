"""`lmstack bench serve`: workloads sized in tokens, one-line errors, and short runs against a
live lmstack server (closed loop sweep, open loop, multi-turn chat), checked through the
results it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lmstack_bench.cli import main as bench_main
from lmstack_bench.workloads import LengthRange, WorkloadSpec, load_sharegpt, sessions

from lmstack_api.testing import free_port

MODEL = "smollm2-135m-instruct"
# test_api_server.py's stack: the session starts one server for both modules.
STACK = {
    "model": MODEL,
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "scheduler": {"name": "continuous", "max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "128MiB"},
    "server": {"max_body_bytes": 1_000_000},
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from lmstack.model.source import open_model_source

    return open_model_source(smollm2_path).tokenizer


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(STACK)


def take(it, n):
    return [next(it) for _ in range(n)]


def test_random_prompts_have_the_asked_token_counts(tokenizer):
    spec = WorkloadSpec(input_len=LengthRange(100, 0.5), output_len=LengthRange(20, 0.25), seed=3)
    got = take(sessions(spec, tokenizer), 20)
    for s in got:
        (turn,) = s.turns
        assert s.system is None
        assert len(tokenizer.encode(turn.user)) == turn.expected_prompt_tokens
        assert 50 <= turn.expected_prompt_tokens <= 150
        assert 15 <= turn.max_tokens <= 25
    assert len({s.turns[0].user for s in got}) == 20
    assert len({s.turns[0].expected_prompt_tokens for s in got}) > 5  # a spread, not one length
    assert got == take(sessions(spec, tokenizer), 20)  # seeded


def test_shared_prefix_and_multi_turn_sessions(tokenizer):
    spec = WorkloadSpec(kind="shared-prefix", num_prefixes=3, prefix_len=64, input_len=LengthRange(16))
    got = take(sessions(spec, tokenizer), 30)
    prefixes = {s.system for s in got}
    assert len(prefixes) == 3
    assert all(len(tokenizer.encode(p)) == 64 for p in prefixes)
    assert len({s.turns[0].user for s in got}) == 30

    conv = next(sessions(WorkloadSpec(kind="multi-turn", turns=3, input_len=LengthRange(8)), tokenizer))
    assert len(conv.turns) == 3 and len({t.user for t in conv.turns}) == 3


def test_sharegpt_file(tmp_path, tokenizer):
    data = [
        {"conversations": [{"from": "human", "value": "Tell me a story about a small red fox."},
                           {"from": "gpt", "value": "Once upon a time a fox lived in a wood."}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model"},
                           {"from": "human", "value": "skipped"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "no conversations"},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there friend!"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    assert len(load_sharegpt(path)) == 2
    spec = WorkloadSpec(kind="sharegpt", dataset=path)
    turns = {s.turns[0].user: s.turns[0] for s in take(sessions(spec, tokenizer), 4)}
    # "Hi" is under 4 prompt tokens and is skipped; the reply's length is the output length.
    assert list(turns) == ["Tell me a story about a small red fox."]
    fox = turns["Tell me a story about a small red fox."]
    assert fox.max_tokens == len(tokenizer.encode("Once upon a time a fox lived in a wood."))

    path.write_text("[1, 2")
    with pytest.raises(ValueError, match="not JSON"):
        load_sharegpt(path)
    with pytest.raises(ValueError, match="dataset-path"):
        WorkloadSpec(kind="sharegpt")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sweep", "batch=1,2"], "bad --sweep"),
        (["--sweep", "concurrency=1.5"], "whole numbers"),
        (["--concurrency", "2", "--request-rate", "1"], "only one of"),
        (["--workload", "sharegpt"], "dataset-path"),
        (["--tokenizer", "/nonexistent/model.gguf"], "cannot load a tokenizer"),
        ([], "every warm-up request failed"),  # nothing listens on the port
    ],
)
def test_cli_errors_are_one_line(capsys, smollm2_path, extra, message):
    argv = ["serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", MODEL, "--no-progress",
            "--num-requests", "1", *extra]  # fmt: skip
    assert bench_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_cli_rejects_a_bad_slo(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["serve", "--base-url", "http://x", "--slo", "ttft=soon"])
    assert exc.value.code == 2
    assert "bad SLO duration" in capsys.readouterr().err


def run_bench(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from lmstack.cli import main; sys.exit(main())", "bench", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_closed_loop_sweep_against_a_live_server(server, tmp_path):
    out = tmp_path / "sweep.json"
    proc = run_bench(
        "serve", "--base-url", server.base_url, "--sweep", "concurrency=1,4", "--duration", "3",
        "--input-len", "32", "--output-len", "8", "--slo", "ttft=60s,tpot=10s", "--out", str(out),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "concurrency 4" in proc.stdout and "out tok/s" in proc.stdout
    data = json.loads(out.read_text())
    assert data["model"] == MODEL  # taken from /v1/models
    assert "bench serve --base-url" in data["config"]["command"]
    assert [r["load"]["concurrency"] for r in data["runs"]] == [1, 4]
    for run in data["runs"]:
        s, reqs = run["summary"], run["requests"]
        assert s["failed"] == 0 and s["completed"] == len(reqs) >= 1
        # Fixed output length: the server's usage says exactly 8 tokens for every request.
        assert all(r["output_tokens"] == 8 for r in reqs)
        assert all(r["prompt_tokens"] >= 32 for r in reqs)
        assert all(0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0 for r in reqs)
        assert s["output_tokens"] == 8 * s["completed"]
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # lax SLOs: every request meets them
        assert s["ttft"]["median"] <= s["ttft"]["p99"]
    # Closed loop: one request at a time with one client; four at once with four.
    for run, clients in zip(data["runs"], (1, 4)):
        reqs = run["requests"]
        first_end = min(r["start_s"] + r["e2e_s"] for r in reqs)
        assert sum(r["start_s"] < first_end for r in reqs) == clients
    assert (tmp_path / "sweep-cdf.png").stat().st_size > 0
    assert (tmp_path / "sweep-sweep.png").stat().st_size > 0

    plot = run_bench("plot", str(out), str(out), "--out", str(tmp_path / "both"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "both-sweep.png").stat().st_size > 0


def test_open_loop_and_multi_turn_chat(server, tmp_path):
    out = tmp_path / "open.json"
    proc = run_bench(
        "serve", "--base-url", server.base_url, "--request-rate", "20", "--arrivals", "constant",
        "--num-requests", "4", "--input-len", "16", "--output-len", "4", "--out", str(out),
        "--no-plot", "--no-progress", "--warmup", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    starts = sorted(r["start_s"] for r in run["requests"])
    assert len(starts) == 4 and run["summary"]["failed"] == 0
    # Arrivals every 50 ms whatever the server does (open loop): the fourth is sent no earlier than
    # 150 ms after the first (a burst would send all four at once).
    assert starts[-1] >= 0.1

    out = tmp_path / "chat.json"
    proc = run_bench(
        "serve", "--base-url", server.base_url, "--endpoint", "chat", "--workload", "multi-turn",
        "--turns", "3", "--concurrency", "2", "--num-requests", "6", "--input-len", "16",
        "--output-len", "6", "--out", str(out), "--no-plot", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["summary"]["completed"] == 6
    # Two conversations of three turns, interleaved: each turn's prompt holds the earlier turns
    # (the user texts and the replies), so prompt sizes grow within a conversation.
    sizes = sorted(r["prompt_tokens"] for r in run["requests"])
    assert sizes[-1] >= sizes[0] + 2 * (16 + 6)
