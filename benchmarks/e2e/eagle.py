"""EAGLE-1 speculative decoding on this machine: plain greedy decoding vs the `eagle` speculator
(by default the head lmstack-eagle ships for SmolLM2; `--head DIR` takes one trained by
`lmstack eagle train`), batch 1, on the held-out prompts bundled with
lmstack-eagle (`prompts_eval.txt`, disjoint from the training prompts).

    .venv/bin/python benchmarks/e2e/eagle.py [--head NAME|DIR] [--max-tokens 128] [--repeats 2]
        [--stack examples/stacks/eagle.yaml] [--draft-vocab 2048] [--head-weights int8]
        [--streams 32]

Chat template applied, greedy, EOS respected. Each prompt runs alone on each system, the
systems alternating prompt by prompt in one process; decode tok/s = (output tokens - 1) /
(finish - first token), median over prompts x repeats. Also: whether every output equals plain
decoding's (it must), drafts proposed / accepted and the mean accepted drafts per verification.
With `--streams N`, also N requests at once (the held-out prompts cycled, the scheduler's
max_num_seqs raised to N), each system in its own engine, after one warm-up round per engine
(recorded apart; `--streams-ignore-eos`: every stream runs to --max-tokens, a steady load):
output tok/s of wall time, median over `--repeats` runs alternating the
systems (the adaptive draft length under load), and the
median of each repeat's ratio to plain decoding's; `--compare-probe` adds an eagle engine whose
draft policy retries drafting with the whole batch at once (as before `PROBE_SEQS`), and
`--compare-pooled` (batch 1 and streams) one whose policy prices every depth of a chain at the
pooled acceptance rate (`DraftLengthPolicy.by_depth = False`, as before the per-depth rates),
and `--compare-old-pricing` one whose policy prices as before 2026-12-05 (`old_pricing`).
Prints one JSON object; with `--out DIR` also writes it as DIR/eagle.json, with the exact
command (command.txt) and a plot (eagle.png).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct", help="a bundled head's name or a head folder")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--fixed", action="store_true", help="adaptive: false (always num_draft_tokens)")
    ap.add_argument(
        "--stack",
        default=None,
        help="take dtype, quant and attention from this stack file (both systems; default: dtype "
        "auto, no quantizer, the torch attention)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="also run eagle with draft_vocab N (the head's N most frequent tokens)",
    )
    ap.add_argument(
        "--head-weights",
        choices=("fp32", "int8"),
        default="fp32",
        help="the eagle systems' head_weights (int8: lmstack-int8's Int8Linear and CPU kernel)",
    )
    ap.add_argument(
        "--min-chain-prob",
        type=lambda v: v if v == "auto" else float(v),
        default=None,
        help="the eagle systems' min_chain_prob: a number (a chain stops before a draft whose chain "
        "probability, by the head, is below it) or auto (the draft policy sets the bar); default: "
        "the plugin's",
    )
    ap.add_argument("--streams", type=int, default=0, help="also measure N concurrent requests")
    ap.add_argument(
        "--streams-ignore-eos",
        action="store_true",
        help="with --streams: every stream runs to --max-tokens (a steady load of N streams, "
        "not a batch that shrinks as answers end)",
    )
    ap.add_argument(
        "--compare-probe",
        action="store_true",
        help="with --streams: also an eagle engine whose draft policy retries drafting with the "
        "whole batch at once (probe_seqs = 0, the behaviour before the probe)",
    )
    ap.add_argument(
        "--compare-pooled",
        action="store_true",
        help="also the last eagle system with its draft policy pricing every depth at the pooled "
        "acceptance rate (alpha**k, by_depth = False: the policy before the per-depth rates)",
    )
    ap.add_argument(
        "--compare-old-pricing",
        action="store_true",
        help="also the last eagle system with its draft policy as before 2026-12-05's fixes: the "
        "raw step-cost curve (a falling segment clamped), no 2 %% margin, no probe backoff",
    )
    ap.add_argument("--out", default=None, help="a folder for eagle.json, command.txt and eagle.png")
    args = ap.parse_args()

    from lmstack_bench.toolbox import alternate_batch1

    from lmstack import LLM, SamplingParams
    from lmstack.kernels.hardware import cpu_description
    from lmstack_eagle.train import bundled_prompts

    base = {
        "model": args.model,
        "dtype": "auto",
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 1, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
    }
    if args.stack:
        import yaml

        chosen = yaml.safe_load(Path(args.stack).read_text()) or {}
        base.update({key: chosen[key] for key in ("dtype", "quant", "attention") if key in chosen})
    spec = {
        "name": "eagle",
        "head": args.head,
        "num_draft_tokens": args.num_draft_tokens,
        "adaptive": not args.fixed,
        "head_weights": args.head_weights,
    }
    if args.min_chain_prob is not None:
        spec["min_chain_prob"] = args.min_chain_prob
    llms = {
        "plain": LLM({**base, "speculator": {"name": "none"}}),
        "eagle": LLM({**base, "speculator": spec}),
    }
    if args.draft_vocab:
        vocab_spec = {**spec, "draft_vocab": args.draft_vocab}
        llms[f"eagle-vocab{args.draft_vocab}"] = LLM({**base, "speculator": vocab_spec})
    if args.compare_pooled:
        last = list(llms)[-1]
        last_spec = {**spec, "draft_vocab": args.draft_vocab} if args.draft_vocab else spec
        llms[f"{last}-pooled"] = LLM({**base, "speculator": last_spec})
        llms[f"{last}-pooled"].engine.drafts.policy.by_depth = False
    if args.compare_old_pricing:
        last = [n for n in llms if not n.endswith("-pooled")][-1]
        last_spec = {**spec, "draft_vocab": args.draft_vocab} if args.draft_vocab else spec
        llms[f"{last}-old-pricing"] = LLM({**base, "speculator": last_spec})
        old_pricing(llms[f"{last}-old-pricing"].engine.drafts.policy)
    tok = llms["plain"].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in bundled_prompts("prompts_eval.txt")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates, outputs, generated, requests = alternate_batch1(llms, prompts, params, args.repeats)
    tok_s = {n: statistics.median(v) for n, v in rates.items()}
    # A steady load: every stream runs to --max-tokens (no batch shrinking as answers end).
    stream_params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.streams_ignore_eos
    )
    loaded = concurrent(args, base, spec, llms, prompts, stream_params) if args.streams else None
    systems = {}
    for name in list(llms)[1:]:
        stats = llms[name].get_stats()
        hist = dict(sorted(stats.spec_decode_accepted_lengths.items()))
        verifications = sum(hist.values())
        systems[name] = {
            "decode_tok_s": tok_s[name],
            "speedup": tok_s[name] / tok_s["plain"],
            "identical_outputs": outputs["plain"] == outputs[name],
            "drafted": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens,
            "acceptance_rate": stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
            "mean_accepted_per_verification": stats.num_accepted_tokens / max(verifications, 1),
            # EAGLE's "average acceptance length": tokens per target step that verified drafts
            # (the accepted drafts plus the target's own next token).
            "mean_tokens_per_verification": 1 + stats.num_accepted_tokens / max(verifications, 1),
            "accepted_length_histogram": hist,
            # Over every decode step, those without drafts too (a sequence the policy or
            # min_chain_prob kept from drafting emits one token): at batch 1 each request's
            # first token comes from its prefill step, one per request (prompts < 2,048 tokens).
            "mean_tokens_per_decode_step": (generated[name] - requests[name])
            / max(stats.num_steps - requests[name], 1),
        }
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "cpu": cpu_description(),
        "model": args.model,
        "head": args.head,
        "stack_file": args.stack,
        "stack": base,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "num_draft_tokens": args.num_draft_tokens,
        "adaptive": not args.fixed,
        "head_weights": args.head_weights,
        "min_chain_prob": spec.get("min_chain_prob"),
        "plain_decode_tok_s": tok_s["plain"],
        "systems": systems,
        "streams": loaded,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eagle.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "command.txt").write_text(result["command"] + "\n")
        plot(result, out / "eagle.png")


def old_pricing(policy) -> None:
    """The draft policy as before 2026-12-05: the raw bucket means (a falling segment clamped
    flat at its low end), any modelled gain taken, every probe faded alike."""
    policy.cost.monotone = False
    policy.min_rate_gain = 0.0
    policy.max_probe_backoff = 0


def plot(result: dict, path: Path) -> None:
    """Batch-1 decode tok/s per system (and, with streams, output tok/s), ratios to plain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (
            "batch 1: decode tok/s",
            {"plain": result["plain_decode_tok_s"]}
            | {n: s["decode_tok_s"] for n, s in result["systems"].items()},
            {
                n: f"{s['speedup']:.2f}x, {s['mean_tokens_per_decode_step']:.2f} tok/step\n"
                f"({s['mean_tokens_per_verification']:.2f} per verification)"
                for n, s in result["systems"].items()
            },
        )
    ]
    if result["streams"]:
        st = result["streams"]
        paired = st.get("paired_ratio_vs_plain", {})
        ratios = {
            n: f"{r:.2f}x" + (f"\npaired {paired[n]:.2f}x" if n in paired else "")
            for n, r in st["ratio_vs_plain"].items()
        }
        panels.append((f"{st['streams']} streams: output tok/s", st["output_tok_s"], ratios))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (title, values, labels) in zip(axes[0], panels, strict=True):
        bars = ax.bar(
            list(values),
            list(values.values()),
            color=["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"][: len(values)],
        )
        for bar, name in zip(bars, values, strict=True):
            if name in labels:
                ax.annotate(
                    labels[name],
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, labelrotation=12)
    cpu = result["cpu"]
    isa = [f for f in ("avx512_vnni", "avx512_bf16", "amx_tile") if f in cpu.get("cpu_flags", [])]
    name = f"{cpu.get('cpu_model', '?')} ({', '.join(isa) or 'no AVX-512 VNNI'})"
    fig.suptitle(f"EAGLE vs plain decoding, {result['model']}, {name}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def concurrent(args, base, spec, llms, prompts, params) -> dict:
    """args.streams requests at once per system, in engines whose max_num_seqs admits them all."""
    import time

    from lmstack import LLM

    wide = {**base, "scheduler": {**base["scheduler"], "max_num_seqs": args.streams}}
    specs = {"plain": {"name": "none"}, "eagle": spec}
    if args.draft_vocab:
        specs[f"eagle-vocab{args.draft_vocab}"] = {**spec, "draft_vocab": args.draft_vocab}
    for llm in llms.values():  # one set of engines in memory at a time
        llm.engine.shutdown()
    batch = [prompts[i % len(prompts)] for i in range(args.streams)]
    if args.compare_probe:
        last = list(specs)[-1]
        specs[f"{last}-no-probe"] = specs[last]
    if args.compare_pooled:
        last = [n for n in specs if not n.endswith("-no-probe")][-1]
        specs[f"{last}-pooled"] = specs[last]
    if args.compare_old_pricing:
        last = [n for n in specs if not n.endswith(("-no-probe", "-pooled"))][-1]
        specs[f"{last}-old-pricing"] = specs[last]
    engines = {name: LLM({**wide, "speculator": s}) for name, s in specs.items()}
    for name, llm in engines.items():
        if name.endswith("-no-probe"):
            llm.engine.drafts.policy.probe_seqs = 0
        if name.endswith("-pooled"):
            llm.engine.drafts.policy.by_depth = False
        if name.endswith("-old-pricing"):
            old_pricing(llm.engine.drafts.policy)
    # Each fresh engine serves the batch once untimed first: its kernels and caches warm up, and
    # its draft policy, which alternates one draft per sequence with none until it has measured
    # two step sizes, makes its first measurements (each of the 32 sequences' first drafts then
    # runs the head over its whole prompt). A server pays that once; the rates say what it
    # serves after. The warm-up rounds' rates are recorded too.
    warmup: dict[str, float] = {}
    for name, llm in engines.items():
        started = time.perf_counter()
        outs = llm.generate(batch, params)
        warmup[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(args.repeats):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            started = time.perf_counter()
            outs = engines[name].generate(batch, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started))
    tok_s = {n: statistics.median(v) for n, v in rates.items()}
    # Each repeat's ratio to plain decoding in the same repeat (the systems run back to back):
    # steadier than the ratio of medians where the machine's speed drifts between repeats.
    paired = {
        n: statistics.median(a / b for a, b in zip(v, rates["plain"], strict=True))
        for n, v in rates.items()
        if n != "plain"
    }
    return {
        "streams": args.streams,
        "ignore_eos": args.streams_ignore_eos,
        "paired_ratio_vs_plain": paired,
        "output_tok_s": tok_s,
        "output_tok_s_runs": rates,  # per repeat, in the order run (the noise, for the reader)
        "warmup_output_tok_s": warmup,  # each engine's first, untimed-for-the-median round
        "ratio_vs_plain": {n: tok_s[n] / tok_s["plain"] for n in tok_s if n != "plain"},
    }


if __name__ == "__main__":
    main()
