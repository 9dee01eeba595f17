"""The head as the speculator runs it: `EagleHead`'s forward in fewer, fatter ops.

A draft token costs one head pass at one row, so at batch 1 a pass is a dozen small matmuls and
the glue between them, each op paying its dispatch whatever its size. Here q/k/v are one linear
and gate/up another (their weights concatenated once, at load), the new keys and values go
straight into the sequence's cache and attention reads the cache in place (the query heads
that share a KV head attend as one block of rows: grouped-query heads shared, not repeated),
and the RMSNorm, rotary embedding and SwiGLU product are the core's native layer ops
(`lmstack.model.layer_ops`, one call each on an fp32 CPU row). The arithmetic is
`EagleHead.forward`'s (tested to match it); drafts only propose, so what is emitted never
depends on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.model.layer_ops import rms_norm, rotate_, silu_mul
from lmstack_eagle.head import EagleHead


class DraftCache:
    """One sequence's head KV as [kv_heads, capacity, head_dim] tensors: the entries of positions
    [first, first + length) in order, so attention reads `k[:, :length]` without a copy. Then the
    rows the target computed that the head has not run over yet (`queue`): their features and
    next tokens, for positions [first + length, end). `first` is 0 unless the target never
    computed the sequence's first positions here (a prompt prefix served from a prefix cache):
    the head then attends over the positions it was shown, each at its true rotary position."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: Any) -> None:
        self.k = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.first = 0
        self.length = 0
        # The head's output at the newest committed entry: the predicted feature of the position
        # after it (None until the first entry).
        self.next_feature: torch.Tensor | None = None
        self.seq: Any = None
        self._feats: list[torch.Tensor] = []
        self._ids: list[int] = []

    @property
    def pending_rows(self) -> int:
        return len(self._ids)

    @property
    def end(self) -> int:
        """The positions entered or queued end here."""
        return self.first + self.length + len(self._ids)

    def queue(self, feats: torch.Tensor, next_ids: list[int]) -> None:
        """Rows at positions [end, end + T): features f_t [T, H] and token_{t+1} each."""
        self._feats.append(feats)
        self._ids.extend(next_ids)

    def _pending_feats(self) -> torch.Tensor:
        return self._feats[0] if len(self._feats) == 1 else torch.cat(self._feats)

    def take_pending(self) -> tuple[torch.Tensor, list[int]]:
        feats = self._pending_feats()
        ids, self._feats, self._ids = self._ids, [], []
        return feats, ids

    def keep_newest(self, rows: int) -> None:
        """Keep only the newest `rows` queued rows (and no entries): the cache restarts at the
        first of them."""
        feats, ids = self._pending_feats()[-rows:], self._ids[-rows:]
        self.restart(self.end - len(ids))
        self.queue(feats, ids)

    def restart(self, position: int) -> None:
        """Drop every entry and queued row; the next row queued is position `position`."""
        self.first, self.length = position, 0
        self._feats, self._ids = [], []
        self.next_feature = None

    def truncate(self, position: int) -> None:
        """Keep positions before `position`: entered rows past it (drafts) and queued ones go."""
        kept = position - self.first
        if kept <= 0:
            self.restart(position)
        elif kept <= self.length:
            self.length = kept
            self._feats, self._ids = [], []
            self.next_feature = None
        else:
            keep = kept - self.length
            self._feats, self._ids = [self._pending_feats()[:keep]], self._ids[:keep]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] as the next T positions."""
        need = self.length + k.shape[0]
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            grow = (self.k.shape[0], cap - self.k.shape[1], self.k.shape[2])
            self.k = torch.cat((self.k, self.k.new_empty(grow)), 1)
            self.v = torch.cat((self.v, self.v.new_empty(grow)), 1)
        self.k[:, self.length : need] = k.transpose(0, 1)
        self.v[:, self.length : need] = v.transpose(0, 1)
        self.length = need


class DraftPass(nn.Module):
    """`head` with fused projections; `linear(weight, bias)` makes each linear (an nn.Linear by
    default; the speculator passes lmstack-int8's for `head_weights: int8`)."""

    def __init__(self, head: EagleHead, linear: Any = None) -> None:
        super().__init__()
        c = self.cfg = head.cfg
        make = linear or dense_linear

        def w(module: nn.Linear) -> torch.Tensor:
            return module.weight.detach()

        # fc's bias is added in place apart from the linear: a linear with a bias leaves
        # lmstack-int8's one-call path (~6 us of a ~140 us one-row pass, measured).
        self.fc = make(w(head.fc), None)
        self.fc_bias = (
            None if head.fc.bias is None else nn.Parameter(head.fc.bias.detach().clone(), requires_grad=False)
        )
        self.qkv_proj = make(torch.cat((w(head.q_proj), w(head.k_proj), w(head.v_proj))), None)
        self.o_proj = make(w(head.o_proj), None)
        self.gate_up_proj = make(torch.cat((w(head.gate_proj), w(head.up_proj))), None)
        self.down_proj = make(w(head.down_proj), None)
        self.norm_weight = nn.Parameter(head.post_attention_layernorm.detach().clone(), requires_grad=False)
        self.rope = head.rope
        # `rotate_`'s tables for every position, made once (`RotaryEmbedding.tables_full`'s
        # values): a pass's positions are consecutive, so its tables are a slice, not ~10 us of
        # indexing and stacking per pass.
        dtype, device = head.post_attention_layernorm.dtype, head.rope.cos.device
        cos, sin = head.rope.tables_full(torch.arange(head.rope.cos.shape[0], device=device), dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.norm_weight.dtype

    def new_cache(self, capacity: int, device: Any) -> DraftCache:
        c = self.cfg
        return DraftCache(c.num_key_value_heads, c.head_dim, capacity, self.dtype, device)

    @torch.inference_mode()
    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, cache: DraftCache, last_only: bool = False
    ) -> torch.Tensor:
        """The T positions of one sequence right after the cache's entries (embeds of token t+1
        and features f_t, [T, H]): appends their keys and values to `cache` and returns the
        predicted next features [T, H], or with `last_only` the last position's alone [1, H]:
        the others' keys and values are all that drafting reads of them (entering the rows a
        verification accepted), so their attention and MLP are skipped."""
        c = self.cfg
        t = embeds.shape[0]
        start = cache.length  # rows in the cache before these (the causal mask's offset)
        p0 = cache.first + start
        x = self.fc(torch.cat((embeds, features), dim=-1))
        if self.fc_bias is not None:
            x.add_(self.fc_bias)
        qkv = self.qkv_proj(x)
        cos, sin = self.rope_cos[p0 : p0 + t], self.rope_sin[p0 : p0 + t]
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rotate_(qkv[:, : self.q_size + self.kv_size].view(t, -1, c.head_dim), cos, sin)
        q = qkv[:, : self.q_size].view(t, c.num_attention_heads, c.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, c.num_key_value_heads, c.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_key_value_heads, c.head_dim)
        cache.append(k, v)
        if last_only and t > 1:
            q, x, t = q[-1:], x[-1:], 1  # the newest position attends to every entry: no mask
        keys, values = cache.k[:, : cache.length], cache.v[:, : cache.length]
        # Grouped-query attention as plain attention per KV head: the query heads sharing a KV
        # head are rows of one query block [kv_heads, group * T, head_dim]. (SDPA's enable_gqa
        # takes its math path on the CPU, which repeats K/V per query head: 3-4x the time of a
        # one-row pass over a few hundred positions, measured.)
        group = c.num_attention_heads // c.num_key_value_heads
        qg = q.transpose(0, 1).reshape(c.num_key_value_heads, group * t, c.head_dim)
        mask = None
        if t > 1:
            mask = (
                torch.ones(t, start + t, dtype=torch.bool, device=x.device)
                .tril(diagonal=start)
                .repeat(group, 1)
            )
        o = F.scaled_dot_product_attention(
            qg.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=c.head_dim**-0.5
        )
        h_in = self.o_proj(o.view(c.num_attention_heads, t, c.head_dim).transpose(0, 1).reshape(t, -1))
        h = rms_norm(h_in, self.norm_weight, c.rms_norm_eps, residual=x)  # h_in += x: the residual
        return h_in.add_(self.down_proj(silu_mul(self.gate_up_proj(h))))


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin.requires_grad_(False)
