"""Does an EAGLE head know when it is right? Its probability for each draft token (the softmax
of its draft logits) against whether verification accepted it, and what stopping chains on the
head's odds (`min_chain_prob`) would keep and cut, measured on the held-out chat prompts.

    python benchmarks/quality/eagle_confidence.py --stack examples/stacks/eagle.yaml \
        --head smollm2-135m-instruct --out DIR

Batch 1, greedy, `--num-draft-tokens` (6) drafts every step, not adaptive, so every chain runs to
its end and each draft whose predecessors were accepted has a verdict. Per probability decile:
drafts and the share accepted (a calibrated head: the share ~ the probability). Then, replaying
the recorded chains offline for each bar c: the chain cut before the first draft whose chain
probability (the product of the head's probabilities so far) is below c, the tokens per step and
per verification that leaves, and the drafts it saves. Writes DIR/eagle_confidence.json and the
command. No timing: the speed of a stopping rule is what `benchmarks/e2e/eagle.py --min-chain-prob`
measures.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", default="examples/stacks/eagle.yaml")
    ap.add_argument("--head", default="smollm2-135m-instruct", help="a bundled head's name or a head folder")
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--bars", default="0,0.02,0.05,0.1,0.15,0.2,0.3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import yaml

    from lmstack import LLM, SamplingParams
    from lmstack.kernels.hardware import cpu_description
    from lmstack_eagle.train import bundled_prompts

    stack = yaml.safe_load(Path(args.stack).read_text()) or {}
    stack["scheduler"] = {"name": "continuous", "max_num_seqs": 1, "max_num_batched_tokens": 2048}
    stack["speculator"] = {
        **(stack.get("speculator") or {}),
        "name": "eagle",
        "head": str(Path(args.head).expanduser()),
        "num_draft_tokens": args.num_draft_tokens,
        "adaptive": False,
        "min_chain_prob": 1e-30,  # > 0: the head's probabilities are computed; nothing stops
    }
    llm = LLM(stack)
    spec, drafts = llm.engine.speculator, llm.engine.drafts
    probs: list[float] = []
    pending: dict[int, list[float]] = {}
    chains: list[tuple[list[float], int]] = []  # (probabilities of the drafts, accepted)
    argmax, propose, verified = spec._argmax, spec.propose, drafts.verified

    def recording_argmax(feature):
        out = argmax(feature)
        probs.append(out[2])
        return out

    def recording_propose(seqs):
        probs.clear()
        out = propose(seqs)
        for seq in seqs:  # batch 1: one sequence
            pending[seq.seq_id] = list(probs[: len(out.get(seq.seq_id, []))])
        return out

    def recording_verified(seq, num_drafted, num_accepted, *rest):
        if num_drafted:
            chains.append((pending.pop(seq.seq_id, [])[:num_drafted], num_accepted))
        return verified(seq, num_drafted, num_accepted, *rest)

    spec._argmax, spec.propose, drafts.verified = recording_argmax, recording_propose, recording_verified
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in bundled_prompts("prompts_eval.txt")]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))

    deciles = [[0, 0] for _ in range(10)]  # drafts reached (predecessors accepted), accepted
    for ps, accepted in chains:
        for j, p in enumerate(ps[: accepted + 1]):
            d = deciles[min(int(p * 10), 9)]
            d[0] += 1
            d[1] += j < accepted
    calibration = [
        {"prob": f"{i / 10:.1f}-{(i + 1) / 10:.1f}", "drafts": n, "accepted_share": a / n if n else None}
        for i, (n, a) in enumerate(deciles)
    ]
    stops = []
    for bar in (float(b) for b in args.bars.split(",")):
        tokens = drafted = verifications = verified_tokens = 0
        for ps, accepted in chains:
            kept = 0
            while kept < len(ps) and math.prod(ps[: kept + 1]) >= bar:
                kept += 1
            gained = min(accepted, kept)
            tokens += 1 + gained
            drafted += kept
            if kept:
                verifications += 1
                verified_tokens += 1 + gained
        stops.append(
            {
                "min_chain_prob": bar,
                "tokens_per_step": tokens / max(len(chains), 1),
                "tokens_per_verification": verified_tokens / max(verifications, 1),
                "drafts_per_step": drafted / max(len(chains), 1),
            }
        )
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "cpu": cpu_description(),
        "head": args.head,
        "stack_file": args.stack,
        "num_draft_tokens": args.num_draft_tokens,
        "prompts": len(prompts),
        "verifications": len(chains),
        "calibration": calibration,
        "stops": stops,
    }
    print(json.dumps({k: result[k] for k in ("verifications", "calibration", "stops")}, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eagle_confidence.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "command.txt").write_text(result["command"] + "\n")


if __name__ == "__main__":
    main()
