"""`lmstack eagle train`: an EAGLE-1 head for a stack's model, by self-distillation.

(a) The target answers the training prompts (and the held-out ones) greedily through
`lmstack.LLM(stack)` (all at once, batched by the engine); (b) `lmstack_calibrate.model.DenseModel` (the
core's model in fp32) recomputes the final-norm hidden state at every position of prompt + answer in fp32; (c) the
head (fc + one decoder layer; the target's embedding and LM head frozen) learns EAGLE-1's loss
SmoothL1(f'_{t+1}, f_{t+1}) + 0.1 * CE(lm_head(f'_{t+1}), target's distribution) with AdamW,
on batches of packed sequences, over an unrolled drafting chain: step j > 1 reads the head's own
step j-1 prediction exactly as the speculator will (`chain_outputs`; EAGLE-3's "training-time
test"), so the second and later drafts are trained on what inference feeds them; (d) the head is
written in the EAGLE folder format (`lmstack_eagle.head`), with its offline acceptance on the
held-out prompts (`chain_acceptance`) in config.json.
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

from lmstack.commands.progress import Progress
from lmstack.errors import ConfigError
from lmstack_eagle.head import EagleHead, HeadConfig, head_path, load_head, save_draft_vocab, save_head

DEFAULT_STACK = {
    "model": "smollm2-135m-instruct",
    "dtype": "auto",
    "device": "cpu",
    "scheduler": {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "1GiB"},
}


EVAL_PROMPTS = "prompts_eval.txt"


def bundled_prompts(name: str = "prompts_train.txt") -> list[str]:
    text = resources.files("lmstack_eagle").joinpath(name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@dataclass
class TrainResult:
    head: EagleHead
    losses: list[float] = field(default_factory=list)  # mean loss per epoch
    seconds: dict[str, float] = field(default_factory=dict)
    # chain_acceptance on the held-out prompts' answers (empty without held-out prompts).
    heldout: dict[str, Any] = field(default_factory=dict)


class Target:
    """The target's frozen pieces in fp32: embedding, LM head and the hidden-state forward
    (`model`: a `lmstack_calibrate.model.DenseModel`, the core's model on dense weights)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        w = model.weights
        self.embedding = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embedding)

    def features(self, ids: list[int]) -> torch.Tensor:
        """The final norm's output at every position of `ids`: [L, H] fp32."""
        return self.model.hidden(torch.tensor([ids]))[0]


def generate_answers(
    llm: Any, prompts: list[str], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """prompt + answer token ids per prompt (greedy, or sampled at `temperature`, seeded per
    prompt), all enqueued at once, with a progress bar."""
    from lmstack.sampling_params import SamplingParams

    engine = llm.engine
    reqs = []
    for i, p in enumerate(prompts):
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed + i if temperature > 0 else None
        )
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


def chain_outputs(
    head: EagleHead,
    embedding: torch.Tensor,
    seqs: list[torch.Tensor],
    feats: list[torch.Tensor],
    steps: int,
    noise: float = 0.0,
    gen: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The head's drafting chain unrolled over a batch, as inference runs it ("training-time
    test", as EAGLE-3 trains): step 1 reads (f_t, token_{t+1}) for every position t of every
    sequence; step j > 1 reads the head's own step j-1 output with the true token_{t+j} and
    attends, as the speculator's draft cache does, to the committed entries 0..t of its sequence
    and its own earlier draft entries. Sequences are laid flat (entry e = token e, seqs [L_s],
    feats [L_s, H]). Per step j: (predicted f_{t+j} [N, H], true f_{t+j} [N, H], valid [N]),
    valid where t + j is still inside t's sequence."""
    c = head.cfg
    ids, f = torch.cat(seqs), torch.cat(feats)
    n = ids.shape[0]
    seg = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    rep = c.num_attention_heads // c.num_key_value_heads
    scale = c.head_dim**-0.5

    def shifted(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(n) + j
        inside = idx < n
        idx = idx.clamp(max=n - 1)
        return idx, inside & (seg[idx] == seg)

    inp = f
    if noise:  # EAGLE-1's data noise: uniform, on the input features
        inp = inp + (torch.rand(inp.shape, generator=gen) - 0.5) * (2 * noise)
    idx, valid = shifted(1)
    x = head.fuse(F.embedding(ids[idx], embedding), inp)
    q, k, v = head.qkv(x, pos)
    committed = (seg[None, :] == seg[:, None]) & torch.ones(n, n, dtype=torch.bool).tril()
    keys = k.transpose(0, 1).repeat_interleave(rep, 0)  # [heads, N, D]
    values = v.transpose(0, 1).repeat_interleave(rep, 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=committed, scale=scale)
    out = head.finish(x, o.transpose(0, 1))
    result = [(out, f[idx], valid)]
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    for j in range(2, steps + 1):
        idx, valid = shifted(j)
        x = head.fuse(F.embedding(ids[idx], embedding), out)
        q, k, v = head.qkv(x, pos + j - 1)
        own_k.append(k)
        own_v.append(v)
        qh = q.transpose(0, 1)  # [heads, N, D]
        s_committed = (torch.einsum("hmd,hnd->hmn", qh, keys) * scale).masked_fill(~committed, float("-inf"))
        ok = torch.stack(own_k, 1).repeat_interleave(rep, 2)  # [N, j-1, heads, D]
        ov = torch.stack(own_v, 1).repeat_interleave(rep, 2)
        s_own = torch.einsum("hmd,mjhd->hmj", qh, ok) * scale
        p = torch.softmax(torch.cat((s_committed, s_own), -1), -1)
        o = torch.einsum("hmn,hnd->hmd", p[..., :n], values) + torch.einsum("hmj,mjhd->hmd", p[..., n:], ov)
        out = head.finish(x, o.transpose(0, 1))
        result.append((out, f[idx], valid))
    return result


def eagle_loss(
    head: EagleHead,
    target: Target,
    seqs: list[torch.Tensor],
    feats: list[torch.Tensor],
    *,
    steps: int,
    ce_positions: int,
    gen: torch.Generator,
    noise: float = 0.0,
    lm_rows: torch.Tensor | None = None,
    decay: float = 0.8,
) -> torch.Tensor:
    """EAGLE-1's loss, summed over the unrolled draft steps (step j weighted decay^(j-1)):
    SmoothL1 between predicted and true features, plus 0.1 x the cross-entropy of the predicted
    feature's distribution (through the LM head) against the target's own distribution there
    (soft labels, as EAGLE-1 trains), on up to `ce_positions` random positions per sequence.
    `lm_rows` (the LM head's rows for some tokens) limits the cross-entropy to those tokens: the
    LM head is most of the cost, and tokens the target never produced carry next to no
    probability."""
    lm_head = target.lm_head if lm_rows is None else lm_rows
    total = torch.zeros(())
    for j, (out, true, valid) in enumerate(
        chain_outputs(head, target.embedding, seqs, feats, steps, noise, gen)
    ):
        rows = valid.nonzero().squeeze(1)
        if not rows.numel():
            continue
        out, true = out[rows], true[rows]
        reg = F.smooth_l1_loss(out, true)
        limit = ce_positions * len(seqs)
        pick = torch.randperm(rows.numel(), generator=gen)[:limit]
        with torch.no_grad():
            p = F.softmax(F.linear(true[pick], lm_head), dim=-1)
        logp = F.log_softmax(F.linear(out[pick], lm_head), dim=-1)
        ce = -(p * logp).sum(-1).mean()
        total = total + decay**j * (reg + 0.1 * ce)
    return total


def check_same_shape(have: HeadConfig, want: HeadConfig) -> None:
    """A head to continue training must be shaped like the one this target gets."""
    shape = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    shape += ("head_dim", "vocab_size")
    got, needed = ({k: getattr(c, k) for k in shape} for c in (have, want))
    if got != needed:
        raise ConfigError(f"the head to continue is shaped {got}, this target's head {needed}")


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
    batch_size: int = 8,
    unroll: int = 3,
    progress: bool = True,
    init: EagleHead | None = None,
) -> tuple[EagleHead, list[float]]:
    """`init`: a head to continue training (same shape as `config`), else a fresh one."""
    torch.manual_seed(seed)
    if init is not None:
        check_same_shape(init.cfg, config)
    head = (init if init is not None else EagleHead(config)).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    batches = -(-len(sequences) // batch_size)
    total = epochs * batches
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / total)
    )
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    # The cross-entropy's vocabulary: the tokens the training text contains (rows copied once).
    lm_rows = target.lm_head[torch.tensor(sorted({t for ids in sequences for t in ids}))]
    losses: list[float] = []
    bar = Progress(total, "eagle: training", "steps") if progress else None
    order = list(range(len(sequences)))
    for _ in range(epochs):
        rng.shuffle(order)
        acc = 0.0
        for b in range(batches):
            pick = order[b * batch_size : (b + 1) * batch_size]
            loss = eagle_loss(
                head,
                target,
                [torch.tensor(sequences[i]) for i in pick],
                [features[i] for i in pick],
                steps=unroll,
                ce_positions=ce_positions,
                gen=gen,
                noise=noise,
                lm_rows=lm_rows,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            acc += float(loss.detach())
            if bar is not None:
                bar.update(1, f"loss {float(loss.detach()):.3f}")
        losses.append(acc / batches)
    if bar is not None:
        bar.close()
    return head.eval(), losses


@torch.no_grad()
def chain_acceptance(
    head: EagleHead, target: Target, sequences: list[list[int]], starts: list[int], k: int = 4
) -> list[int]:
    """Offline, what the speculator would get with greedy chains of k drafts: for every answer
    position (from `starts[i]`, the prompt length) the drafts accepted against the sequence's
    own next tokens (the target's greedy answer)."""
    accepted = []
    for ids, start in zip(sequences, starts):
        feats = target.features(ids)
        n = len(ids) - 1
        tokens = torch.tensor(ids)
        out, keys, values = head(F.embedding(tokens[1:], target.embedding), feats[:n], torch.arange(n))
        for t in range(start - 1, n - 1):  # entries 0..t committed, token t+1 the newest
            past_k, past_v, feature, hits = keys[: t + 1], values[: t + 1], out[t : t + 1], 0
            for j in range(k):
                token = int(F.linear(feature, target.lm_head)[-1].argmax())
                if t + 2 + j >= len(ids) or token != ids[t + 2 + j]:
                    break
                hits += 1
                if j + 1 < k:
                    feature, k1, v1 = head(
                        F.embedding(torch.tensor([token]), target.embedding),
                        feature,
                        torch.tensor([t + 1 + j]),
                        past_k,
                        past_v,
                    )
                    past_k, past_v = torch.cat((past_k, k1)), torch.cat((past_v, v1))
            accepted.append(hits)
    return accepted


def train(
    stack: Any,
    out: str | Path,
    prompts: list[str],
    *,
    heldout: list[str] | None = None,
    max_tokens: int = 128,
    epochs: int = 3,
    seed: int = 0,
    lr: float = 1e-3,
    noise: float = 0.1,
    batch_size: int = 8,
    unroll: int = 3,
    samples: int = 0,
    temperature: float = 0.8,
    data: str | Path | None = None,
    init: str | Path | None = None,
    plugin_manager: Any = None,
    progress: bool = True,
) -> TrainResult:
    """Train a head on the target's answers to `prompts` (greedy, plus `samples` sampled ones
    per prompt at `temperature`: more, and more varied, text); with `heldout` prompts, also
    measure the head offline on the target's greedy answers to those (`chain_acceptance`, 4
    drafts). `init`: a head folder to continue training from (its weights are the start)."""
    from lmstack.engine.llm import LLM
    from lmstack_calibrate.model import DenseModel

    heldout = heldout or []
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    kw = {"plugin_manager": plugin_manager} if plugin_manager is not None else {}
    llm = LLM(stack, **kw)
    source = llm.engine.source
    config = HeadConfig.for_target(source.config)
    # A head to continue is read and checked first, not after the answers and hidden states.
    start = load_head(init) if init is not None else None
    if start is not None:
        check_same_shape(start.cfg, config)
    starts = [len(llm.tokenizer.encode_chat([{"role": "user", "content": p}])) for p in heldout]
    cached = Path(data).expanduser() if data else None
    saved: dict[str, Any] = {}
    if cached is not None and cached.is_file():
        saved = json.loads(cached.read_text())
        if isinstance(saved, list):  # a file of training sequences only
            saved = {"train": saved}
        sequences, held = saved["train"], saved.get("heldout", [])
        if len(held) != len(heldout):
            held = generate_answers(llm, heldout, max_tokens) if heldout else []
        sampled = saved.get("sampled", [])
    else:
        both = generate_answers(llm, prompts + heldout, max_tokens)
        sequences, held, sampled = both[: len(prompts)], both[len(prompts) :], []
    have = len(sampled) // len(prompts) if prompts and len(sampled) % len(prompts) == 0 else 0
    if have > samples:
        sampled, have = sampled[: samples * len(prompts)], samples
    if have < samples:
        # Sample set j is seeded by --seed and j: sets already in the data file are kept, the rest made.
        sampled = sampled[: have * len(prompts)] + [
            seq
            for j in range(have, samples)
            for seq in generate_answers(llm, prompts, max_tokens, temperature, seed + 1_000_003 * (j + 1))
        ]
    answers = {"train": sequences, "heldout": held, "sampled": sampled}
    if cached is not None and answers != {"heldout": [], "sampled": [], **saved}:  # something new
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(answers))
    sequences = sequences + sampled
    llm.engine.shutdown()
    del llm
    seconds["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = Target(DenseModel.load(source))
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
    head, losses = train_head(
        target,
        config,
        sequences,
        features,
        epochs=epochs,
        lr=lr,
        seed=seed,
        noise=noise,
        batch_size=batch_size,
        unroll=unroll,
        progress=progress,
        init=start,
    )
    seconds["train"] = time.perf_counter() - t0
    extra: dict[str, Any] = {
        "eagle_target": source.name,
        "eagle_train_prompts": len(prompts),
        "eagle_train_sequences": len(sequences),
        "eagle_train_tokens": sum(len(ids) for ids in sequences),
        "eagle_train_epochs": epochs,
        "eagle_train_lr": lr,
    }
    if start is not None:
        # What it continued from, and that folder's own history (epochs add up over a chain).
        before = json.loads((head_path(init) / "config.json").read_text())  # type: ignore[arg-type]
        extra["eagle_continued_from"] = {
            k: v for k, v in before.items() if k.startswith("eagle_") and k != "eagle_heldout"
        } | {"folder": str(init), "heldout": before.get("eagle_heldout")}
    measured: dict[str, Any] = {}
    if held:
        t0 = time.perf_counter()
        accepted = chain_acceptance(head, target, held, starts)
        seconds["heldout"] = time.perf_counter() - t0
        measured = {
            "prompts": len(held),
            "positions": len(accepted),
            "mean_accepted_drafts": sum(accepted) / max(len(accepted), 1),
            "histogram": dict(sorted(Counter(accepted).items())),
        }
        extra["eagle_heldout"] = measured
    save_head(head, out, extra)
    counts = Counter(t for ids in sequences for t in ids)
    save_draft_vocab(out, [t for t, _ in counts.most_common()])
    return TrainResult(head, losses, seconds, measured)


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
    t.add_argument(
        "--heldout-prompts",
        default=None,
        help="prompts to measure the head on, not trained on (default: the bundled held-out ones; "
        "'none' to skip)",
    )
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per optimizer step, packed into one attention (memory grows with the square "
        "of their total length; default 8)",
    )
    t.add_argument(
        "--unroll",
        type=int,
        default=3,
        help="draft steps trained per position, each on the head's own previous output (default 3)",
    )
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--noise", type=float, default=0.1, help="uniform noise on the input features (EAGLE-1: 0.1)"
    )
    t.add_argument(
        "--samples",
        type=int,
        default=0,
        help="also answer each training prompt N times by sampling (more, and more varied, text)",
    )
    t.add_argument(
        "--temperature", type=float, default=0.8, help="the sampled answers' temperature (default 0.8)"
    )
    t.add_argument(
        "--data",
        default=None,
        help="a JSON file of the target's token sequences: read if it exists (no generation), "
        "else written after generating (retrain with other epochs without regenerating)",
    )
    t.add_argument(
        "--init",
        default=None,
        help="a head folder or bundled head's name to continue training from (e.g. more epochs "
        "or more data on a head already trained; --lr then sets the new run's peak rate)",
    )
    t.set_defaults(handler=_cmd_train)


def _read_prompts(path: str) -> list[str]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"prompt file {path!r} does not exist")
    return [line.strip() for line in file.read_text().splitlines() if line.strip()]


def _cmd_train(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args.prompts) if args.prompts else bundled_prompts()
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if not prompts:
        raise ConfigError("no prompts to train on")
    if args.heldout_prompts == "none":
        heldout: list[str] = []
    else:
        heldout = (
            _read_prompts(args.heldout_prompts) if args.heldout_prompts else bundled_prompts(EVAL_PROMPTS)
        )
    trained = set(prompts)
    heldout = [p for p in heldout if p not in trained]
    for name in ("epochs", "batch_size", "unroll"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.samples < 0 or (args.samples and args.temperature <= 0):
        raise ConfigError("--samples must be >= 0, and sampled answers need --temperature > 0")
    stack: Any = args.stack if args.stack else dict(DEFAULT_STACK)
    started = time.perf_counter()
    result = train(
        stack,
        args.out,
        prompts,
        heldout=heldout,
        max_tokens=args.max_tokens,
        epochs=args.epochs,
        seed=args.seed,
        lr=args.lr,
        noise=args.noise,
        batch_size=args.batch_size,
        unroll=args.unroll,
        samples=args.samples,
        temperature=args.temperature,
        data=args.data,
        init=args.init,
    )
    per_epoch = ", ".join(f"{x:.3f}" for x in result.losses)
    parts = ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items())
    measured = ""
    if result.heldout:
        h = result.heldout
        measured = (
            f"; on {h['prompts']} held-out prompts (offline, 4-token chains) "
            f"{h['mean_accepted_drafts']:.2f} drafts accepted per step"
        )
    print(
        f"eagle head written to {args.out}: {len(prompts)} prompts, loss per epoch {per_epoch}{measured}; "
        f"{parts}; {(time.perf_counter() - started) / 60:.1f} min in all"
    )
    return 0
