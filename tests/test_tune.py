"""`lmstack tune`: the search against a fake measurement (its walk, its budget, failing
candidates, the winner, the tuned YAML re-loaded by the stack loader), the candidate space built
from the installed plugins, one-line errors, and one real tune of two candidates on the tiny
model served by `lmstack serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lmstack_bench.tune import _seq_rungs, build_parser, default_knobs, main, tune_record, write_stack
from lmstack_bench.tune_search import CandidateFailed, Knob, Measurement, Trial, beats, search

from lmstack.stack.config import load_stack


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_measure(table, clock, cost=30.0, fail=()):
    """measure(stack, deadline) reading goodput from `table` keyed by (max_num_seqs, weights);
    each call advances `clock` by `cost` seconds; stacks whose speculator is in `fail` fail."""
    calls = []

    def measure(stack, deadline):
        calls.append(stack)
        clock.now += cost
        assert clock.now <= deadline, "a measurement ran past the deadline it was given"
        spec = (stack.get("speculator") or {}).get("name", "none")
        if spec in fail:
            raise CandidateFailed(f"the server exited with status 1: no {spec}")
        sched = stack.get("scheduler") if isinstance(stack.get("scheduler"), dict) else {}
        key = (sched.get("max_num_seqs", 8), stack.get("quant", {}).get("weights", "auto"))
        goodput = table.get(key, 0.5)
        return Measurement(goodput=goodput, output_throughput=10 * goodput)

    measure.calls = calls
    return measure


KNOBS = [
    Knob("scheduler.max_num_seqs", (1, 2, 4, 8, 16), 8, ordered=True),
    Knob("quant.weights", ("auto", "int8", "none", "awq"), "auto"),
    Knob("speculator", ({"name": "none"}, {"name": "ngram"}), {"name": "none"}),
]


def test_search_walks_each_knob_and_keeps_the_best():
    clock = FakeClock()
    # Peak at 4 sequences with int8 weights; 2 and 16 sequences are worse than 4.
    table = {(8, "auto"): 1.0, (4, "auto"): 1.4, (2, "auto"): 1.1, (16, "auto"): 0.9, (4, "int8"): 2.0,
             (4, "none"): 0.7, (2, "int8"): 1.5, (8, "int8"): 1.8}  # fmt: skip
    measure = fake_measure(table, clock, fail=("ngram",))
    rejected = []

    def validate(stack):
        if stack.get("quant", {}).get("weights") == "awq":
            rejected.append(stack)
            return "quantizer 'awq' reads autoawq checkpoints, but the model is a gguf checkpoint"
        return None

    result = search({"model": "m"}, KNOBS, measure, budget_s=10_000, validate=validate, clock=clock)
    labels = [t.label for t in result.trials]
    # The ordered knob walks down from 8 while each rung wins (4 wins, 2 loses) and never goes up;
    # then each quantizer over the best so far; the second pass re-walks from (4, int8).
    assert labels[:7] == [
        "start stack",
        "scheduler.max_num_seqs=4",
        "scheduler.max_num_seqs=2",
        "scheduler.max_num_seqs=4, quant.weights=int8",
        "scheduler.max_num_seqs=4, quant.weights=none",
        "scheduler.max_num_seqs=4, quant.weights=awq",
        "scheduler.max_num_seqs=4, quant.weights=int8, speculator=ngram",
    ]
    assert result.best is not None and result.best.stack == {
        "model": "m", "scheduler": {"max_num_seqs": 4}, "quant": {"weights": "int8"},
    }  # fmt: skip
    # Failing and rejected candidates are one line each, never the winner, and the search went on.
    by_label = {t.label: t for t in result.trials}
    awq = by_label["scheduler.max_num_seqs=4, quant.weights=awq"]
    assert not awq.ok and awq.error.startswith("rejected by check: quantizer 'awq'")
    ngram = by_label["scheduler.max_num_seqs=4, quant.weights=int8, speculator=ngram"]
    assert not ngram.ok and ngram.error == "the server exited with status 1: no ngram"
    assert "\n" not in awq.line() and "\n" not in ngram.line()
    assert len(rejected) == 1 and awq.stack not in measure.calls  # rejected: never started
    # Every stack measured once, then the rematch: the winner and the start stack once more.
    keys = [json.dumps(s, sort_keys=True) for s in measure.calls]
    assert len(keys[:-2]) == len(set(keys[:-2])) and measure.calls[-2:] == [result.best.stack, {"model": "m"}]
    assert len(result.best.runs) == 2 and len(result.trials[0].runs) == 2
    assert result.stopped.endswith("rematch: the winner held")
    assert result.best.measurement.goodput == max(t.measurement.goodput for t in result.trials if t.ok)
    assert result.stopped.startswith("converged")


def test_the_rematch_can_give_the_start_stack_back():
    """A winner by luck: 4 sequences measured 2.0 once, then 0.0; the start stack 1.0, then 1.2.
    On the mean of two runs each (1.0 against 1.1) the start stack wins."""
    clock = FakeClock()
    runs = {8: [1.0, 1.2], 4: [2.0, 0.0], 2: [0.5]}

    def measure(stack, deadline):
        clock.now += 10
        goodput = runs[stack.get("scheduler", {}).get("max_num_seqs", 8)].pop(0)
        return Measurement(goodput=goodput, output_throughput=10 * goodput)

    knobs = [Knob("scheduler.max_num_seqs", (1, 2, 4, 8), 8, ordered=True)]
    result = search({"model": "m"}, knobs, measure, budget_s=1000, clock=clock)
    assert result.best is result.trials[0] and result.best.stack == {"model": "m"}
    assert result.best.measurement.goodput == pytest.approx(1.1)
    assert result.trials[1].measurement.goodput == pytest.approx(1.0)
    assert result.trials[1].runs[0].goodput == 2.0 and "mean of 2 runs" in result.trials[1].line()
    assert result.stopped.endswith("rematch: the start stack won")
    assert all(not v for v in runs.values())  # each stack measured exactly as often as planned


def test_search_stops_within_its_budget():
    clock = FakeClock()
    measure = fake_measure({(4, "auto"): 2.0, (2, "auto"): 3.0, (1, "auto"): 4.0}, clock, cost=30.0)
    began = clock.now
    result = search({"model": "m"}, KNOBS, measure, budget_s=100, clock=clock, rematch=False)
    # 30 s each: at 0, 30 and 60 s; at 90 s the 10 s left do not cover another 30 s candidate.
    assert len(measure.calls) == 3 and clock.now - began == 90
    assert result.stopped == "budget: 10 s left, the latest candidate took 30 s"
    assert result.best.stack == {"model": "m", "scheduler": {"max_num_seqs": 2}}

    # With the rematch, the descent keeps two candidates' time for it once the best is not the
    # start: after 4 sequences win at 60 s, the 40 s left go to the rematch, which fits one run.
    clock = FakeClock()
    began = clock.now
    measure = fake_measure({(4, "auto"): 2.0, (2, "auto"): 3.0}, clock, cost=30.0)
    result = search({"model": "m"}, KNOBS, measure, budget_s=100, clock=clock)
    assert [t.label for t in result.trials] == ["start stack", "scheduler.max_num_seqs=4"]
    assert len(measure.calls) == 3 and clock.now - began <= 100
    assert result.stopped == (
        "budget: 40 s left, the latest candidate took 30 s (and 60 s kept for the rematch); "
        "no time left for the rematch"
    )


def test_search_with_no_measurable_candidate_has_no_best():
    clock = FakeClock()
    measure = fake_measure({}, clock, fail=("none", "ngram"))
    result = search({"model": "m"}, KNOBS, measure, budget_s=1000, clock=clock)
    assert result.best is None and all(not t.ok for t in result.trials)
    # A start that fails does not end the search: one pass tries a rung each way and every other
    # value, then stops (nothing improved).
    assert len(result.trials) == 1 + 2 + 3 + 1 and result.stopped.startswith("converged")


def test_ties_go_to_throughput():
    def trial(goodput, tok_s):
        return Trial(0, {}, {}, Measurement(goodput, tok_s))

    assert beats(trial(1.02, 90.0), trial(1.0, 80.0), tie=0.03)  # a tie on goodput: more tok/s wins
    assert not beats(trial(1.02, 70.0), trial(1.0, 80.0), tie=0.03)
    assert beats(trial(1.10, 70.0), trial(1.0, 80.0), tie=0.03)  # beyond the tie: goodput wins
    assert not beats(trial(1.01, 80.5), trial(1.0, 80.0), tie=0.03)  # a tie on both: the incumbent stays
    assert not beats(trial(1.0, 80.0), trial(1.01, 80.5), tie=0.03)
    assert beats(trial(0.0, 5.0), Trial(0, {}, {}, error="failed"))
    assert not beats(Trial(0, {}, {}, error="failed"), trial(0.0, 5.0))


def test_seq_rungs_stop_at_the_clients():
    assert _seq_rungs(64, 8) == (1, 2, 4, 64)  # 8..64 admit 8 clients alike: one rung for them
    assert _seq_rungs(4, 8) == (1, 2, 4, 8)
    assert _seq_rungs(6, 12) == (1, 2, 4, 6, 8, 12)


def test_tuned_yaml_reloads_and_names_every_candidate(tmp_path):
    clock = FakeClock()
    measure = fake_measure({(4, "auto"): 2.0}, clock, fail=("ngram",))
    start = {"model": "smollm2-135m-instruct", "scheduler": "continuous", "server": {"port": 8123}}
    result = search(start, KNOBS[:1] + KNOBS[2:], measure, budget_s=1000, clock=clock)
    argv = ["smollm2-135m-instruct", "--slo", "ttft=2s,tpot=100ms", "--concurrency", "4"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    record = tune_record(args, result, KNOBS, tmp_path)
    out = tmp_path / "tuned.yaml"
    write_stack(out, result.best.stack, record)
    stack = load_stack(out)
    assert stack.model == "smollm2-135m-instruct"
    assert stack.scheduler == {"name": "continuous", "max_num_seqs": 4}
    assert stack.extra_sections == {"server": {"port": 8123}}  # what the user wrote is kept
    header = [ln for ln in out.read_text().splitlines() if ln.startswith("#")]
    assert any("command: lmstack tune smollm2-135m-instruct --slo" in ln for ln in header)
    assert any(ln.startswith("# CPU: ") for ln in header) and any(ln.startswith("# date: ") for ln in header)
    for t in result.trials:  # each candidate's line: goodput and tok/s, or why it failed
        line = next(ln for ln in header if f" {t.index} {t.label}:" in ln)
        if t.ok:
            assert f"goodput {t.measurement.goodput:.3f}" in line and "tok/s" in line
        else:
            assert t.error in line
    assert any(ln.startswith("# *  1 scheduler.max_num_seqs=4") for ln in header)  # the winner marked


def test_default_space_from_the_installed_plugins(smollm2_path):
    from lmstack.stack.plugins import build_registry, make_plugin_manager
    from lmstack.stack.prepare import prepare_stack

    pm = make_plugin_manager()
    registry = build_registry(pm)
    start = {"model": "smollm2-135m-instruct"}
    resolved = prepare_stack(load_stack(start), plugin_manager=pm).resolved
    knobs = {k.path: k for k in default_knobs(resolved, registry, start, concurrency=8)}
    assert list(knobs)[0] == "scheduler.max_num_seqs"  # the most promising knob first
    assert knobs["scheduler.max_num_seqs"].values == (1, 2, 4, 64)
    quant = knobs["quant.weights"]
    installed = set(registry.names("quantizer"))
    # The start's `auto` (gguf for this checkpoint) and every other installed quantizer once.
    assert quant.values[0] == "auto" and set(quant.values[1:]) == installed - {"gguf"}
    assert knobs["speculator"].values == ({"name": "none"}, {"name": "ngram"})
    kv = knobs["quant.kv_cache"].values
    # auto is bfloat16 here and none float32 (gguf computes in float32): neither is tried twice.
    assert kv[0] == "auto" and "bfloat16" not in kv and "float32" not in kv
    assert {"none", "float8_e4m3fn"} <= set(kv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "soon"], "expected a duration"),
        (["--try", "scheduler.max_num_seqs"], "expected KEY.PATH=V1,V2"),
        (["--concurrency", "2", "--request-rate", "1"], "only one of"),
        (["--out", "tuned.json"], "is a .yaml file"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, message):
    try:
        rc = main(["smollm2-135m-instruct", "--slo", "ttft=2s", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and "Traceback" not in err


def test_cli_bad_stack_is_one_line(capsys, tmp_path):
    assert main([str(tmp_path / "missing.yaml"), "--slo", "ttft=2s"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: stack file not found") and "\n" not in err


def test_tune_two_candidates_end_to_end(tiny_model_path, smollm2_path, tmp_path):
    """A real tune: the tiny model served twice by `lmstack serve` (the start stack and one
    candidate), loaded by the bench runner; prompts sized by SmolLM2's tokenizer (the tiny
    tokenizer has too few whole-word tokens to build prompts from)."""
    out = tmp_path / "tuned.yaml"
    cmd = [sys.executable, "-c", "import sys; from lmstack.cli import main; sys.exit(main())", "tune",
           str(tiny_model_path), "--tokenizer", str(smollm2_path), "--slo", "ttft=20s,tpot=5s",
           "--budget", "3m", "--duration", "2", "--warmup", "1", "--concurrency", "2", "--input-len", "16",
           "--output-len", "4", "--try", "scheduler.max_num_seqs=1", "--out", str(out), "--json",
           "--no-progress", "--no-rematch"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    trials = record["trials"]
    assert [t["label"] for t in trials] == ["start stack", "scheduler.max_num_seqs=1"]
    for t in trials:
        d = t["details"]
        assert t["error"] is None and d["failed"] == 0 and d["completed"] >= 1
        # Lax SLOs: every request meets them, so goodput is the request throughput.
        assert d["slo_attainment"] == 1.0 and t["goodput"] == pytest.approx(d["request_throughput"])
        assert t["output_throughput"] == pytest.approx(4 * d["request_throughput"])  # 4 tokens each
    # The winner by the rule (goodput, ties within 3 % to tok/s) is the one written.
    a, b = (Trial(t["index"], {}, {}, Measurement(t["goodput"], t["output_throughput"])) for t in trials)
    assert record["best"] == (1 if beats(b, a) else 0)
    stack = load_stack(out)
    assert stack.model == str(tiny_model_path)
    assert stack.scheduler.get("max_num_seqs") == (1 if record["best"] == 1 else None)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "start stack: goodput" in out.read_text()


def test_lmstack_tune_passes_every_argument_to_the_tuner():
    from lmstack import cli
    from lmstack.stack.plugins import make_plugin_manager

    parser = cli.build_parser(make_plugin_manager(autoload=False, extra_plugins=["lmstack_bench.plugin"]))
    assert "tune" in cli._commands(parser)
    args = parser.parse_args(["tune", "--help"])
    assert args.tune_args == ["--help"]
    args = parser.parse_args(["tune", "m", "--slo", "ttft=2s", "--budget", "10m"])
    assert args.tune_args == ["m", "--slo", "ttft=2s", "--budget", "10m"]
