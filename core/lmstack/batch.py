"""The flattened batch the model runner executes, and the attention metadata kernels read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-sequence layout of a flattened varlen batch over the paged KV cache.

    Tokens of sequence i occupy [query_start_loc[i], query_start_loc[i+1]) of the batch;
    their positions are context_lens[i] .. seq_lens[i] - 1. Device tensors for kernels, host
    lists for loops that must not synchronise.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: cached tokens after this step (context + query)
    context_lens: torch.Tensor  # [B] int32: cached tokens before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int
    # Sequences [0, num_decode_seqs) have query length 1 and come first in the batch.
    num_decode_seqs: int = 0
    # Per-step memo: tensors a kernel derives from this metadata once and reuses in every layer.
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def select(self, start: int, end: int) -> AttentionMetadata:
        """Metadata for sequences [start, end), with token offsets rebased to 0."""
        qsl = self.query_start_loc[start : end + 1]
        t0 = sum(self.query_lens_cpu[:start])
        t1 = t0 + sum(self.query_lens_cpu[start:end])
        n_dec = max(0, min(end, self.num_decode_seqs) - start)
        return AttentionMetadata(
            query_start_loc=qsl - qsl[0],
            seq_lens=self.seq_lens[start:end],
            context_lens=self.context_lens[start:end],
            block_tables=self.block_tables[start:end],
            slot_mapping=self.slot_mapping[t0:t1],
            query_lens_cpu=self.query_lens_cpu[start:end],
            seq_lens_cpu=self.seq_lens_cpu[start:end],
            context_lens_cpu=self.context_lens_cpu[start:end],
            block_size=self.block_size,
            num_decode_seqs=n_dec,
        )

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From host lists: slot mapping and padded block tables are derived here."""
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        slots: list[int] = []
        for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
            for pos in range(c, c + q):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        num_decode = 0
        for q in query_lens:
            if q != 1:
                break
            num_decode += 1

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return AttentionMetadata(
            query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            context_lens=t(context_lens, torch.int32),
            block_tables=t(padded, torch.int32).reshape(len(block_tables), max_blocks),
            slot_mapping=t(slots, torch.int64),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
            block_size=block_size,
            num_decode_seqs=num_decode,
        )


@dataclass
class SeqPlan:
    """One sequence's share of a step, as plain values (cheap to pickle to worker processes)."""

    token_ids: list[int]  # this step's query: a prompt chunk, the newest token, or it + drafts
    context_len: int  # tokens already in the KV cache; the query's positions start here
    block_table: list[int]  # physical KV blocks, in logical order, covering context + query


@dataclass
class StepPlan:
    """What the engine hands the executor each step; the model runner turns it into tensors on
    its own device (`ModelRunner.prepare`).

    Sequences with a query of one token (decodes) come first, so kernels can split the batch.
    `logits_indices` are rows of the flattened batch (the concatenated queries) whose logits
    come back, in the order the engine reads them: each sampling sequence's last token, its
    draft positions, and prompt positions whose logprobs were asked for.
    """

    seqs: list[SeqPlan]
    logits_indices: list[int]
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the step
    # Return these layers' outputs at `logits_indices` too (layer i = decoder layer i's output,
    # num_layers = after the final norm): what a drafter conditioned on target states reads.
    hidden_state_layers: tuple[int, ...] = ()
    # Rows of the flattened batch where those layers' outputs come back instead of
    # `logits_indices` (a drafter that reads every computed position's state); None: at
    # `logits_indices`.
    hidden_state_rows: list[int] | None = None
    # A cache's lower tiers: (block id, KV of shape [layers, 2, block_size, heads, dim]) written
    # into device blocks before the step, and block ids whose KV is copied out after it (into
    # `ModelOutput.swapped_out`, same order). Every rank applies them to its own KV tensors.
    swap_in: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    swap_out: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class ModelInput:
    """A `StepPlan` as device tensors: every scheduled token of every sequence, flattened.

    Built by the model runner on its own device. `logits_indices` picks the batch rows whose
    logits come back.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [L] int64
    hidden_state_layers: tuple[int, ...] = ()  # return these layers' outputs at logits_indices
    hidden_state_rows: torch.Tensor | None = None  # ... or at these rows
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [L, vocab] fp32
    # layer index (num_layers = after the final norm) -> [L, hidden] (or [len(hidden_state_rows), hidden])
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # The KV of `StepPlan.swap_out`'s blocks after the step, on the host: [layers, 2, bs, H, D].
    swapped_out: list[torch.Tensor] = field(default_factory=list)
