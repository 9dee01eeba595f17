"""The `eagle` speculator: an EAGLE-1 draft head over the target's final hidden states.

The head runs as a `DraftPass` (fused projections, the native layer ops) over a KV cache per
sequence (`DraftCache`, [kv_heads, positions, head_dim], read in place by attention).
`observe` truncates it to the committed positions (speculative rows from the last `propose` are
dropped), then queues (f_t, token_{t+1}) for each position the target just computed. `propose`
first runs the head over the queued rows (one pass; the output of the newest entry predicts the
feature of the newest token's position), turns that into the first draft through the target's
LM head, then feeds (predicted feature, drafted token) back, greedily, up to `seq.draft_limit`
tokens.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import nn

from lmstack.errors import ConfigError
from lmstack.interfaces import DraftFeedback, Speculator
from lmstack.sequence import Sequence
from lmstack_eagle.draft_pass import DraftCache, DraftPass, dense_linear
from lmstack_eagle.head import bundled_heads, load_head, read_draft_vocab, read_head_config

PURGE_EVERY = 64  # steps between sweeps of finished sequences' caches
# A sequence not drafted for a while (a loaded server, where the draft policy finds drafting does
# not pay) keeps at most MAX_PENDING rows queued over several steps: past that it keeps the newest
# PENDING_WINDOW, and the head restarts there when the sequence is drafted again, rather than
# running over every row of text it may never draft from. (A prompt's chunk is queued whole: the
# head enters it at the sequence's first draft.) 32 rows: one pass through lmstack-int8's kernel
# with `head_weights: int8` (more rows dequantize the head's weights per linear, measured ~4x dearer
# a row).
MAX_PENDING = 32
PENDING_WINDOW = 16


class EagleOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The head: a bundled head's name (one per target, e.g. "smollm2-135m-instruct") or a folder
    # (config.json + model.safetensors, EAGLE-1 tensor names);
    # `lmstack eagle train --stack STACK --out DIR` builds one.
    head: Annotated[
        str,
        msgspec.Meta(description="a bundled head's name or a head folder (`lmstack eagle train` builds one)"),
    ] = ""
    # The most drafts per sequence per step.
    num_draft_tokens: Annotated[
        int, msgspec.Meta(description="the most draft tokens per sequence per step")
    ] = 4
    # Let the core size the draft per step (lmstack.spec.draft_policy); false: always num_draft_tokens.
    adaptive: Annotated[
        bool,
        msgspec.Meta(description="let the core size the draft per step (false: always num_draft_tokens)"),
    ] = True
    # Draft only among the head's N most frequent training tokens (the folder's
    # draft_vocab.json): the LM head then costs N / vocab of a full one per draft token; a token
    # outside is never drafted (verification stays exact). 0: the whole vocabulary.
    draft_vocab: Annotated[
        int, msgspec.Meta(description="draft only among the head's N most frequent tokens (0: all of them)")
    ] = 0
    # The head's linears (and a reduced draft vocabulary's rows): "fp32" (as trained, the
    # serving dtype), or "int8": int8 rows with one scale each, multiplied by lmstack-int8's CPU
    # kernel (fp32 activations; needs that distribution and its built kernel). A draft pass
    # reads its weights once per draft token: a quarter of the bytes makes drafting cheaper
    # (README); drafts may differ slightly, verification keeps the output exact.
    head_weights: Annotated[
        Literal["fp32", "int8"],
        msgspec.Meta(description="the head's linears as trained (fp32) or int8 rows (lmstack-int8 kernel)"),
    ] = "fp32"
    # A chain stops before a draft whose chain probability falls below this: the product of the
    # head's probabilities (softmax of its draft logits) of the drafts up to it, the head's own
    # estimate that verification accepts them all (a sequence whose first draft falls below it
    # is not drafted this step). The head's probability tracks acceptance closely (README), so
    # the drafts cut, each a verification row and a head pass, are mostly ones that would be
    # rejected or never reached. "auto" (with `adaptive`): the core's draft policy picks the
    # sequences that draft, grants them chains up to num_draft_tokens and sets the bar each step
    # at what one more query token costs it, in tokens at the step's rate
    # (`Sequence.draft_min_gain`); without `adaptive` there is no bar. A number: a fixed bar
    # under the policy's own chain lengths. 0: chains run to the length the policy allows.
    # Not the default: on a 2-core Zen 5 neither beat the policy's own lengths (README).
    min_chain_prob: Annotated[
        float | Literal["auto"],
        msgspec.Meta(description="stop a chain below this chain probability (0: none; auto: per step)"),
    ] = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= 16:
            raise ConfigError(f"must be in 1..16, got {self.num_draft_tokens}", "speculator.num_draft_tokens")
        if self.min_chain_prob != "auto" and not 0.0 <= self.min_chain_prob < 1.0:
            raise ConfigError(
                f"must be 'auto' or in [0, 1), got {self.min_chain_prob}", "speculator.min_chain_prob"
            )
        if self.draft_vocab < 0:
            raise ConfigError(f"must be >= 0, got {self.draft_vocab}", "speculator.draft_vocab")


class EagleSpeculator(Speculator):
    hidden_state_positions = "all"

    def __init__(
        self,
        head: DraftPass | None,
        embed: Any,
        lm_head: Any,
        num_layers: int,
        options: EagleOptions,
        device: torch.device | str = "cpu",
        vocab_ids: list[int] | None = None,
    ) -> None:
        self.options = options
        self.head = head
        self.embed, self.lm_head = embed, lm_head
        self.num_draft_tokens = options.num_draft_tokens if head is not None else 0
        self.adaptive = options.adaptive
        self.auto_stop = options.min_chain_prob == "auto"
        # The core's policy sets the bar per step (Sequence.draft_min_gain) and the length is ours.
        self.stops_by_confidence = self.auto_stop and options.adaptive
        self._probs = self.auto_stop or options.min_chain_prob > 0.0  # type: ignore[operator]
        self.hidden_state_layers = (num_layers,)
        self.layer = num_layers
        self.device = torch.device(device)
        self.caches: dict[int, DraftCache] = {}
        self._calls = 0
        # A reduced draft vocabulary: the LM head's rows for these ids (a copy, [N, H]).
        self.vocab_ids: torch.Tensor | None = None
        self.vocab_head: Any = None  # [N] logits of a feature: a Linear of those rows
        self.vocab_embeds: torch.Tensor | None = None  # [N, H]: their embeddings
        self._vocab_list: list[int] = list(vocab_ids or ())  # the ids, read per draft
        self._vocab_row: dict[int, int] = {}  # id -> its row in vocab_embeds
        if vocab_ids and lm_head is not None and head is not None:
            self.vocab_ids = torch.tensor(vocab_ids, device=self.device)
            rows = lm_head_rows(lm_head, self.vocab_ids, head.cfg.hidden_size, self.device)
            # With `head_weights: int8` the rows are int8 too: each draft token reads them once.
            make = int8_linear if options.head_weights == "int8" else dense_linear
            self.vocab_head = make(rows, None)
            # Their embeddings too, in the head's dtype: every drafted token is one of them, and a
            # row of this table is a plain index where the target's embedding (GGUF or int8
            # rows) decodes a row per call (~50 us a draft on a CPU).
            self.vocab_embeds = embed(self.vocab_ids).to(head.dtype).contiguous()
            self._vocab_row = {t: i for i, t in enumerate(self._vocab_list)}

    @property
    def dtype(self) -> torch.dtype:
        assert self.head is not None
        return self.head.dtype

    def _new_cache(self, seq: Sequence) -> DraftCache:
        cache = self.head.new_cache(max(64, seq.num_tokens * 2), self.device)  # type: ignore[union-attr]
        cache.seq = seq
        return cache

    def sweep(self) -> None:
        """Free the caches of finished sequences."""
        self.caches = {k: c for k, c in self.caches.items() if not c.seq.is_finished}

    # -- the seam -------------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, feedback: list[DraftFeedback]) -> None:
        """Queue each sequence's newly computed rows (`DraftCache.pending`); the head runs over
        them when the sequence is next drafted (`propose`), in one pass. A sequence the adaptive
        draft length keeps off (a loaded server) costs the head nothing per step: past
        MAX_PENDING queued rows only the newest PENDING_WINDOW are kept."""
        if self.head is None:
            return
        for fb in feedback:
            seq = fb.seq
            if seq.is_finished:
                self.caches.pop(seq.seq_id, None)
                continue
            states = fb.hidden_states.get(self.layer)
            if states is None or not states.shape[0]:
                continue
            cache = self.caches.get(seq.seq_id)
            if cache is None:
                cache = self.caches[seq.seq_id] = self._new_cache(seq)
            start = fb.first_position
            if start < cache.end or start == 0:
                # Rollback: the draft rows past the committed positions (or everything, for a
                # sequence preempted and recomputed from position 0).
                cache.truncate(start)
            if start > cache.end:
                # Positions the target never computed here (a prompt prefix served from a prefix
                # cache): the head starts at this one and attends over what it sees from now on.
                # Its drafts may be a little worse for the missing context; verification keeps
                # the output exact.
                cache.restart(start)
            # Entry t reads (f_t, token_{t+1}); every row here has its next token.
            rows = min(states.shape[0], seq.num_tokens - 1 - start)
            if rows <= 0:
                continue
            cache.queue(states[:rows], seq.token_ids[start + 1 : start + 1 + rows])
            if cache.pending_rows > max(MAX_PENDING, rows):
                cache.keep_newest(PENDING_WINDOW)

    def _enter(self, cache: DraftCache) -> None:
        """Run the head over the cache's queued rows (one pass), entering them."""
        feats, ids = cache.take_pending()
        assert self.head is not None
        rows = [self._vocab_row.get(t, -1) for t in ids] if self._vocab_row else [-1]
        if min(rows) >= 0:  # all in the draft vocabulary (mostly drafts just accepted): its table
            embeds = self.vocab_embeds[torch.tensor(rows, device=self.device)]  # type: ignore[index]
        else:
            embeds = self.embed(torch.tensor(ids, device=self.device)).to(self.dtype)
        cache.next_feature = self.head(embeds, feats.to(self.device, self.dtype), cache, last_only=True)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        self._calls += 1
        if self._calls % PURGE_EVERY == 0:
            self.sweep()
        out: dict[int, list[int]] = {}
        self.first_draft_seconds = 0.0
        if self.head is None:
            return out
        for seq in seqs:
            cache = self.caches.get(seq.seq_id)
            if cache is None:
                continue
            if cache.end != seq.num_tokens - 1:
                continue  # the cache does not end right before the newest token
            # The first draft comes out of the pass over the rows verified since the last one;
            # each further draft costs a one-row pass (the draft policy prices them apart).
            started = time.perf_counter()
            if cache.pending_rows:
                self._enter(cache)
            if cache.next_feature is None:
                continue
            limit = min(seq.draft_limit or self.num_draft_tokens, self.num_draft_tokens)
            bar = seq.draft_min_gain if self.auto_stop else self.options.min_chain_prob
            feature = cache.next_feature
            drafts: list[int] = []
            chain_prob = 1.0
            while True:
                token, embedding, prob = self._argmax(feature)
                if not drafts:
                    self.first_draft_seconds += time.perf_counter() - started
                chain_prob *= prob
                if chain_prob < bar:
                    break
                drafts.append(token)
                if len(drafts) >= limit:
                    break
                if embedding is None:
                    embedding = self.embed(torch.tensor([token], device=self.device)).to(self.dtype)
                # The draft's K/V enter the cache speculatively: the next observe truncates them.
                feature = self.head(embedding, feature, cache)
            if drafts:
                out[seq.seq_id] = drafts
        return out

    def _argmax(self, feature: torch.Tensor) -> tuple[int, torch.Tensor | None, float]:
        """The draft token the feature predicts, its embedding [1, H] where it is at hand (a
        reduced draft vocabulary's table, else None), and the head's probability for it (the
        softmax over the draft vocabulary; 1.0 unless `min_chain_prob` asks for it)."""
        if self.vocab_head is not None:
            logits = self.vocab_head(feature.float())[-1]
            i = int(logits.argmax())
            token, embedding = self._vocab_list[i], self.vocab_embeds[i : i + 1]  # type: ignore[index]
        else:
            logits = self.lm_head(feature.to(self.lm_dtype))[-1]
            i = int(logits.argmax())
            token, embedding = i, None
        prob = 1.0
        if self._probs:
            # p(argmax) = 1 / sum(exp(logits - max)): no full softmax tensor needed.
            prob = float(1.0 / torch.exp(logits.float() - logits[i].float()).sum())
        return token, embedding, prob

    @property
    def lm_dtype(self) -> torch.dtype:
        w = getattr(self.lm_head, "weight", None)
        return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else self.dtype

    def committed_length(self, seq_id: int) -> int:
        """The draft cache's length (for tests: the committed positions after an observe)."""
        cache = self.caches.get(seq_id)
        return cache.end if cache is not None else 0


@torch.inference_mode()
def lm_head_rows(lm_head: Any, ids: torch.Tensor, hidden: int, device: torch.device) -> torch.Tensor:
    """Rows `ids` of the LM head's weight in fp32, [N, hidden]: copied from a plain weight, else
    read off the module's output for the identity (a quantized head, e.g. GGUF blocks, minus any
    bias), so that a reduced draft vocabulary works whatever the target's quantization."""
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
        if tuple(weight.shape[1:]) == (hidden,):
            return weight.detach()[ids].float().contiguous()
    eye = torch.eye(hidden, device=device)
    columns = lm_head(eye).float() - lm_head(torch.zeros(1, hidden, device=device)).float()
    return columns[:, ids].t().contiguous()


def check_head(options: EagleOptions, mc: Any) -> None:
    """One-line ConfigErrors for a missing head or one that does not fit the target."""
    if not options.head:
        raise ConfigError(
            "the eagle speculator needs `head: NAME|PATH`: a bundled head "
            f"({', '.join(bundled_heads()) or 'none installed'}) or a trained EAGLE head folder; "
            "build one with `lmstack eagle train --stack STACK --out DIR`",
            "speculator.head",
        )
    cfg = read_head_config(options.head)
    if mc is None:
        return
    if cfg.hidden_size != mc.hidden_size or cfg.vocab_size != mc.vocab_size:
        raise ConfigError(
            f"EAGLE head {options.head!r} has hidden size {cfg.hidden_size} and vocab {cfg.vocab_size}, "
            f"but the target model has hidden size {mc.hidden_size} and vocab {mc.vocab_size}",
            "speculator.head",
        )


def int8_kernel_problem() -> str | None:
    """Why `head_weights: int8` cannot run here, or None (the resolver's check)."""
    try:
        from lmstack_int8.api import EXTENSION
    except ImportError:
        return "head_weights: int8 needs lmstack-int8 installed (its CPU kernel multiplies the head)"
    problem = EXTENSION.load_error()
    return (
        None
        if problem is None
        else f"head_weights: int8 needs lmstack-int8's kernel, which did not build: {problem}"
    )


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """lmstack-int8's `Int8Linear` of an fp32 CPU weight (int8 rows, one scale each; its C++
    kernel for decode-sized batches, an exact fp32 path above), with the bias kept in fp32. The
    resolver has checked the device and the kernel."""
    from lmstack_int8.api import int8_table

    table = int8_table(weight.float(), exact_fp32=True)
    if bias is not None:
        table.bias = nn.Parameter(bias.float(), requires_grad=False)
    return table


def build(options: EagleOptions, ctx: Any) -> EagleSpeculator:
    mc = ctx.model_config
    check_head(options, mc)
    num_layers = mc.num_layers if mc is not None else 0
    executor = getattr(ctx, "executor", None)
    if executor is None:  # lmstack check --build: no weights
        return EagleSpeculator(None, None, None, num_layers, options, ctx.device)
    model = getattr(getattr(executor, "runner", None), "model", None)
    embed, lm_head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is None or lm_head is None:
        raise ConfigError(
            "the eagle speculator needs the target model in this process (parallel: single): "
            "it reuses the target's embedding and LM head",
            "speculator.name",
        )
    vocab = read_draft_vocab(options.head, options.draft_vocab) if options.draft_vocab else None
    if options.head_weights == "int8":  # quantized from fp32; the head then runs in fp32
        head = DraftPass(load_head(options.head, torch.float32), int8_linear)
    else:
        head = DraftPass(load_head(options.head, ctx.dtype).to(ctx.device))
    return EagleSpeculator(head, embed, lm_head, num_layers, options, ctx.device, vocab)
