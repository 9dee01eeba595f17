"""The extension seams: one abstract base per component kind.

Plugins subclass these (or satisfy them structurally) and register a `Component` whose
factory builds the instance. Everything a component may rely on is here or in
`lmstack.batch` / `lmstack.sequence`; nothing else in the core is API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lmstack.content_hash import CacheGeometry, request_key
from lmstack.engine.step_cost import StepCostModel
from lmstack.model.shard import Shard

if TYPE_CHECKING:
    from lmstack.batch import AttentionMetadata, ModelOutput, StepPlan
    from lmstack.model.config import ModelConfig
    from lmstack.quant.formats import WeightFormat
    from lmstack.sample.verification import Draft
    from lmstack.sequence import Request, Sequence


# ---------------------------------------------------------------------------------------------
# Build context: what a factory gets besides its own options.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLimits:
    """Limits resolved once from the stack and the model."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class BuildContext:
    """Passed to every component factory. Fields are filled in the role table's build order
    (`lmstack.roles.ROLES`): quantizer, attention, parallel, cache (`block_cache`), allocator
    (needs the KV geometry and the cache),
    scheduler (needs the allocator and the limits), speculator. `components` holds every
    instance built so far, by role."""

    model_config: ModelConfig | None
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    limits: EngineLimits | None = None
    allocator: KVAllocator | None = None
    # Bytes of one KV block as the executor will lay it out (set before the allocator is built).
    kv_bytes_per_block: int | None = None
    # The cache component the allocator reports full blocks to; None: no reuse (cache `none`).
    block_cache: BlockCache | None = None
    components: dict[str, Any] = field(default_factory=dict)
    # The executor, its weights loaded (set after the parallel layout; None under
    # `lmstack check --build`). A draft model that shares the target's embedding or LM head
    # reaches them here (`executor.runner.model` for the in-process executor).
    executor: Any = None
    # The engine's measured step cost (it records every step): a scheduler sizes prefill
    # chunks against it, the draft policy drafts against it.
    step_cost: StepCostModel = field(default_factory=StepCostModel)


# ---------------------------------------------------------------------------------------------
# KV allocator
# ---------------------------------------------------------------------------------------------


class BlockCache(ABC):
    """A cache component (kind ``cache``): where prefix reuse and lower KV tiers meet the
    allocator.

    The allocator addresses every full block by a stable content hash
    (`lmstack.content_hash.block_hash` over the parent's hash, the token ids, the geometry's
    fingerprint and `request_key`) and calls `lookup` / `register` / `evict` for blocks in
    device memory. A cache with lower tiers also answers `fetch` (a block it holds elsewhere is
    loaded into a free device block) and asks for block copies through `take_transfers`: the
    engine puts them into the step plan, the executor applies them on every worker (copies in
    before the forward, copies out after it) and hands what it copied out to `offloaded`.

    All methods run on the engine's thread; keep them cheap (file I/O belongs on a thread of the
    cache's own).
    """

    # False only for the built-in `none`: the allocator is then built without a cache.
    reuses_blocks: bool = True
    geometry: CacheGeometry | None = None

    def bind(self, geometry: CacheGeometry) -> None:
        """Called once before the allocator is built: the model and block layout the cache
        serves (a tier checks stored blocks against `geometry.fingerprint`)."""
        self.geometry = geometry

    def request_key(self, request: Request) -> bytes:
        """Extra keys of a request's blocks (`lmstack.content_hash.request_key`): its cache
        salt and tenant by default, so tenants never share a block."""
        return request_key(request.cache_salt, getattr(request, "tenant", None))

    @abstractmethod
    def lookup(self, block_hash: int) -> int | None:
        """A device block holding this content, or None (a miss). The allocator double-checks
        the answer against its own record of the block's content."""

    @abstractmethod
    def register(self, block_hash: int, block_id: int) -> None:
        """A device block holds (or this step computes) this content."""

    @abstractmethod
    def evict(self, block_hash: int, block_id: int) -> None:
        """The block's content leaves device memory (the block is reused or rolled back)."""

    def prefetch(self, block_hashes: list[int]) -> None:
        """The hashes of a new request's prompt blocks, in order, before the allocator looks
        them up one by one: a lower tier may start reading them now, in parallel."""

    def holds(self, block_hash: int) -> bool:
        """Whether a lower tier has this content (cheap: no read). The allocator asks before
        taking a free block for `fetch`, since taking one evicts the content it held."""
        return False

    def fetch(self, block_hash: int, block_id: int) -> bool:
        """Load this content from a lower tier into free device block `block_id` before the
        next step (queue it for `take_transfers`); False on a miss. A corrupt or foreign entry
        is a miss, never wrong data."""
        return False

    def take_transfers(self) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
        """(copies in, copies out) for this step: (block id, KV of shape
        `geometry.block_shape`) written before the forward, and block ids whose KV is read
        after it and handed to `offloaded`."""
        return [], []

    def offloaded(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """The KV of the blocks `take_transfers` asked to copy out, after the step (host
        tensors of shape `geometry.block_shape`)."""

    def close(self) -> None:
        """Finish pending writes and release resources (the engine is shutting down)."""


class KVAllocator(ABC):
    """Owns the KV-cache blocks. Blocks are reference-counted; block tables map a sequence's
    logical blocks to physical ones. Every method keys sequences by `seq.seq_id`."""

    block_size: int
    num_blocks: int

    @abstractmethod
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed now."""

    @abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens [seq.num_computed_tokens, + num_new_tokens). Shared blocks in
        that range are copied first (copy-on-write); returns the (src, dst) block copies the
        runner must apply before the step. Raises MemoryError if blocks run out."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (finish, abort, preemption). Idempotent."""

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of the parent's blocks (refcount + 1)."""

    @abstractmethod
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep slots for the first `num_tokens` tokens only; blocks past them go back."""

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids, in logical order."""

    @abstractmethod
    def num_free_blocks(self) -> int: ...

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks() / max(1, self.num_blocks)

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest known prefix (prefix reuse) and
        return the number of tokens they hold, which the scheduler then skips. Called before the
        sequence's first allocation; 0 without a cache component."""
        return 0

    def owners(self) -> dict[int, list[int]]:
        """block id -> seq ids referencing it (for leak / ownership checks in tests)."""
        return {}


# ---------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # query length this step: a prefill chunk, 1 for decode, 1 + drafts


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(ABC):
    """Decides, each step, which sequences run and how many tokens each computes.

    Contract (checked by `lmstack.testing`): `schedule()` allocates the KV slots of everything
    it schedules (through the allocator) and never exceeds the limits; after the step the
    engine advances `seq.num_computed_tokens` by the scheduled amount and appends sampled
    tokens; finished or aborted sequences are handed back through `finish()`, which must free
    their blocks. Sequences arrive through `add()`.
    """

    @abstractmethod
    def add(self, seq: Sequence) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""

    @abstractmethod
    def running_seqs(self) -> list[Sequence]:
        """Sequences holding KV blocks now (the speculator drafts for those in decode)."""

    @abstractmethod
    def num_waiting(self) -> int: ...

    @abstractmethod
    def num_running(self) -> int: ...

    def has_unfinished(self) -> bool:
        return self.num_waiting() + self.num_running() > 0

    @property
    def num_preemptions(self) -> int:
        return 0


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


class AttentionBackend(ABC):
    """Attention over the paged KV cache.

    Cache layout (agreed at resolution): per layer, `k_cache` and `v_cache` of shape
    [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at
    (s // block_size, s % block_size). New tokens' K/V are written with `write_kv` before
    `prefill` / `decode` run, so kernels may read the whole context from the cache.

    Scaled float8 caches (`lmstack.quant.kv`): a backend that declares `float8_e4m3fn` or `float8_e5m2` in
    its `kv_cache_dtypes` capability receives keyword arguments `k_scale` and `v_scale` (fp32 [num_kv_heads],
    this layer's, fixed for the engine's life) in `write_kv`, `prefill` and `decode`: the cache holds
    value / scale, so attention reads stored x scale. Backends that declare no float8 dtype never get them.

    Per layer (the model runner's, from `ModelConfig`): `scale` (Gemma: query_pre_attn_scalar ** -0.5) and
    `sliding_window` (local / global layers) differ between the layers of one step. Declaring `logit_softcap`
    adds a `logit_softcap` keyword (cap or None: scores become cap * tanh(score / cap)); else never passed.
    """

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """k, v: [T, Hkv, D]; slot_mapping: [T] int64."""
        if k_scale is not None:
            from lmstack.quant.kv import quantize_kv

            k, v = quantize_kv(k, k_scale, k_cache.dtype), quantize_kv(v, v_scale, v_cache.dtype)
            # index_copy_ has no float8 CPU kernel: copy the bytes.
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Varlen causal attention for sequences whose query length may exceed 1; each query
        also attends to the sequence's `context_lens` earlier tokens in the cache.
        q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's tokens, already in the cache).
        Returns [T, Hq, D]."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One query token per sequence attending to its `seq_lens` cached tokens.
        q: [B, Hq, D]. Returns [B, Hq, D]."""


# ---------------------------------------------------------------------------------------------
# Quantizer
# ---------------------------------------------------------------------------------------------

ParallelHint = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class LinearSpec:
    """What the model asks of one linear layer; the input of a `LinearFactory`.

    `output_sizes` lists the checkpoint tensors a fused projection stacks along its output
    dimension (Llama's qkv_proj: (q, k, v); gate_up_proj: (gate, up)); the weight loader's
    `shard_id` indexes it. `parallel` says how a tensor-parallel layout should split the layer:
    "column" (split outputs; each rank keeps whole shards of every part), "row" (split inputs; the
    outputs are summed across ranks) or "replicated". `params_dtype` is the serving dtype.

    `tp_rank` / `tp_size`: the tensor-parallel shard this process builds. `in_features`,
    `out_features` and `output_sizes` always describe the whole (unsplit) layer; the module a
    factory returns holds only the `local_*` sizes: a column-parallel layer keeps rows
    [r * part / tp, (r + 1) * part / tp) of every part (its local output is the parts' shards
    concatenated), a row-parallel layer keeps input columns [r * in / tp, (r + 1) * in / tp) and
    its output is a partial sum the model reduces over the tp group (its bias is loaded on tp rank
    0 only). Its weight loaders receive whole checkpoint tensors and keep their shard, which
    `shard` (`lmstack.model.shard.Shard`) spells out row by row.
    """

    in_features: int
    out_features: int
    bias: bool
    name: str  # e.g. "layers.3.qkv_proj"
    output_sizes: tuple[int, ...] = ()
    parallel: ParallelHint = "replicated"
    params_dtype: torch.dtype = torch.float32
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.output_sizes:
            object.__setattr__(self, "output_sizes", (self.out_features,))
        if sum(self.output_sizes) != self.out_features:
            raise ValueError(
                f"linear {self.name}: output_sizes {self.output_sizes} do not add up to {self.out_features}"
            )
        # Building it checks the tp rank and that the degree divides what it splits.
        object.__setattr__(self, "_shard", Shard.of(self))

    @property
    def shard(self) -> Shard:
        """This rank's rows and columns of the layer (`lmstack.model.shard`)."""
        return self._shard

    @property
    def local_output_sizes(self) -> tuple[int, ...]:
        """This rank's share of every output part."""
        return self.shard.local_output_sizes

    @property
    def local_out_features(self) -> int:
        return self.shard.local_out_features

    @property
    def local_in_features(self) -> int:
        return self.shard.local_in_features


LinearFactory = Callable[[LinearSpec], nn.Module]
"""LinearSpec -> a module mapping [..., in] -> [..., out], each call's output a new tensor the
caller owns (the model rotates, and adds residuals into, projections' outputs in place). Every
parameter it loads from the checkpoint carries a `weight_loader` (`lmstack.model.weight_loader`);
the module's parameter names are what the checkpoint's tensor suffixes map to
(`qkv_proj.weight`, `qkv_proj.bias`, or a quantizer's own, e.g. `qkv_proj.qweight`)."""


class Quantizer(ABC):
    """Chooses how linear layers are built and stored, and the KV-cache dtype.

    The model builds every linear through `linear_factory()`. Its parameters' weight loaders
    receive the checkpoint tensors as stored (`lmstack.model.checkpoint.CheckpointTensor`: a
    dense tensor in its stored dtype, or packed GGUF data), so a quantizer can keep a packed
    tensor packed; `BuildContext.model_config.quantization` describes what the checkpoint holds.
    After the weights load, `process_model` may still swap modules (as gpt-fast does)."""

    kv_cache_dtype: torch.dtype | None = None  # None: the model dtype

    def linear_factory(self) -> LinearFactory:
        from lmstack.model.linear import default_linear

        return default_linear

    def process_model(self, model: nn.Module) -> None:
        """Called once after the weights are loaded."""

    def shard_alignment(self, spec: LinearSpec) -> int:
        """The granularity at which this quantizer's tensors for `spec` split under tensor
        parallelism, along the dimension `spec.parallel` splits (output rows of every part for
        "column", input columns for "row"): each rank's share must be a multiple of it (e.g. a
        group size, or values per packed word). A parallel layout checks it at resolution and
        lists the degrees that work. 1: any even split (dense weights)."""
        return 1

    def weight_format(self) -> WeightFormat | None:
        """The checkpoint format `lmstack quantize --method <this quantizer>` writes
        (`lmstack.quant.formats.WeightFormat`); None: this quantizer only reads checkpoints."""
        return None


# ---------------------------------------------------------------------------------------------
# Speculator
# ---------------------------------------------------------------------------------------------


@dataclass
class DraftFeedback:
    """What became of one sequence's step, for `Speculator.observe`: the drafts verified (0
    for a plain decode or a prompt's last chunk) and how many were accepted, the tokens the
    step appended (`seq.token_ids` already ends with them), and the target's hidden states
    where the speculator asked for them (`hidden_state_layers`)."""

    seq: Sequence
    num_drafted: int
    num_accepted: int
    new_token_ids: list[int]  # empty for a prompt chunk that does not reach the prompt's end
    # layer -> [rows, hidden]: the target's states at consecutive positions from
    # `first_position` (layer num_layers: the final norm's output); empty unless asked for.
    # hidden_state_positions "sampled": the num_accepted + 1 positions whose logits produced
    # `new_token_ids` (the newest token before the step, then each accepted draft);
    # "all": also every prompt position the step computed.
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    first_position: int = 0


class Speculator(ABC):
    """Proposes draft tokens; the core verifies them (lossless).

    The core decides each step how many drafts each sequence may have
    (`lmstack.spec.draft_policy`: measured acceptance against the step's measured cost, so drafting
    stops when the batch is compute-bound and resumes when it is not); `propose` is asked only
    for sequences allowed at least one, each with `seq.draft_limit` set, and longer drafts are
    cut. `adaptive = False` keeps the limit at `num_draft_tokens`."""

    num_draft_tokens: int = 0  # the most drafts per sequence per step; 0: never asked
    adaptive: bool = True
    # Target layers whose outputs `observe` receives (num_layers: after the final norm).
    hidden_state_layers: tuple[int, ...] = ()
    # Where: "sampled", at the positions whose logits produced the step's new tokens; "all", at
    # every position the step computed and kept (a prompt chunk's every token too: a draft model
    # that keeps a KV cache of the target's states, as EAGLE's does, needs them all).
    hidden_state_positions: Literal["sampled", "all"] = "sampled"
    # (Plugin API 1.5.) Of the last `propose`, the seconds its sequences' first drafts took (a
    # draft head's pass over the tokens verified since it last drafted, which yields the first
    # draft); 0 if not told. The core then prices a sequence's first draft at its share and each
    # further draft at the rest's (`lmstack.spec.draft_policy`).
    first_draft_seconds: float = 0.0
    # (Plugin API 1.6.) True: the speculator ends each chain where its own estimate that the
    # chain so far is accepted (a draft head's probabilities multiplied along it) falls below
    # `seq.draft_min_gain`, the expected tokens a further draft must bring to pay for the query
    # token it adds to this step. The adaptive policy then picks which sequences draft and lets
    # their chains run up to `num_draft_tokens`: the length is the drafter's call, draft by
    # draft. False: the policy sets each chain's length from measured acceptance
    # (`seq.draft_limit`).
    stops_by_confidence: bool = False

    @abstractmethod
    def propose(self, seqs: list[Sequence]) -> dict[int, list[int] | Draft]:
        """seq_id -> draft tokens (may be empty; at most `seq.draft_limit`) for sequences in
        decode. A drafter that samples its tokens returns `lmstack.sample.verification.Draft(tokens,
        probs)` with the [k, vocab] distributions it drew them from, so verification can correct
        for them; plain token lists are verified as deterministic drafts."""

    def observe(self, feedback: list[DraftFeedback]) -> None:
        """After each step, for every sequence that sampled in it (drafted or not). A sequence
        absent from later steps finished, was aborted or was preempted (it comes back with
        its prompt and output recomputed)."""


# ---------------------------------------------------------------------------------------------
# Parallel layout / executor
# ---------------------------------------------------------------------------------------------


class Executor(ABC):
    """Drives the model. The built-in runs in-process; a parallel layout may start N worker
    processes over torch.distributed and broadcast each `StepPlan` to them: plain ints and
    lists, which every rank's model runner turns into tensors on its own device. Only rank 0's
    `ModelOutput` comes back."""

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    @abstractmethod
    def execute(self, plan: StepPlan) -> ModelOutput: ...

    def shutdown(self) -> None:
        """Stop workers; idempotent."""


class ParallelLayout(ABC):
    world_size: int = 1

    @abstractmethod
    def create_executor(self, spec: Any) -> Executor:
        """`spec` is an `lmstack.exec.executor.ExecutorSpec` (model source, dtype, device,
        quantizer, attention backends)."""
