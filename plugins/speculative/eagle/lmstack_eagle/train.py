"""`lmstack eagle train`: an EAGLE-1 head for a stack's model, by self-distillation.

(a) The target answers the training prompts greedily through `lmstack.LLM(stack)` (all at once,
batched by the engine); (b) `lmstack.quantize.CalibrationModel` recomputes the final-norm hidden
state at every position of prompt + answer in fp32; (c) the head (fc + one decoder layer; the
target's embedding and LM head frozen) learns EAGLE-1's loss
SmoothL1(f'_{t+1}, f_{t+1}) + 0.1 * CE(lm_head(f'_{t+1}), token_{t+2}) with AdamW; (d) the head
is written in the EAGLE folder format (`lmstack_eagle.head`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmstack.errors import ConfigError
from lmstack.progress import Progress
from lmstack_eagle.head import EagleHead, HeadConfig, save_draft_vocab, save_head

DEFAULT_STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "auto",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
}


def bundled_prompts(name: str = "prompts_train.txt") -> list[str]:
    text = resources.files("lmstack_eagle").joinpath(name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@dataclass
class TrainResult:
    head: EagleHead
    losses: list[float] = field(default_factory=list)  # mean loss per epoch
    seconds: dict[str, float] = field(default_factory=dict)


class Target:
    """The target's frozen pieces in fp32: embedding, LM head and the hidden-state forward."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm
        w = cm.weights
        self.embedding = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embedding)
        self.norm = w["model.norm.weight"]
        self.eps = cm.config.rms_norm_eps

    @torch.no_grad()
    def features(self, ids: list[int]) -> torch.Tensor:
        """The final norm's output at every position of `ids`: [L, H] fp32."""
        x = self.cm.embed(torch.tensor([ids]))
        for i in range(self.cm.num_layers):
            x, _ = self.cm.layer_forward(i, x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm * x)[0]


def generate_answers(llm: Any, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """prompt + greedy answer token ids per prompt, all enqueued at once, with a progress bar."""
    from lmstack.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = []
    for p in prompts:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        reqs.append((ids, engine.make_request(ids, params)))
    for _, r in reqs:
        engine.enqueue(r)
    bar = Progress(len(reqs), "eagle: target answers", "prompts")
    final: dict[str, Any] = {}
    while len(final) < len(reqs):
        for out in engine.step():
            if out.finished and out.request_id not in final:
                final[out.request_id] = out
                bar.update(1)
    bar.close()
    return [ids + list(final[r.request_id].outputs[0].token_ids) for ids, r in reqs]


def eagle_loss(
    head: EagleHead,
    target: Target,
    ids: torch.Tensor,
    feats: torch.Tensor,
    ce_positions: int,
    gen: torch.Generator,
    noise: float = 0.0,
) -> torch.Tensor:
    """EAGLE-1's loss on one sequence, ids [L] and feats [L, H]: SmoothL1 between predicted and
    true next features, plus 0.1 x the cross-entropy of the predicted feature's distribution
    (through the LM head) against the target's own next-token distribution (soft labels, as
    EAGLE-1 trains), on up to `ce_positions` random positions."""
    n = ids.shape[0] - 1
    inp = feats[:n]
    if noise:  # EAGLE-1's data noise: uniform, on the input features
        inp = inp + (torch.rand(inp.shape, generator=gen) - 0.5) * (2 * noise)
    emb = F.embedding(ids[1:], target.embedding)
    out, _, _ = head(emb, inp, torch.arange(n))
    reg = F.smooth_l1_loss(out, feats[1:])
    pick = torch.randperm(n, generator=gen)[:ce_positions] if n > ce_positions else torch.arange(n)
    with torch.no_grad():
        p = F.softmax(F.linear(feats[1:][pick], target.lm_head), dim=-1)
    logp = F.log_softmax(F.linear(out[pick], target.lm_head), dim=-1)
    ce = -(p * logp).sum(-1).mean()
    return reg + 0.1 * ce


def train_head(
    target: Target,
    config: HeadConfig,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    *,
    epochs: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    ce_positions: int = 64,
    noise: float = 0.0,
    progress: bool = True,
) -> tuple[EagleHead, list[float]]:
    torch.manual_seed(seed)
    head = EagleHead(config).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * len(sequences)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / total)
    )
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    losses: list[float] = []
    bar = Progress(total, "eagle: training", "steps") if progress else None
    order = list(range(len(sequences)))
    for _ in range(epochs):
        rng.shuffle(order)
        acc = 0.0
        for i in order:
            ids = torch.tensor(sequences[i])
            loss = eagle_loss(head, target, ids, features[i], ce_positions, gen, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            acc += float(loss.detach())
            if bar is not None:
                bar.update(1, f"loss {float(loss.detach()):.3f}")
        losses.append(acc / max(len(order), 1))
    if bar is not None:
        bar.close()
    return head.eval(), losses


def train(
    stack: Any,
    out: str | Path,
    prompts: list[str],
    *,
    max_tokens: int = 128,
    epochs: int = 3,
    seed: int = 0,
    lr: float = 1e-3,
    noise: float = 0.1,
    data: str | Path | None = None,
    plugin_manager: Any = None,
    progress: bool = True,
) -> TrainResult:
    from lmstack.llm import LLM
    from lmstack.quantize import CalibrationModel

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    kw = {"plugin_manager": plugin_manager} if plugin_manager is not None else {}
    llm = LLM(stack, **kw)
    source = llm.engine.source
    cached = Path(data).expanduser() if data else None
    if cached is not None and cached.is_file():
        sequences = json.loads(cached.read_text())
    else:
        sequences = generate_answers(llm, prompts, max_tokens)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(sequences))
    llm.engine.shutdown()
    del llm
    seconds["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = Target(CalibrationModel.load(source))
    bar = Progress(len(sequences), "eagle: hidden states", "sequences") if progress else None
    features = []
    for ids in sequences:
        features.append(target.features(ids))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    seconds["features"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    config = HeadConfig.for_target(source.config)
    head, losses = train_head(
        target, config, sequences, features, epochs=epochs, lr=lr, seed=seed, noise=noise, progress=progress
    )
    seconds["train"] = time.perf_counter() - t0
    save_head(head, out, {"eagle_target": source.name, "eagle_train_prompts": len(prompts)})
    counts = Counter(t for ids in sequences for t in ids)
    save_draft_vocab(out, [t for t, _ in counts.most_common()])
    return TrainResult(head, losses, seconds)


# -- the command ----------------------------------------------------------------------------------


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eagle",
        help="EAGLE draft heads (the `eagle` speculator)",
        description="EAGLE draft heads for the `eagle` speculator.",
    )
    sub = p.add_subparsers(dest="eagle_command", required=True)
    t = sub.add_parser(
        "train",
        help="train an EAGLE-1 head for a stack's model by self-distillation",
        description="The target answers prompts greedily; a head (fc + one decoder layer) learns "
        "to predict its next hidden state; the folder (config.json + model.safetensors, "
        "EAGLE tensor names) is what `speculator: {name: eagle, head: DIR}` loads.",
    )
    t.add_argument("--stack", default=None, help="stack YAML file (default: SmolLM2-135M-Instruct on CPU)")
    t.add_argument("--out", required=True, help="folder to write the head to")
    t.add_argument("--prompts", default=None, help="prompt file, one per line (default: the bundled ones)")
    t.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    t.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt (default 128)")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--noise", type=float, default=0.1, help="uniform noise on the input features (EAGLE-1: 0.1)"
    )
    t.add_argument(
        "--data",
        default=None,
        help="a JSON file of the target's token sequences: read if it exists (no generation), "
        "else written after generating (retrain with other epochs without regenerating)",
    )
    t.set_defaults(handler=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    if args.prompts:
        path = Path(args.prompts).expanduser()
        if not path.is_file():
            raise ConfigError(f"prompt file {args.prompts!r} does not exist")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = bundled_prompts()
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if not prompts:
        raise ConfigError("no prompts to train on")
    stack: Any = args.stack if args.stack else dict(DEFAULT_STACK)
    started = time.perf_counter()
    result = train(
        stack,
        args.out,
        prompts,
        max_tokens=args.max_tokens,
        epochs=args.epochs,
        seed=args.seed,
        lr=args.lr,
        noise=args.noise,
        data=args.data,
    )
    per_epoch = ", ".join(f"{x:.3f}" for x in result.losses)
    parts = ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items())
    print(
        f"eagle head written to {args.out}: {len(prompts)} prompts, loss per epoch {per_epoch}; "
        f"{parts}; {(time.perf_counter() - started) / 60:.1f} min in all"
    )
    return 0
