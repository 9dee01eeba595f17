"""The built-in components pass the same conformance kits third-party plugins must pass, named
the way a plugin's tests name theirs: by registered name. Two in-test components show the
kits doing real work where the built-in is trivial: a prompt-lookup (n-gram) speculator, whose
drafts are verified, and the two-process replica layout of test_seams."""

from __future__ import annotations

import msgspec
import pytest

from lmstack.interfaces import Speculator
from lmstack.registry import Component
from lmstack.sequence import Sequence
from lmstack.testing import (
    AllocatorConformance,
    AttentionConformance,
    ParallelConformance,
    QuantizerConformance,
    SchedulerConformance,
    SpeculatorConformance,
)


class TestPagedAllocator(AllocatorConformance):
    component = "paged"


class TestContinuousScheduler(SchedulerConformance):
    component = "continuous"


class TestTorchAttention(AttentionConformance):
    component = "torch"
    max_len = 600  # longer than the prefill kernel's query tile (256)


class TestNoneQuantizer(QuantizerConformance):
    component = "none"


class TestNoneSpeculator(SpeculatorConformance):
    component = "none"


class TestSingleLayout(ParallelConformance):
    component = "single"


# --- a prompt-lookup speculator: drafts that verification actually checks ----------------------


class NgramOptions(msgspec.Struct, forbid_unknown_fields=True):
    num_draft_tokens: int = 4
    max_ngram: int = 3


class NgramSpeculator(Speculator):
    """Finds the latest earlier occurrence of the sequence's last n tokens (n = max_ngram..1)
    and proposes the tokens that followed it (prompt lookup decoding)."""

    def __init__(self, options: NgramOptions) -> None:
        self.num_draft_tokens = options.num_draft_tokens
        self.max_ngram = options.max_ngram

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        out = {}
        for seq in seqs:
            ids = seq.token_ids
            for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
                tail = ids[-n:]
                for start in range(len(ids) - n - 1, -1, -1):
                    if ids[start : start + n] == tail:
                        out[seq.seq_id] = ids[start + n : start + n + self.num_draft_tokens]
                        break
                if seq.seq_id in out:
                    break
        return out


NGRAM = Component(
    name="kit-ngram",
    kind="speculator",
    factory=lambda options, ctx: NgramSpeculator(options),
    options_type=NgramOptions,
    capabilities={"devices": ("cpu",)},
)


class TestNgramSpeculator(SpeculatorConformance):
    component = NGRAM
    options = {"num_draft_tokens": 3}

    def test_greedy_tokens_identical_to_plain_decoding(self, tiny_model_path) -> None:
        super().test_greedy_tokens_identical_to_plain_decoding(tiny_model_path)
        # The identity above means something only if drafts were proposed, and some rejected.
        assert self.stats.num_draft_tokens > 0
        assert 0 < self.stats.num_accepted_tokens < self.stats.num_draft_tokens
        assert max(len(d) for p in self.proposals for d in p.values()) == 3


# --- the replica layout: two worker processes over torch.distributed ---------------------------


class ReplicaLayoutOptions(msgspec.Struct, forbid_unknown_fields=True):
    world_size: int = 2


class ReplicaLayout:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def create_executor(self, spec):
        from lmstack.exec.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, world_size=self.world_size)


def _replica_layout(options, ctx):
    from lmstack.interfaces import ParallelLayout

    # Registered as a ParallelLayout subclass so the kit's interface check holds.
    class Replicas(ReplicaLayout, ParallelLayout):
        pass

    return Replicas(options.world_size)


REPLICAS = Component(
    name="kit-replicas",
    kind="parallel",
    factory=_replica_layout,
    options_type=ReplicaLayoutOptions,
    capabilities={"devices": ("cpu",), "world_size": 2},
)


@pytest.mark.slow
class TestReplicaLayout(ParallelConformance):
    component = REPLICAS
