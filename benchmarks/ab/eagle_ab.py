"""A/B of `eagle` speculator settings at batch 1, in one process: plain decoding and one engine per
setting, the systems alternating prompt by prompt (and their order reversed every other
repeat), so that a noisy machine's drift falls on all alike. What `benchmarks/e2e/eagle.py` measures
for one setting, for several side by side.

    python benchmarks/ab/eagle_ab.py --head DIR [--stack examples/stacks/eagle.yaml] \\
        --variant policy4:num_draft_tokens=4 --variant auto4:num_draft_tokens=4,min_chain_prob=auto \\
        [--repeats 3] [--max-tokens 128] [--out DIR]

Each `--variant NAME:key=value,...` is the `eagle` options over the base ones (`head`,
`draft_vocab` 2048, `head_weights` int8, adaptive, 4 drafts); values are read as JSON where they
parse (numbers, true / false), else kept as strings ("auto"). Held-out chat prompts bundled with
lmstack-eagle, chat template, greedy, EOS respected. Per system: decode tok/s = (output tokens -
1) / (finish - first token), median over prompts x repeats, and its ratio to plain decoding's;
tokens per decode step (every decode step, those without drafts too); whether every output
equals plain decoding's. Writes eagle_ab.json under --out (default benchmarks/results/eagle_ab-<date>-<cpu kind>/); quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from lmstack_bench.toolbox import ab_record, alternate_batch1, result_dir


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, body = text.partition(":")
    if not name or not body:
        raise SystemExit(f"--variant {text!r}: expected NAME:key=value[,key=value...]")
    options: dict[str, Any] = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True)
    ap.add_argument(
        "--stack", default="examples/stacks/eagle.yaml", help="dtype, quant and attention from here"
    )
    ap.add_argument("--variant", action="append", required=True, type=parse_variant)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import yaml

    from lmstack import LLM, SamplingParams
    from lmstack_eagle.train import bundled_prompts

    chosen = yaml.safe_load(Path(args.stack).read_text()) or {}
    base = {
        "model": chosen.get("model", "smollm2-135m-instruct"),
        "dtype": "auto",
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 1, "max_num_batched_tokens": 2048},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
    }
    base.update({key: chosen[key] for key in ("dtype", "quant", "attention") if key in chosen})
    eagle = {
        "name": "eagle",
        "head": args.head,
        "num_draft_tokens": 4,
        "draft_vocab": 2048,
        "head_weights": "int8",
    }
    specs = {"plain": {"name": "none"}} | {name: {**eagle, **opts} for name, opts in args.variant}
    llms = {name: LLM({**base, "speculator": spec}) for name, spec in specs.items()}
    tok = llms["plain"].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in bundled_prompts("prompts_eval.txt")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates, outputs, generated, requests = alternate_batch1(llms, prompts, params, args.repeats)
    tok_s = {n: statistics.median(v) for n, v in rates.items()}
    systems = {}
    for name in llms:
        stats = llms[name].get_stats()
        systems[name] = {
            "options": specs[name],
            "decode_tok_s": tok_s[name],
            "speedup": tok_s[name] / tok_s["plain"],
            "identical_outputs": outputs[name] == outputs["plain"],
            # Every decode step, those without drafts too (each request's first token comes
            # from its prefill step: one step and one token per request left out).
            "mean_tokens_per_decode_step": (generated[name] - requests[name])
            / max(stats.num_steps - requests[name], 1),
            "accepted_length_histogram": dict(sorted(stats.spec_decode_accepted_lengths.items())),
        }
    ab_record(
        result_dir("eagle_ab", args.out) / "eagle_ab.json",
        systems,
        ratios={f"{name} / plain": s["speedup"] for name, s in systems.items() if name != "plain"},
        stack=base,
        prompts=len(prompts),
        repeats=args.repeats,
        max_tokens=args.max_tokens,
    )
    for name, s in systems.items():
        print(
            f"{name:12s} {s['speedup']:.3f}x  {s['mean_tokens_per_decode_step']:.3f} tokens/step  "
            f"identical {s['identical_outputs']}"
        )


if __name__ == "__main__":
    main()
