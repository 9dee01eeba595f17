"""`lmstack plan`: its memory figures against the engine's own allocator and a loaded model, the
step-time model and the queueing arithmetic against direct computations, the profile cache,
and one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from lmstack import cli
from lmstack.commands.plan_profile import DecodePoint, Profile, StepModel, profile_batches
from lmstack.commands.plan_queue import Slo, Workload, erlang_c, parse_slo, parse_workload, plan_replicas
from lmstack.errors import LmstackError
from lmstack.model.memory import resident_weight_bytes


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


@pytest.fixture(autouse=True)
def plan_cache(tmp_path, monkeypatch):
    """Profiles go to a fresh folder, never the user's cache (whose other folders, the native
    kernels' builds, stay where they are)."""
    folder = tmp_path / "plan-cache"
    monkeypatch.setattr("lmstack.commands.plan_profile.cache_dir", lambda: folder)
    return folder


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------------------------------------
# Memory: the figures against the allocator the engine builds
# ---------------------------------------------------------------------------------------------


def admitted(engine, context: int) -> int:
    """Sequences of `context` tokens the engine's allocator takes before it refuses one."""
    from lmstack.testing import make_seq

    allocator, count = engine.allocator, 0
    while True:
        seq = make_seq(context, vocab=engine.model_config.vocab_size)
        if not allocator.can_allocate(seq, context):
            return count
        allocator.allocate(seq, context)
        count += 1


@pytest.mark.parametrize(
    "context, overrides",
    [
        (1000, ["allocator.kv_cache_memory=1MiB"]),
        (100, ["allocator.kv_cache_memory=300KiB", "allocator.block_size=8", "dtype=float32"]),
        (33, ["allocator.num_blocks=50", "allocator.block_size=32"]),
    ],
)
def test_sequences_that_fit_are_what_the_allocator_admits(capsys, tiny_model_path, context, overrides):
    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.stack.config import load_stack
    from lmstack.stack.overrides import parse_overrides

    sets = [a for o in overrides for a in ("--set", o)]
    plan = plan_json(capsys, str(tiny_model_path), "--context", str(context), *sets)
    m = plan["memory"]
    engine = LLMEngine(load_stack(str(tiny_model_path), parse_overrides(overrides)))
    try:
        block_size = engine.allocator.block_size
        assert m["block_size"] == block_size
        assert m["kv_bytes_per_block"] == engine.executor.kv_cache_bytes_per_block(block_size)
        assert m["num_blocks"] == engine.allocator.num_blocks
        assert m["max_model_len"] == engine.max_model_len
        assert m["sequences_fit"] == admitted(engine, context) > 0
        assert m["weights_bytes"] == resident_weight_bytes(engine.executor.runner.model)
    finally:
        engine.shutdown()


def test_the_default_stack_auto_kv_cache_fits_what_the_allocator_admits(capsys, monkeypatch, tiny_model_path):
    """`kv_cache_memory: auto` (the default stack: a model alone) through the allocator's own rule;
    its 1 GiB CPU cap lowered so that the cap binds here as on a roomy machine, and the cache is small."""
    from lmstack.engine.llm_engine import LLMEngine

    monkeypatch.setattr("lmstack.kernels.hardware.CPU_KV_CAP", 3 * 2**20)
    plan = plan_json(capsys, str(tiny_model_path), "--context", "700")
    m = plan["memory"]
    assert "auto" in m["kv_budget_how"]
    engine = LLMEngine(str(tiny_model_path))
    try:
        assert m["num_blocks"] == engine.allocator.num_blocks
        assert m["sequences_fit"] == admitted(engine, 700) > 0
    finally:
        engine.shutdown()


def test_quantized_weights_are_measured_as_the_engine_holds_them(capsys, tmp_path, tiny_model_path):
    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.testing.gguf_writer import write_gguf

    gguf = str(write_gguf(tiny_model_path, tmp_path / "tiny-q8_0.gguf", tensor_type="q8_0"))
    sets = ["--set", "allocator.kv_cache_memory=1MiB"]
    m = plan_json(capsys, gguf, *sets)["memory"]
    assert "loaded" in m["weights_how"]
    engine = LLMEngine({"model": gguf, "allocator": {"kv_cache_memory": "1MiB"}})
    try:
        assert m["weights_bytes"] == resident_weight_bytes(engine.executor.runner.model)
        assert m["sequences_fit"] == admitted(engine, m["context"]) > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tied", [False, True])
def test_weights_counted_without_loading_equal_the_loaded_model(tmp_path, tied):
    from lmstack.commands.plan_memory import weights_on_meta
    from lmstack.model.memory import measure_weights
    from lmstack.stack.build import check_build
    from lmstack.stack.config import load_stack
    from lmstack.stack.prepare import prepare_stack
    from lmstack.testing.tiny_model import write_tiny_model

    path = write_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    prepared = prepare_stack(load_stack(str(path)))
    r, mc = prepared.resolved, prepared.model_config
    quantizer = check_build(r, mc, prepared.models)["quantizer"]
    loaded = measure_weights(prepared.source, mc, quantizer, dtype=r.dtype, max_positions=512)
    assert weights_on_meta(prepared, quantizer, 512) == loaded.resident_bytes


def test_kv_figures_follow_the_model_config(capsys, tiny_model_path):
    plan = plan_json(
        capsys, str(tiny_model_path), "--context", "40", "--set", "allocator.kv_cache_memory=64KiB"
    )
    m, c = plan["memory"], plan["model_config"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[m["kv_dtype"]]
    assert m["kv_bytes_per_token"] == 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * itemsize
    assert m["blocks_per_sequence"] == math.ceil(40 / m["block_size"])
    assert m["kv_bytes_per_sequence"] == m["blocks_per_sequence"] * m["kv_bytes_per_block"]
    assert m["num_blocks"] == 64 * 1024 // m["kv_bytes_per_block"]
    assert plan["profile"] is None and plan["replicas"] is None


def test_human_output_is_a_table(capsys, tiny_model_path):
    code, out, err = run(capsys, "plan", str(tiny_model_path), "--set", "allocator.kv_cache_memory=1MiB")
    assert code == 0, err
    assert "weights (resident)" in out and "KV cache" in out and "fits" in out and "--profile" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--context", "5000"], "beyond what this stack serves"),
        (["--slo", "ttft=fast"], "duration"),
        (["--slo", "latency=2s"], "ttft=..."),
        (["--workload", "prompt=0"], "positive token count"),
        (["--rate", "3"], "--profile"),
    ],
)
def test_bad_input_is_one_line(capsys, tiny_model_path, argv, words):
    code, _, err = run(capsys, "plan", str(tiny_model_path), "--set", "allocator.kv_cache_memory=1MiB", *argv)
    assert words in one_line_error(code, err)


# ---------------------------------------------------------------------------------------------
# Profile: measured through the engine, cached, reused
# ---------------------------------------------------------------------------------------------


def test_profile_is_measured_cached_and_reused(capsys, tiny_model_path, plan_cache):
    argv = [
        str(tiny_model_path),
        "--set",
        "allocator.kv_cache_memory=1MiB",
        "--set",
        "scheduler.max_num_seqs=4",
    ]
    first = plan_json(capsys, *argv, "--profile")
    p = first["profile"]
    assert [d["batch"] for d in p["decode"]] == [1, 2, 4]
    assert all(d["step_s"] > 0 and d["tokens_per_step"] == 1.0 for d in p["decode"])  # no speculator
    assert p["prefill_tok_s"] > 0
    # The prediction at a measured batch is its measurement.
    measured = {d["batch"]: d["step_s"] for d in p["decode"]}
    assert {q["batch"]: q["step_s"] for q in p["predicted"]} == measured
    assert [f.name for f in plan_cache.iterdir()] == [f"{p['key']}.json"]

    again = plan_json(capsys, *argv, "--rate", "2", "--slo", "tpot=10s")
    assert again["profile"]["decode"] == p["decode"]  # read back, not measured again
    assert again["replicas"]["feasible"] and again["replicas"]["replicas"] >= 1
    # Another stack is another profile.
    other = plan_json(capsys, *argv, "--set", "scheduler.max_num_seqs=2")
    assert other["profile"] is None


def test_profile_batches_end_at_the_stack_limit():
    assert profile_batches(64) == [1, 2, 4, 8, 16, 32, 64]
    assert profile_batches(32) == [1, 2, 4, 8, 16, 32]
    assert profile_batches(5) == [1, 2, 4, 5]


# ---------------------------------------------------------------------------------------------
# The step-time model and the queueing arithmetic
# ---------------------------------------------------------------------------------------------


def model_of(points: dict[int, float], tokens_per_step: float = 1.0) -> StepModel:
    profile = Profile(
        key="k",
        processor="p",
        torch="t",
        threads=1,
        prompt_tokens=64,
        prefill_tokens=512,
        prefill_tok_s=1000.0,
        decode=[DecodePoint(b, t, tokens_per_step) for b, t in points.items()],
    )
    return StepModel.fit(Profile.from_json(json.loads(json.dumps(profile.to_json()))))


def test_step_model_interpolates_between_measured_batches():
    model = model_of({1: 0.010, 4: 0.016, 8: 0.032})
    assert model.step_s(1) == pytest.approx(0.010)
    assert model.step_s(2) == pytest.approx(0.012)
    assert model.step_s(6) == pytest.approx(0.024)
    assert model.step_s(16) == pytest.approx(0.064)  # the last slope carried on
    assert model.step_s(0.5) == pytest.approx(0.010)
    a, b = model.linear()
    xs, ys = [1, 4, 8], [0.010, 0.016, 0.032]
    assert sum((a + b * x - y) * x for x, y in zip(xs, ys, strict=True)) == pytest.approx(0, abs=1e-12)
    assert model_of({1: 0.01}, tokens_per_step=2.0).tpot_s(1) == pytest.approx(0.005)


@pytest.mark.parametrize("n, a", [(1, 0.5), (3, 2.2), (10, 7.9)])
def test_erlang_c_matches_the_closed_form(n, a):
    top = a**n / math.factorial(n) * n / (n - a)
    expected = top / (sum(a**k / math.factorial(k) for k in range(n)) + top)
    assert erlang_c(n, a) == pytest.approx(expected)


def test_replicas_are_the_fewest_that_keep_utilisation_and_ttft():
    model = model_of({1: 0.010, 8: 0.020, 32: 0.080})
    w, prefill_tps = Workload(prompt_tokens=200, output_tokens=100), 1000.0
    plan = plan_replicas(30.0, w, Slo(ttft_s=1.0, tpot_s=0.05), model, prefill_tps, max_batch=64)
    # tpot = t(B) (a token a step): t(B) = 0.02 + 0.0025 (B - 8) <= 0.05 up to B = 20.
    assert plan.batch == 20 and plan.tpot_s == pytest.approx(0.05)
    mu = 1 / (200 / 1000 + 100 * 0.05 / 20)
    assert plan.replica_capacity_rps == pytest.approx(mu)
    # Past the profiled batches nothing is extrapolated: at most the largest measured (32).
    assert plan_replicas(30.0, w, Slo(), model, prefill_tps, max_batch=64).batch == 32

    def ok(n):
        wait = erlang_c(n, 30 / mu) / (n * mu - 30) if n * mu > 30 else math.inf
        return 30 / (n * mu) <= 0.8 and wait + 0.2 <= 1.0

    assert ok(plan.replicas) and not ok(plan.replicas - 1)
    assert plan.utilisation <= 0.8


def test_unmeetable_slos_are_reported_not_raised():
    model = model_of({1: 0.050, 8: 0.100})
    plan = plan_replicas(1.0, Workload(), Slo(tpot_s=0.010), model, 1000.0, max_batch=8)
    assert not plan.feasible and "batch 1" in plan.reason
    plan = plan_replicas(1.0, Workload(prompt_tokens=5000), Slo(ttft_s=1.0), model, 1000.0, max_batch=8)
    assert not plan.feasible and "prefill" in plan.reason


def test_slo_and_workload_parsing():
    assert parse_slo("ttft=2s,tpot=100ms") == Slo(2.0, 0.1)
    assert parse_slo("tpot=0.05") == Slo(None, 0.05)
    assert parse_workload("prompt=1000") == Workload(1000, 128)
    with pytest.raises(LmstackError):
        parse_slo("ttft=-1s")


def test_a_plan_beyond_the_memory_available_says_so(capsys, monkeypatch, tiny_model_path):
    monkeypatch.setattr("lmstack.kernels.hardware.host_available_memory", lambda: 2**20)
    argv = [str(tiny_model_path), "--set", "allocator.kv_cache_memory=4MiB"]
    m = plan_json(capsys, *argv)["memory"]
    assert m["device_available_bytes"] == 2**20
    # This process's runtime is already out of what is available: the rest must fit beside it.
    assert m["headroom_bytes"] == 2**20 - (m["weights_bytes"] + m["kv_cache_bytes"] + m["activation_bytes"])
    code, out, err = run(capsys, "plan", *argv)
    assert code == 0, err
    assert "warning: the plan needs" in out
