"""Offline throughput, batch-1 decode, KV-cache waste and memory: lmstack vs Hugging Face `generate`.

Both systems run in the same invocation, on identical token-id prompts, each phase in its own
subprocess (so timings and peak RSS are isolated); this parent process builds the workload,
collects the workers' JSON, and writes `offline_throughput.json` and `.png` into
`benchmarks/results/offline_throughput-<date>-<cpu kind>/`.

    python benchmarks/e2e/offline_throughput.py                 # the full run (minutes)
    python benchmarks/e2e/offline_throughput.py --quick         # a smoke run (8 prompts, 32 tokens)

Measurements:
  (a) throughput: N prompts (16..512 tokens, seeded), T output tokens each, greedy, EOS ignored.
      lmstack: continuous batching (max_num_seqs = --batch-size). HF: static left-padded batches
      of the same size. Output tokens per second of wall time, prefill included.
  (b) batch-1 decode: one ~32-token prompt, T new tokens; tokens/s after the first token;
      median of --repeats runs.
  (c) KV-cache waste of lmstack during (a), at the step where allocated blocks peak:
      (allocated token slots - tokens whose K/V are cached) / allocated token slots.
  (d) peak RSS of each worker process, of each timed phase alone, and while the engine is built
      and its weights load (high-water mark right after the build, and its rise over the RSS before).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import (
    BenchError,
    die_with_parent,
    git_info,
    log,
    machine_info,
    median,
    offline_stack,
    result_dir,
    run_worker_process,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "smollm2-135m-instruct"
TARGETS = {
    "throughput_ratio": (">=", 3.0),
    "decode_ratio": (">=", 1.5),
    "kv_waste_at_peak": ("<", 0.04),
}
SYSTEMS = ("lmstack", "hf")
PHASES = ("throughput", "decode")
LABEL = {"lmstack": "lmstack", "hf": "HF transformers"}

# Prompt text: varied English sentences, shuffled per prompt by a seeded RNG.
SENTENCES = [
    "The committee met on Tuesday to review the budget for the coming year.",
    "A light rain fell over the harbour while the fishing boats returned one by one.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She opened the old notebook and found a map drawn in faded blue ink.",
    "Most modern processors execute several instructions in parallel on each core.",
    "The recipe calls for two cups of flour, a pinch of salt, and three eggs.",
    "After the storm, volunteers cleared fallen branches from the village roads.",
    "In 1969, two astronauts walked on the surface of the Moon for the first time.",
    "The museum's new exhibit traces the history of printing from woodblocks to lasers.",
    "Children in the park were flying kites shaped like dragons and birds.",
    "A balanced diet includes vegetables, whole grains, and enough protein.",
    "The train to the coast leaves at seven and arrives shortly before noon.",
    "Engineers tested the bridge by driving heavy trucks across it at night.",
    "Her grandmother kept bees and sold honey at the Saturday market.",
    "Water boils at a lower temperature at high altitude because the air pressure is lower.",
    "The library extended its opening hours during the examination period.",
    "He practised the violin every morning before the rest of the house woke up.",
    "Good documentation explains not only how a system works but why it was built that way.",
    "The forest trail climbs steeply for a mile and then follows a quiet river.",
    "Local farmers reported an early harvest thanks to the unusually warm spring.",
    "A cache stores recently used data so that later requests can be served faster.",
    "The city council voted to plant a thousand trees along the main avenues.",
    "Our neighbours adopted a small grey cat that sleeps on the windowsill all day.",
    "The orchestra tuned their instruments as the audience slowly took their seats.",
    "Glaciers carve wide valleys as they move slowly down from the mountains.",
    "The startup hired three new engineers to rebuild its payment system.",
    "On clear nights you can see the Milky Way stretching across the sky.",
    "The teacher asked each student to write a short story about a journey.",
    "Bread dough needs time to rise in a warm place before it is baked.",
    "The lighthouse keeper logged every passing ship in a leather-bound book.",
    "Researchers measured the temperature of the lake at ten different depths.",
    "The marathon route winds through old neighbourhoods and along the river.",
    "Why do some languages have so many words for snow, while others have only one?",
    "The software update fixed a bug that caused the application to crash on startup.",
    "Tomorrow's forecast predicts strong winds and scattered showers in the afternoon.",
    "The chess champion spent an hour considering a single move in the final game.",
    "Bees communicate the location of flowers to each other through a kind of dance.",
    "The old mill by the stream has been turned into a small bakery and café.",
    "Students gathered in the courtyard to celebrate the end of the semester.",
    "A good night's sleep improves memory, mood, and concentration.",
]


# --- small utilities ------------------------------------------------------------------------


def _mib(n_bytes: int | float) -> float:
    return round(n_bytes / 2**20, 1)


class PeakRSS:
    """Peak resident set size over a `with` block. On Linux the kernel's high-water mark is reset at
    entry (`/proc/self/clear_refs` = 5) and read at exit (VmHWM): exact and free. Elsewhere a
    psutil sampling thread (every 5 ms) stands in."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.peak_before_bytes = 0  # the process's peak before the block (VmHWM only; the reset loses it)
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _vm_hwm() -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def __enter__(self) -> PeakRSS:
        self.peak_before_bytes = self._vm_hwm() or 0
        try:
            Path("/proc/self/clear_refs").write_text("5")
            if self._vm_hwm() is not None:
                self.method = "VmHWM"
                return self
        except OSError:
            pass
        import psutil

        proc = psutil.Process()
        self.method = "psutil-sampled"
        self.peak_bytes = proc.memory_info().rss

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak_bytes = max(self.peak_bytes, proc.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.method == "VmHWM":
            self.peak_bytes = self._vm_hwm() or 0
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()


def _process_peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# --- the workload (built once, in the parent) ------------------------------------------------


def build_workload(args: argparse.Namespace) -> dict[str, Any]:
    from lmstack.model.source import open_model_source

    source = open_model_source(args.model)
    tok = source.tokenizer
    rng = random.Random(args.seed)
    n = args.num_prompts
    lo, hi = 16, 512
    # Evenly spread lengths, in a seeded random order (so static batches mix short and long).
    lens = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)] if n > 1 else [hi]
    rng.shuffle(lens)

    def text_ids(target: int) -> list[int]:
        sents: list[str] = []
        ids: list[int] = []
        while len(ids) < target:
            sents += rng.sample(SENTENCES, k=min(8, len(SENTENCES)))
            ids = tok.encode(" ".join(sents))
        return ids[:target]

    prompts = [text_ids(n_tok) for n_tok in lens]
    decode_prompt = text_ids(32)
    stack = offline_stack(args.model, args.dtype, args.batch_size)
    if args.stack:
        # The components of a stack file (its weights and attention), with this benchmark's model,
        # dtype and batch sizes, so both systems still run the same model in the same dtype.
        import yaml

        chosen = yaml.safe_load(Path(args.stack).read_text()) or {}
        stack.update({key: chosen[key] for key in ("quant", "attention") if key in chosen})
    return {
        "dtype": args.dtype,
        "hf_dtype": args.hf_dtype or args.dtype,
        "stack_file": args.stack,
        "model": args.model,
        "model_path": str(source.path),
        "model_format": source.format,
        "stack": stack,
        "prompts": prompts,
        "output_tokens": args.output_tokens,
        "batch_size": args.batch_size,
        "throughput_repeats": args.throughput_repeats,
        "decode_prompt": decode_prompt,
        "decode_new_tokens": args.output_tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "vocab_size": source.config.vocab_size,
    }


# --- lmstack worker --------------------------------------------------------------------------


def _lmstack_steps_until_done(
    engine: Any, rids: list[str], max_steps: int, on_step: Any = None
) -> dict[str, Any]:
    """Step until every request in `rids` finished; returns their final outputs by id."""
    pending = set(rids)
    final: dict[str, Any] = {}
    steps = 0
    while pending:
        outs = engine.step()
        if on_step is not None:
            on_step(outs)
        for out in outs:
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                final[out.request_id] = out
                if out.outputs and out.outputs[0].finish_reason == "abort":
                    raise RuntimeError(f"lmstack aborted request {out.request_id}: {out.error}")
        steps += 1
        if pending and (steps > max_steps or not engine.has_unfinished()):
            raise RuntimeError(
                f"lmstack made no progress: {len(pending)} request(s) unfinished after {steps} steps"
            )
    return final


class KVProbe:
    """After each step: the block-table slots live sequences hold vs. the tokens cached in them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.block_size = engine.allocator.block_size
        self.num_blocks = engine.allocator.num_blocks
        self.series: list[tuple[int, int, int]] = []  # (blocks in tables, cached tokens, allocator used)
        self.seconds = 0.0

    def __call__(self, _outs: Any) -> None:
        t0 = time.perf_counter()
        alloc = self.engine.allocator
        blocks = cached = 0
        for req in self.engine.requests.values():
            for seq in req.seqs:
                table = alloc.block_table(seq)
                if table:
                    blocks += len(table)
                    cached += seq.num_computed_tokens
        self.series.append((blocks, cached, self.num_blocks - alloc.num_free_blocks()))
        self.seconds += time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        if not self.series:
            return {}
        i = max(range(len(self.series)), key=lambda k: self.series[k][0])
        blocks, cached, used_by_allocator = self.series[i]
        slots = blocks * self.block_size
        return {
            "peak_step": i,
            "num_steps": len(self.series),
            "block_size": self.block_size,
            "num_blocks_total": self.num_blocks,
            "peak_allocated_blocks": blocks,
            "peak_allocated_slots": slots,
            "peak_cached_tokens": cached,
            "peak_blocks_in_use_per_allocator": used_by_allocator,
            "waste_at_peak": (slots - cached) / slots if slots else 0.0,
            # Per step: [blocks in block tables, cached tokens, blocks the allocator counts as used].
            "series": [list(s) for s in self.series],
            "probe_seconds": round(self.seconds, 6),
        }


def lmstack_worker(phase: str, w: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmstack.engine.llm_engine import LLMEngine
    from lmstack.sampling_params import SamplingParams

    res: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    engine = LLMEngine(w["stack"])
    res["load_s"] = time.perf_counter() - t0
    _record_build_peak(res, rss_before)
    res["num_kv_blocks"] = engine.allocator.num_blocks
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        rids = [engine.add_request(p, warm) for p in _warmup_prompts(w)]
        _lmstack_steps_until_done(engine, rids, max_steps=1000)
        res["rss_after_load_mib"] = _mib(_rss_bytes())

        if phase == "throughput":
            T = w["output_tokens"]
            params = SamplingParams(temperature=0.0, max_tokens=T, ignore_eos=True)
            total_tokens = sum(len(p) for p in w["prompts"]) + T * len(w["prompts"])
            runs = []
            with PeakRSS() as peak:
                for r in range(w["throughput_repeats"]):
                    probe = KVProbe(engine)
                    start = time.perf_counter()
                    # An offline batch, read when it ends (as `LLM.generate` and HF's generate):
                    # no stream's gap between tokens holds prompts back (`Request.streamed`).
                    rids = [engine.add_request(p, params, streamed=False) for p in w["prompts"]]
                    final = _lmstack_steps_until_done(
                        engine, rids, max_steps=4 * total_tokens + 1000, on_step=probe
                    )
                    elapsed = time.perf_counter() - start - probe.seconds
                    outs = [final[rid].token_ids for rid in rids]
                    n_out = sum(len(o) for o in outs)
                    short = [i for i, o in enumerate(outs) if len(o) != T]
                    if short:
                        raise RuntimeError(f"lmstack produced != {T} tokens for prompt(s) {short[:5]}")
                    kv = probe.summary()
                    runs.append(
                        {
                            "elapsed_s": elapsed,
                            "output_tokens": n_out,
                            "tokens_per_s": n_out / elapsed,
                            "num_steps": kv["num_steps"],
                            "num_preemptions_so_far": engine.get_stats().num_preemptions,
                            "kv": kv,
                        }
                    )
                    log(
                        f"[lmstack/throughput] run {r + 1}: {n_out} tokens in {elapsed:.2f} s "
                        f"= {n_out / elapsed:.1f} tok/s ({runs[-1]['num_steps']} steps)"
                    )
                    if r == 0:
                        res["output_token_ids"] = outs
            res["runs"] = runs
            res["tokens_per_s_median"] = median([r["tokens_per_s"] for r in runs])
        else:
            T = w["decode_new_tokens"]
            params = SamplingParams(temperature=0.0, max_tokens=T, ignore_eos=True)
            runs = []
            with PeakRSS() as peak:
                for r in range(w["repeats"]):
                    times: list[float] = []

                    def clock(outs: Any, times: list[float] = times) -> None:
                        now = time.perf_counter()
                        for out in outs:
                            times.extend([now] * (len(out.token_ids) - len(times)))

                    start = time.perf_counter()
                    rid = engine.add_request(list(w["decode_prompt"]), params)
                    final = _lmstack_steps_until_done(engine, [rid], max_steps=4 * T + 1000, on_step=clock)
                    runs.append(_decode_run(times, start))
                    log(
                        f"[lmstack/decode] run {r + 1}: {runs[-1]['decode_tokens_per_s']:.1f} tok/s after the "
                        f"first token (TTFT {runs[-1]['ttft_s'] * 1000:.0f} ms)"
                    )
                    if r == 0:
                        res["output_token_ids"] = [final[rid].token_ids]
            res["runs"] = runs
            res["decode_tokens_per_s_median"] = median([r["decode_tokens_per_s"] for r in runs])
        _record_peaks(res, peak)
    finally:
        engine.shutdown()
    return res


def _warmup_prompts(w: dict[str, Any]) -> list[list[int]]:
    """The shortest and the longest prompt: a short generate that still meets the largest prefill."""
    by_len = sorted(w["prompts"], key=len)
    return [by_len[0], by_len[-1]] if len(by_len) > 1 else by_len


def _decode_run(times: list[float], start: float) -> dict[str, Any]:
    if len(times) < 2:
        raise RuntimeError(f"decode produced {len(times)} token(s); need at least 2 to time decoding")
    span = times[-1] - times[0]
    return {
        "new_tokens": len(times),
        "ttft_s": times[0] - start,
        "decode_s": span,
        "decode_tokens_per_s": (len(times) - 1) / span,
        "total_s": times[-1] - start,
    }


# --- Hugging Face worker ---------------------------------------------------------------------


def hf_worker(phase: str, w: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    res: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "transformers": transformers.__version__}
    path = Path(w["model_path"])
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    if w["model_format"] == "gguf":
        folder, kw = path.parent, {"gguf_file": path.name}
    else:
        folder, kw = path, {}
    model = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, w["hf_dtype"]), **kw).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    res["load_s"] = time.perf_counter() - t0
    _record_build_peak(res, rss_before)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise RuntimeError("the HF tokenizer has neither a pad nor an EOS token to pad with")
    gen_cfg = model.generation_config
    gen_cfg.temperature = gen_cfg.top_p = gen_cfg.top_k = None  # greedy: silence sampling-knob warnings
    res["pad_token_id"] = pad_id

    def generate(batch: list[list[int]], new_tokens: int, streamer: Any = None) -> torch.Tensor:
        enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                generation_config=gen_cfg,
                streamer=streamer,
            )
        return out[:, enc["input_ids"].shape[1] :]

    generate(_warmup_prompts(w), 4)
    lin = model.model.layers[0].self_attn.q_proj
    res["model_info"] = {  # what the peer really runs (transformers may keep GGUF weights packed)
        "linear_class": f"{type(lin).__module__}.{type(lin).__qualname__}",
        "weight_dtype": str(lin.weight.dtype),
        "attn_implementation": model.config._attn_implementation,
    }
    res["rss_after_load_mib"] = _mib(_rss_bytes())

    if phase == "throughput":
        T, B = w["output_tokens"], w["batch_size"]
        prompts = w["prompts"]
        runs = []
        with PeakRSS() as peak:
            for r in range(w["throughput_repeats"]):
                batch_s: list[float] = []
                outs: list[list[int]] = []
                start = time.perf_counter()
                for i in range(0, len(prompts), B):
                    b0 = time.perf_counter()
                    gen = generate(prompts[i : i + B], T)
                    batch_s.append(time.perf_counter() - b0)
                    if gen.shape[1] != T:
                        raise RuntimeError(f"HF generated {gen.shape[1]} tokens per row, expected {T}")
                    outs += gen.tolist()
                elapsed = time.perf_counter() - start
                n_out = sum(len(o) for o in outs)
                runs.append(
                    {
                        "elapsed_s": elapsed,
                        "output_tokens": n_out,
                        "tokens_per_s": n_out / elapsed,
                        "batch_seconds": batch_s,
                        # Prompt tokens HF computes, padding included.
                        "padded_prompt_tokens": sum(
                            len(chunk) * max(map(len, chunk))
                            for chunk in (prompts[i : i + B] for i in range(0, len(prompts), B))
                        ),
                    }
                )
                log(
                    f"[hf/throughput] run {r + 1}: {n_out} tokens in {elapsed:.2f} s = {n_out / elapsed:.1f} tok/s "
                    f"({len(batch_s)} batch(es))"
                )
                if r == 0:
                    res["output_token_ids"] = outs
        res["runs"] = runs
        res["tokens_per_s_median"] = median([r["tokens_per_s"] for r in runs])
    else:
        T = w["decode_new_tokens"]

        class Clock(BaseStreamer):
            """Timestamps every generated token (`put` gets the prompt first, then one token per step)."""

            def __init__(self) -> None:
                self.times: list[float] = []
                self._prompt_seen = False

            def put(self, value: torch.Tensor) -> None:
                now = time.perf_counter()
                if not self._prompt_seen:
                    self._prompt_seen = True
                    return
                self.times.extend([now] * value.numel())

            def end(self) -> None:
                pass

        runs = []
        with PeakRSS() as peak:
            for r in range(w["repeats"]):
                clock = Clock()
                start = time.perf_counter()
                gen = generate([list(w["decode_prompt"])], T, streamer=clock)
                runs.append(_decode_run(clock.times, start))
                log(
                    f"[hf/decode] run {r + 1}: {runs[-1]['decode_tokens_per_s']:.1f} tok/s after the first token "
                    f"(TTFT {runs[-1]['ttft_s'] * 1000:.0f} ms)"
                )
                if r == 0:
                    res["output_token_ids"] = gen.tolist()
        res["runs"] = runs
        res["decode_tokens_per_s_median"] = median([r["decode_tokens_per_s"] for r in runs])
    _record_peaks(res, peak)
    return res


def _record_build_peak(res: dict[str, Any], rss_before: int) -> None:
    """Peak RSS while the engine (or the HF model) was built and its weights loaded: the process
    high-water mark right after the build, before any warm-up, and its rise over the RSS
    before the build (what loading the weights cost at its worst moment)."""
    peak = _process_peak_rss_bytes()
    res["rss_before_build_mib"] = _mib(rss_before)
    res["build_peak_rss_mib"] = _mib(peak)
    res["build_peak_rss_delta_mib"] = _mib(peak - rss_before)


def _record_peaks(res: dict[str, Any], peak: PeakRSS) -> None:
    res["phase_peak_rss_mib"] = _mib(peak.peak_bytes)
    res["phase_peak_rss_method"] = peak.method
    # Resetting VmHWM also resets getrusage's ru_maxrss: the whole-process peak is the larger of
    # the peak before the phase (load, warm-up) and the peak since.
    res["load_peak_rss_mib"] = _mib(peak.peak_before_bytes)
    res["process_peak_rss_mib"] = _mib(
        max(peak.peak_before_bytes, peak.peak_bytes, _process_peak_rss_bytes())
    )


def run_worker(args: argparse.Namespace) -> int:
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result_path = Path(args.result)
    try:
        w = json.loads(Path(args.workload).read_text())
        fn = lmstack_worker if args.worker == "lmstack" else hf_worker
        res = fn(args.phase, w)
        res.update(system=args.worker, phase=args.phase)
        result_path.write_text(json.dumps(res))
        return 0
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports it
        return 130
    except Exception as e:  # reported to the parent, which prints one clear line
        result_path.write_text(
            json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        )
        return 1


# --- parent: orchestration -------------------------------------------------------------------


def run_child(
    system: str, phase: str, workload: Path, tmp: Path, timeout: float, verbose: bool = False
) -> dict[str, Any]:
    result = tmp / f"{system}-{phase}.json"
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", system, "--phase", phase,
        "--workload", str(workload), "--result", str(result), "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    log(f"== {LABEL[system]}: {phase} (worker subprocess)")
    env = os.environ | {"TQDM_DISABLE": "1"}  # transformers' GGUF loader draws a bar on every load
    return run_worker_process(cmd, result, f"{LABEL[system]} {phase}", timeout, verbose, env=env)


def _prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check(name: str, value: float) -> dict[str, Any]:
    op, target = TARGETS[name]
    ok = value >= target if op == ">=" else value < target
    return {"value": value, "op": op, "target": target, "pass": bool(ok)}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far the two systems' greedy outputs agree, per sequence."""
    m = [_prefix_match(x, y) for x, y in zip(a, b)]
    return {
        "identical_sequences": sum(1 for x, y in zip(a, b) if x == y),
        "num_sequences": len(m),
        "mean_matching_prefix_tokens": sum(m) / len(m) if m else 0.0,
        "min_matching_prefix_tokens": min(m) if m else 0,
    }


def summarize(res: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """Medians, ratios, target checks and memory, from the workers' results (token ids left out)."""
    res = {k: {f: v for f, v in r.items() if f != "output_token_ids"} for k, r in res.items()}
    lt, ht = res["lmstack", "throughput"], res["hf", "throughput"]
    ld, hd = res["lmstack", "decode"], res["hf", "decode"]
    tp_ratio = lt["tokens_per_s_median"] / ht["tokens_per_s_median"]
    dec_ratio = ld["decode_tokens_per_s_median"] / hd["decode_tokens_per_s_median"]
    kv = lt["runs"][0]["kv"]

    memory = {
        f"{s}_{p}": {k: res[s, p].get(k) for k in ("load_s", "rss_before_build_mib", "build_peak_rss_mib",
                                                  "build_peak_rss_delta_mib", "load_peak_rss_mib", "rss_after_load_mib",
                                                  "phase_peak_rss_mib", "process_peak_rss_mib", "phase_peak_rss_method")}
        for s in SYSTEMS for p in PHASES
    }  # fmt: skip
    checks = {
        "throughput_ratio": _check("throughput_ratio", tp_ratio),
        "decode_ratio": _check("decode_ratio", dec_ratio),
        "kv_waste_at_peak": _check("kv_waste_at_peak", kv["waste_at_peak"]),
    }
    return {
        "throughput": {
            "lmstack_tokens_per_s": lt["tokens_per_s_median"],
            "hf_tokens_per_s": ht["tokens_per_s_median"],
            "ratio": tp_ratio,
            "lmstack": lt,
            "hf": ht,
        },
        "decode": {
            "lmstack_tokens_per_s": ld["decode_tokens_per_s_median"],
            "hf_tokens_per_s": hd["decode_tokens_per_s_median"],
            "ratio": dec_ratio,
            "lmstack": ld,
            "hf": hd,
        },
        "kv_cache": kv,
        "memory": memory,
        "targets": checks,
        "all_targets_pass": all(c["pass"] for c in checks.values()),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    panels = [
        ("throughput", "throughput_ratio",
         f"(a) offline throughput\n{cfg['num_prompts']} prompts (16-512 tok) x {cfg['output_tokens']} out, "
         f"batch {cfg['batch_size']}"),
        ("decode", "decode_ratio",
         f"(b) batch-1 decode\n{cfg['decode_prompt_len']}-tok prompt, {cfg['decode_new_tokens']} new, "
         f"median of {cfg['repeats']}"),
    ]  # fmt: skip
    for ax, (key, target_key, title) in zip(axes, panels):
        sec = report[key]
        vals = [sec["lmstack_tokens_per_s"], sec["hf_tokens_per_s"]]
        bars = ax.bar([LABEL["lmstack"], LABEL["hf"]], vals, color=["#2b6cb0", "#a0aec0"])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=10)
        t = report["targets"][target_key]
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("output tokens / s")
        ax.set_ylim(0, max(vals) * 1.3)
        ax.text(0.5, 0.92, f"ratio {sec['ratio']:.2f}x  (target {t['op']} {t['target']}x: "
                f"{'pass' if t['pass'] else 'MISS'})", transform=ax.transAxes, ha="center", fontsize=10,
                color="#276749" if t["pass"] else "#c53030", fontweight="bold")  # fmt: skip
    kv = report["kv_cache"]
    mem = report["memory"]
    m = report["machine"]
    foot = (
        f"KV waste at peak ({kv['peak_allocated_blocks']} blocks): {kv['waste_at_peak'] * 100:.2f}%   "
        f"phase peak RSS (MiB): lmstack {mem['lmstack_throughput']['phase_peak_rss_mib']:.0f} / "
        f"HF {mem['hf_throughput']['phase_peak_rss_mib']:.0f} (a), "
        f"{mem['lmstack_decode']['phase_peak_rss_mib']:.0f} / {mem['hf_decode']['phase_peak_rss_mib']:.0f} (b)\n"
        f"{report['date']}  {m['cpu_model']}  {m['cpus_usable']} CPUs  load avg {m['loadavg_before'][0]:.1f}  "
        f"torch {m['torch']}  "
        f"transformers {m['transformers']}  bf16{'  QUICK SMOKE RUN' if report['quick'] else ''}"
    )
    fig.text(0.5, 0.01, foot, ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Offline throughput / batch-1 decode / KV waste / memory: lmstack vs HF transformers.",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 32 output tokens, batch 8")
    p.add_argument(
        "--out",
        default=None,
        help="folder (default benchmarks/results/offline_throughput-<date>-<cpu kind>[-quick])",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})")
    p.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int,
                   help="lmstack max_num_seqs and HF static batch size (default 64; quick 8)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, help="prompts in (a) (default 64; quick 8)")
    p.add_argument(
        "--output-tokens", type=int, help="output tokens per prompt in (a) and (b) (default 128; quick 32)"
    )
    p.add_argument("--repeats", type=int, default=3, help="batch-1 decode repeats; the median is reported")
    p.add_argument("--throughput-repeats", type=int, default=1, help="repeats of (a); the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and texts")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="both systems' compute dtype (float32 on CPUs without native bf16)",
    )
    p.add_argument(
        "--hf-dtype",
        choices=("bfloat16", "float32"),
        help="transformers' dtype where it should differ from --dtype (e.g. its faster bfloat16 on a "
        "native-bf16 CPU against a float32-only lmstack stack); default: --dtype",
    )
    p.add_argument(
        "--stack",
        help="take lmstack's quant and attention sections from this stack file (e.g. examples/stacks/cpu.yaml)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show a failing worker's traceback")
    p.add_argument("--worker-timeout", type=float, default=3600.0, help="seconds each worker may run")
    # Internal: one worker subprocess.
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if not (args.phase and args.workload and args.result):
            p.error("--worker needs --phase, --workload and --result")
        return args
    quick = args.quick
    args.batch_size = args.batch_size if args.batch_size is not None else (8 if quick else 64)
    args.num_prompts = args.num_prompts if args.num_prompts is not None else (8 if quick else 64)
    args.output_tokens = args.output_tokens if args.output_tokens is not None else (32 if quick else 128)
    for name in ("batch_size", "num_prompts", "repeats", "throughput_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.output_tokens < 2:
        p.error(
            f"--output-tokens must be >= 2 (decode speed is timed after the first token), got {args.output_tokens}"
        )
    if args.worker_timeout <= 0:
        p.error("--worker-timeout must be positive")
    return args


def preflight(args: argparse.Namespace) -> None:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "accelerate", "gguf", "matplotlib", "psutil")
               if importlib.util.find_spec(m) is None]  # fmt: skip
    if missing:
        raise BenchError(
            f"missing package(s): {', '.join(missing)}; run `make install` (or pip install them)"
        )
    from lmstack.errors import ConfigError
    from lmstack.model.source import resolve_model_path

    try:
        resolve_model_path(args.model)
    except ConfigError as e:
        raise BenchError(str(e)) from None
    try:
        args.out = result_dir("offline_throughput", args.out, tag="quick" if args.quick else "")
    except OSError as e:
        raise BenchError(f"cannot create --out folder {args.out}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join([__file__, *argv])
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return run_worker(args)

    # SIGTERM unwinds like Ctrl-C, so the running worker is stopped in run_child's `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        preflight(args)
        started = dt.datetime.now().astimezone()
        load_before = os.getloadavg()
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if load_before[0] > 0.25 * ncpu:
            log(
                f"warning: load average {load_before[0]:.2f} on {ncpu} CPUs: other work is running, timings will "
                "be noisy (oversubscribed torch threads can be many times slower)"
            )
        workload = build_workload(args)
        results: dict[tuple[str, str], dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix="lmstack-bench-") as tmpdir:
            tmp = Path(tmpdir)
            wpath = tmp / "workload.json"
            wpath.write_text(json.dumps(workload))
            for phase in PHASES:
                for system in SYSTEMS:
                    results[system, phase] = run_child(
                        system, phase, wpath, tmp, args.worker_timeout, args.verbose
                    )
        finished = dt.datetime.now().astimezone()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    summary = summarize(results)
    tp_match = agreement(
        results["lmstack", "throughput"]["output_token_ids"], results["hf", "throughput"]["output_token_ids"]
    )
    decode_match = agreement(
        results["lmstack", "decode"]["output_token_ids"], results["hf", "decode"]["output_token_ids"]
    )
    prompt_lens = [len(p) for p in workload["prompts"]]
    report: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "command": command,
        "cwd": os.getcwd(),
        "git": git_info(),
        "quick": args.quick,
        "machine": machine_info() | {"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {
            "model": workload["model"],
            "model_path": workload["model_path"],
            "dtype": workload["dtype"],
            "lmstack_stack": workload["stack"],
            "lmstack_stack_file": workload["stack_file"],
            "hf": {
                "class": "LlamaForCausalLM",
                "dtype": workload["hf_dtype"],
                "padding_side": "left",
                "static_batch_size": args.batch_size,
                "do_sample": False,
                "max_new_tokens": args.output_tokens,
                "min_new_tokens": args.output_tokens,
                "model_info": results["hf", "throughput"].get("model_info"),
            },
            "lmstack_sampling": {"temperature": 0.0, "max_tokens": args.output_tokens, "ignore_eos": True},
            "lmstack_requests": "throughput: streamed=False (an offline batch, as LLM.generate)",
            "num_prompts": len(prompt_lens),
            "prompt_lens": prompt_lens,
            "prompt_tokens_total": sum(prompt_lens),
            "output_tokens": args.output_tokens,
            "batch_size": args.batch_size,
            "throughput_repeats": args.throughput_repeats,
            "decode_prompt_len": len(workload["decode_prompt"]),
            "decode_new_tokens": workload["decode_new_tokens"],
            "repeats": args.repeats,
            "seed": args.seed,
            "timing": {
                "throughput": "wall time from submitting all prompts to the last output token (prefill included); "
                "lmstack's KV probe time is excluded",
                "decode": "(new tokens - 1) / (time of last token - time of first token)",
            },
        },  # fmt: skip
        **summary,
        "greedy_agreement": {
            "note": "bf16 on both sides: tokens may diverge after a while; informational only",
            "throughput": tp_match,
            "decode": decode_match,
        },
    }

    out = Path(args.out)
    stem = "offline_throughput"
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, png_path)
    except Exception as e:  # the numbers are in the JSON already; a plotting failure must not lose them
        print(f"warning: could not draw {png_path}: {type(e).__name__}: {e}", file=sys.stderr)

    t, d, kv = report["targets"], report, report["kv_cache"]

    def flag(c: dict[str, Any]) -> str:
        return "pass" if c["pass"] else "MISS"

    print(
        f"(a) throughput  lmstack {d['throughput']['lmstack_tokens_per_s']:9.1f} tok/s   "
        f"HF {d['throughput']['hf_tokens_per_s']:9.1f} tok/s   ratio {d['throughput']['ratio']:.2f}x "
        f"(target >= {t['throughput_ratio']['target']}x: {flag(t['throughput_ratio'])})"
    )
    print(
        f"(b) decode b=1  lmstack {d['decode']['lmstack_tokens_per_s']:9.1f} tok/s   "
        f"HF {d['decode']['hf_tokens_per_s']:9.1f} tok/s   ratio {d['decode']['ratio']:.2f}x "
        f"(target >= {t['decode_ratio']['target']}x: {flag(t['decode_ratio'])})"
    )
    print(
        f"(c) KV waste at peak: {kv['waste_at_peak'] * 100:.2f}% of {kv['peak_allocated_slots']} slots "
        f"({kv['peak_allocated_blocks']} blocks, step {kv['peak_step']}) "
        f"(target < {t['kv_waste_at_peak']['target'] * 100:.0f}%: {flag(t['kv_waste_at_peak'])})"
    )
    mem = report["memory"]
    print("(d) peak RSS MiB (phase / process):  " + "   ".join(
        f"{LABEL[s]} {p} {mem[f'{s}_{p}']['phase_peak_rss_mib']:.0f} / {mem[f'{s}_{p}']['process_peak_rss_mib']:.0f}"
        for p in PHASES for s in SYSTEMS))  # fmt: skip
    print("(d) peak RSS MiB while loading (peak / rise over before):  " + "   ".join(
        f"{LABEL[s]} {mem[f'{s}_throughput']['build_peak_rss_mib']:.0f} / +{mem[f'{s}_throughput']['build_peak_rss_delta_mib']:.0f}"
        for s in SYSTEMS))  # fmt: skip
    print(
        f"greedy agreement (a): {tp_match['identical_sequences']}/{tp_match['num_sequences']} identical, "
        f"mean matching prefix {tp_match['mean_matching_prefix_tokens']:.1f} tokens; "
        f"(b): {decode_match['mean_matching_prefix_tokens']:.0f}/{workload['decode_new_tokens']}"
    )
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
