"""`benchmarks/compare_servers.py`: the target arithmetic and report, and its transformers peer
(`benchmarks/peers/hf_static_server.py`) serving the load generator. (The llama.cpp peer needs a
build of llama-server, which CI does not make; the recorded run in benchmarks/results shows it.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from lmstack_bench.metrics import RequestRecord
from lmstack_bench.report import BenchResult, RunResult
from lmstack_bench.runner import LoadSpec

from lmstack_api.testing import free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import compare_servers  # noqa: E402


def steady_run(
    concurrency: int, n: int, ttft: float, tpot: float, tokens: int = 10, gap: float = 100.0
) -> RunResult:
    """n requests `gap` seconds apart, `tokens` tokens each, one chunk per token."""
    records = []
    for i in range(n):
        start = i * gap
        chunks = [start + ttft + k * tpot for k in range(tokens)]
        records.append(
            RequestRecord(
                start=start,
                end=chunks[-1],
                prompt_tokens=5,
                output_tokens=tokens,
                first_token=chunks[0],
                chunk_times=chunks,
            )  # fmt: skip
        )
    return RunResult.of(LoadSpec(concurrency=concurrency, num_requests=n), records, None)


def result(label: str, runs: list[RunResult]) -> BenchResult:
    return BenchResult(label=label, base_url="http://x", model="m", config={}, runs=runs)


def test_targets_compare_lmstack_with_llama_cpp():
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.020), steady_run(8, 2, 0.5, 0.05),
                            steady_run(16, 2, 0.1, 0.05), steady_run(32, 2, 0.1, 0.05)])  # fmt: skip
    ll = result("llama.cpp", [steady_run(1, 2, 0.1, 0.010), steady_run(8, 2, 0.9, 0.05),
                              steady_run(16, 3, 0.1, 0.05), steady_run(32, 2, 0.1, 0.05, gap=400.0)])  # fmt: skip
    got = {t["what"].split(":")[0]: t for t in compare_servers.targets({"lmstack": lm, "llama.cpp": ll})}
    # Output tok/s: 20 vs 30 tokens over ~100 s vs ~200 s (0.67x); 20 vs 20 over ~100 vs ~400 s (~4x).
    c16 = (20 / lm.runs[2].summary.duration_s) / (30 / ll.runs[2].summary.duration_s)
    assert got["concurrency 16"]["value"] == pytest.approx(c16) and not got["concurrency 16"]["pass"]
    c32 = (20 / lm.runs[3].summary.duration_s) / (20 / ll.runs[3].summary.duration_s)
    assert got["concurrency 32"]["value"] == pytest.approx(c32) and got["concurrency 32"]["pass"]
    assert got["concurrency 8"]["value"] == pytest.approx([500.0, 900.0]) and got["concurrency 8"]["pass"]
    # Batch-1 decode: 1 / median TPOT, 50 vs 100 tok/s.
    assert got["concurrency 1"]["value"] == pytest.approx(0.5) and got["concurrency 1"]["pass"] is None
    assert compare_servers.targets({"lmstack": lm}) == []


def test_report_names_every_target_and_command():
    lm = result("lmstack", [steady_run(8, 2, 0.5, 0.05)])
    ll = result("llama.cpp", [steady_run(8, 2, 0.4, 0.05)])
    results = {"lmstack": lm, "llama.cpp": ll}
    report = {
        "date": "2026-11-29T12:00:00", "machine": {"cpu_model": "cpu", "cpus_usable": 2, "memory_total_gib": 8},
        "loadavg_before": (0.1, 0, 0), "git": {"commit": "abc", "dirty": False}, "gguf": "m.gguf",
        "input_len": 200, "output_len": 128, "slo": "ttft=2s", "targets": compare_servers.targets(results),
        "command": "python benchmarks/compare_servers.py", "build_commands": ["cmake --build b"],
        "build_seconds": 200.0, "llama_server": "/b/llama-server", "server_commands": ["llama-server -np 8"],
        "bench_commands": ["lmstack bench serve --concurrency 8"],
    }  # fmt: skip
    md = compare_servers.markdown(report, results, "2026-11-29-servers")
    assert (
        "| concurrency 8: P99 TTFT ms, lmstack vs llama.cpp | 500 vs 400 | lmstack lower | **MISS** |" in md
    )
    for line in ("cmake --build b", "llama-server -np 8", "lmstack bench serve --concurrency 8"):
        assert line in md
    assert "(2026-11-29-servers.png)" in md


def test_shared_prefix_runs_compare_median_ttft():
    lm = result("lmstack", [steady_run(1, 2, 0.2, 0.05)])
    ll = result("llama.cpp", [steady_run(1, 2, 0.6, 0.05)])
    results = {"lmstack": lm, "llama.cpp": ll}
    (t,) = compare_servers.targets(results, "shared-prefix")
    assert t["value"] == pytest.approx([200.0, 600.0]) and t["ratio"] == pytest.approx(3.0)
    assert t["pass"] is None and "shared prefix" in t["what"]
    report = {
        "date": "2026-12-01T06:00:00", "machine": {"cpu_model": "cpu", "cpus_usable": 2, "memory_total_gib": 8},
        "loadavg_before": (0.1, 0, 0), "git": {"commit": "abc", "dirty": False}, "gguf": "m.gguf",
        "workload": "shared-prefix", "prefix_len": 1024, "input_len": 32, "output_len": 16, "slo": "ttft=2s",
        "targets": [t], "command": "python benchmarks/compare_servers.py --workload shared-prefix",
        "build_commands": [], "build_seconds": None, "llama_server": None, "server_commands": [],
        "bench_commands": [],
    }  # fmt: skip
    md = compare_servers.markdown(report, results, "2026-12-01-servers-shared-prefix")
    assert "1024-token system prompts" in md and "prefix-cache.yaml" in md
    assert "200 vs 600 (llama.cpp / lmstack 3.00×)" in md


def test_transformers_peer_serves_the_load_generator(smollm2_path, hf_smollm2_folder, tmp_path):
    port = free_port()
    log = (tmp_path / "peer.log").open("w")
    # The peer loads SmolLM2 from a Hugging Face folder (the GGUF path, used by the benchmark,
    # costs ~30 s of load here and is the same transformers code the oracle tests run).
    peer = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks/peers/hf_static_server.py"), "--port", str(port),
         "--batch-size", "4", "--model", str(hf_smollm2_folder)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert peer.poll() is None, (tmp_path / "peer.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the transformers peer did not become healthy"
            time.sleep(0.5)
        out = tmp_path / "peer.json"
        cmd = [sys.executable, "-c", "import sys; from lmstack.cli import main; sys.exit(main())", "bench",
               "serve", "--base-url", base, "--tokenizer", str(smollm2_path), "--concurrency", "3",
               "--num-requests", "6", "--input-len", "24", "--output-len", "8", "--out", str(out),
               "--no-plot", "--no-progress"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        (run,) = json.loads(out.read_text())["runs"]
        assert run["summary"]["completed"] == 6 and run["summary"]["failed"] == 0
        assert all(r["output_tokens"] == 8 and r["prompt_tokens"] >= 24 for r in run["requests"])

        bad = httpx.post(base + "/v1/completions", content=b"{not json", timeout=10)
        assert bad.status_code == 400 and "message" in bad.json()["error"]
    finally:
        peer.terminate()
        peer.wait(timeout=30)
        log.close()
