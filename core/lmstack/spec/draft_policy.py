"""How many draft tokens each sequence gets this step: the adaptive draft length.

A drafted token costs a query token in the verifying step and pays only when it is accepted.
While a step is memory-bound (the weights are read once whatever the batch; small batches on
any device) an extra query token costs almost nothing and every accepted draft is a token for
free; once the step is compute-bound (large batches) an extra token costs what a plain decode
token costs, and a draft accepted with probability g < 1 loses. Two things are measured:

- the step's cost: t(T) = a + b * T seconds for T query tokens (`lmstack.engine.step_cost`), from
  the steps that only decode (and verify), drafting included (a prefill chunk's tokens cost
  differently, and drafting never changes them), as the line through the two measured sizes
  around this step's (`fit_near`: the marginal cost of a token where the step is, not averaged
  over batch 1 and batch 32). Until two sizes are known, steps alternate between one draft
  per sequence and none: two sizes measured within a few steps, at the price of at most one
  draft a sequence where drafting turns out not to pay (32 streams on a CPU);
- acceptance: each draft token is accepted with probability alpha (chain drafts stop at the
  first rejection), estimated per sequence from its own verifications, shrunk towards the
  engine-wide rate (pseudo-counts) and decaying (per verification, and faster per step it is
  not drafted), so a sequence that stopped drafting drifts back to the global rate and is
  tried again.

The k-th draft of a sequence is accepted (and so emits a token) with probability
g_k = c_1 * ... * c_k, where c_j, the probability that draft j is accepted once the ones before
it were, is measured engine-wide per depth j (shrunk towards depth j-1's, a depth never reached
taking the deepest measured rate) and scaled per sequence by its alpha over the engine's
(capped below 1). With the same rate at every depth this is alpha**k; but a draft head's chains
are not geometric: once its first drafts are accepted the next ones are likelier (EAGLE's head
on SmolLM2, held out: 0.59, 0.63, 0.69, 0.75 at depths 1-4), and alpha**k, which pools the
depths, priced the deep drafts of a chain too low.
Drafting itself is priced apart: the speculator's `propose` time per drafted token (a draft
head's passes; an n-gram lookup costs ~nothing), measured and kept out of the step times the
line is fitted to, so n drafts cost t(T + n) + n * d. A head's pass is not a query token: priced
as one, a draft looked cheap exactly where a step is compute-bound and a head pass is not
(32 streams: EAGLE ran at 0.86x plain decoding, drafting ~4 tokens a step for 0.4 accepted each).
A draft head's first draft of a sequence costs more than a further one (its pass enters the
tokens verified since the sequence last drafted, a further pass one row); where the speculator
says what its first drafts took (`Speculator.first_draft_seconds`), a sequence's first draft is
priced at c, the median of those per sequence, and each further one at d, the median of the
rest per draft, so s sequences drafting n tokens in all cost t(T + n) + s * c + (n - s) * d.
Priced alike, one-draft steps (batch 1, mostly) priced a second draft at c, about twice d.

Where drafting does not pay (32 streams on a CPU), steps without drafts fade the remembered
drafting costs until drafting is tried again. In a batch of more than PROBE_SEQS sequences that
retry is a probe: PROBE_SEQS sequences draft (each first enters the rows it queued meanwhile,
the dear part of a retry), and the probe's measured cost replaces the faded ones, so the next
step prices everyone from it. Retried by the whole batch at once and priced by the faded median,
the retries cost EAGLE ~5 % of a 32-stream run on a CPU (benchmarks/e2e/eagle.py --compare-probe).
A smaller batch retries whole, priced as before (its retry is cheap). A probe that finds
drafting still does not pay slows the fading for the next one (each such probe halves the fade
per step, up to MAX_PROBE_BACKOFF times; a probe or retry after which drafting pays resets it):
under a steady load where drafting never pays the gap between probes doubles up to 8x (one A/B
at 32 streams on a CPU: 0.971x plain against 0.951x without the backoff). Nothing slower follows
a fall in load: the remembered costs are measurements, so a smaller batch drafts at once where
they pay there.

A speculator that ends its chains by its own confidence (`Speculator.stops_by_confidence`: a
draft head's probabilities multiplied along the chain, its estimate that the chain is accepted)
gets, for each sequence chosen to draft, the whole `num_draft_tokens` and this step's break-even
`min_gain` (what one more query token adds to the step times the step's expected rate): it
drafts while its estimate stays at or above that. alpha**k prices every chain alike; a head
knows which of its drafts are sure (EAGLE-2 sizes its draft trees on the same estimate).

Draft slots are ordered best expected gain first, and the step takes the prefix of that order
that maximizes expected tokens per second, N(T) / (t(T + n) + s * c + (n - s) * d), each size
priced by the measured cost around it (`StepCostModel`'s curve, which never falls), if that
beats drafting nothing by MIN_RATE_GAIN (a smaller modelled gain is within the model's error,
and came out as a loss). Memory-bound (b ~ 0): every draft up to `num_draft_tokens`.
Compute-bound (a ~ 0): N / T falls with every draft whose gain is below 1, so none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmstack.engine.step_cost import StepCostModel

PRIOR_ACCEPTANCE = 0.6  # before anything is measured
PSEUDO_COUNTS = 4.0  # weight of the engine-wide rate in a sequence's own estimate
DECAY = 0.98  # per verification: a sequence's and the engine's counts fade (recent text counts)
DRAFT_SAMPLES = 16  # recent drafting times per token; their median prices a draft
DRAFT_IDLE_DECAY = 0.97  # per step without drafts: the remembered drafting cost fades (tried again)
IDLE_DECAY = 0.9  # per step a sequence is not drafted: its own counts fade (it is tried again)
PROBE_SEQS = 4  # after steps without drafts, the sequences drafted again in the first step
MIN_RATE_GAIN = 0.02  # drafts are taken only if they raise the step's expected tokens/s by this
MAX_PROBE_BACKOFF = 3  # fruitless probes in a row that each halve the fade (8x fewer probes)
MAX_RATE = 0.99  # the most a per-depth rate scaled to a sequence may reach


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (1 if num_accepted < num_drafted else 0)


@dataclass
class DraftLengthPolicy:
    """Per step: `limits(seq_ids, other_tokens)` -> drafts allowed per sequence; fed with
    every step's tokens and time (`cost`, the engine's shared model, or `record_step`) and
    `record_verification`."""

    max_draft_tokens: int
    adaptive: bool = True
    cost: StepCostModel = field(default_factory=StepCostModel)
    _global: _Acceptance = field(default_factory=_Acceptance)
    _seqs: dict[int, _Acceptance] = field(default_factory=dict)
    # Engine-wide per depth j (index j - 1): verifications that reached draft j, and accepted it.
    _reached: list[float] = field(default_factory=list)
    _hits: list[float] = field(default_factory=list)
    # False: every depth at the pooled rate (g_k = alpha**k), as before the per-depth rates.
    by_depth: bool = True
    last_mean_limit: float = 0.0  # the mean limit of the last step (a metric)
    _draft_costs: list[float] = field(default_factory=list)  # recent propose seconds per draft
    _first_costs: list[float] = field(default_factory=list)  # ... of a sequence's first draft
    _decisions: int = 0
    _faded: bool = False  # the remembered drafting costs were faded since the last measurement
    _probing: bool = False  # this step's drafts are a probe: their cost replaces the faded ones
    # 0: no probe (the whole batch retries at once, priced by the faded costs: as before the
    # probe; benchmarks/e2e/eagle.py --compare-probe measures the two)
    probe_seqs: int = PROBE_SEQS
    # Probes in a row after which drafting still did not pay (up to max_probe_backoff): the fade
    # per idle step is DRAFT_IDLE_DECAY ** (1 / 2 ** backoff). 0 as max: every probe fades alike.
    max_probe_backoff: int = MAX_PROBE_BACKOFF
    # Drafts must raise the step's expected tokens/s by this fraction (0: any gain, as before).
    min_rate_gain: float = MIN_RATE_GAIN
    _probe_backoff: int = 0
    _probe_verdict: bool = False  # a probe was measured: the next decision says if it paid
    # The speculator ends its chains by its own confidence (`Speculator.stops_by_confidence`): a
    # sequence chosen to draft may draft up to max_draft_tokens, each draft while the drafter's
    # estimate that the chain is accepted stays at or above `min_gain`.
    confidence: bool = False
    min_gain: float = 0.0  # this step's break-even: expected tokens a further draft must bring

    # --- measurements ------------------------------------------------------------------------

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` query tokens took `seconds`, its drafting excluded."""
        self.cost.record(num_tokens, seconds)

    def record_drafting(
        self, num_drafts: int, seconds: float, num_seqs: int = 0, first_seconds: float = 0.0
    ) -> None:
        """The speculator proposed `num_drafts` tokens for `num_seqs` sequences in `seconds`, of
        which `first_seconds` went to their first drafts (0: not told; every draft priced alike)."""
        if num_drafts <= 0:
            return
        if self._probing:
            # Faded costs were a reason to try again, not measurements: a probe's measurement
            # replaces them (else one probe's cost barely moves the median, and the whole batch
            # retries in the next step at the faded price).
            self._first_costs, self._draft_costs = [], []
            self._probe_verdict = True
        self._faded = self._probing = False
        keep = DRAFT_SAMPLES - 1
        if num_seqs > 0 and first_seconds > 0.0:
            self._first_costs = [*self._first_costs[-keep:], first_seconds / num_seqs]
            if num_drafts > num_seqs:
                further = (seconds - first_seconds) / (num_drafts - num_seqs)
                self._draft_costs = [*self._draft_costs[-keep:], further]
        else:
            per_draft = seconds / num_drafts
            self._first_costs = [*self._first_costs[-keep:], per_draft]
            self._draft_costs = [*self._draft_costs[-keep:], per_draft]

    @staticmethod
    def _median(costs: list[float]) -> float:
        ordered = sorted(costs)
        return ordered[len(ordered) // 2] if ordered else 0.0

    @property
    def draft_seconds(self) -> float:
        """What proposing a further draft token costs: the median of the recent measurements;
        a first draft's until a further one was measured."""
        return self._median(self._draft_costs) if self._draft_costs else self.first_draft_seconds

    @property
    def first_draft_seconds(self) -> float:
        """What a sequence's first draft costs: the median of the recent measurements (a
        sequence's very first also runs the head over its prompt: an outlier, not the rule)."""
        return self._median(self._first_costs)

    def record_verification(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self._global.add(num_drafted, num_accepted)
        self._seqs.setdefault(seq_id, _Acceptance()).add(num_drafted, num_accepted)
        if len(self._reached) < num_drafted:
            grow = num_drafted - len(self._reached)
            self._reached += [0.0] * grow
            self._hits += [0.0] * grow
        for j in range(len(self._reached)):
            self._reached[j] = self._reached[j] * DECAY + (j <= num_accepted and j < num_drafted)
            self._hits[j] = self._hits[j] * DECAY + (j < num_accepted)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    # --- the model ---------------------------------------------------------------------------

    def acceptance(self, seq_id: int | None = None) -> float:
        """alpha: the probability that a draft token is accepted given the ones before it were,
        pooled over the depths (the engine's, or a sequence's own shrunk towards it)."""
        g = self._global
        total = g.accepted + g.rejected
        engine = (g.accepted + PRIOR_ACCEPTANCE * PSEUDO_COUNTS) / (total + PSEUDO_COUNTS)
        own = self._seqs.get(seq_id) if seq_id is not None else None
        if own is None:
            return engine
        return (own.accepted + engine * PSEUDO_COUNTS) / (own.accepted + own.rejected + PSEUDO_COUNTS)

    def depth_rates(self, k: int) -> list[float]:
        """c_1 .. c_k engine-wide: the probability that draft j is accepted given the ones
        before it were, each shrunk towards the depth before (depth 1: towards the pooled rate)."""
        rates, prior = [], self.acceptance()
        for j in range(k):
            hits, reached = (self._hits[j], self._reached[j]) if j < len(self._reached) else (0.0, 0.0)
            prior = (hits + prior * PSEUDO_COUNTS) / (reached + PSEUDO_COUNTS)
            rates.append(prior)
        return rates

    def gains(self, seq_id: int | None, k: int) -> list[float]:
        """g_1 .. g_k: the probability that a sequence's draft j is accepted (it emits a token)."""
        return self._gains(self.acceptance(seq_id), self.depth_rates(k) if self.by_depth else [], k)

    def _gains(self, alpha: float, rates: list[float], k: int) -> list[float]:
        """`gains` of a sequence whose own rate is alpha, from the engine's `depth_rates` (none:
        alpha at every depth)."""
        if not rates:
            return [alpha**j for j in range(1, k + 1)]
        scale = alpha / self.acceptance()
        out, g = [], 1.0
        for c in rates:
            g *= min(MAX_RATE, c * scale)
            out.append(g)
        return out

    def step_cost(self, num_tokens: float = 1.0) -> tuple[float, float]:
        """(a, b) of t(T) = a + b * T around T = `num_tokens`; b = 0 until two sizes of step
        were measured."""
        return self.cost.fit_near(num_tokens) or (1.0, 0.0)

    # --- the decision ------------------------------------------------------------------------

    def limits(self, seq_ids: list[int], other_tokens: int = 0) -> dict[int, int]:
        """Drafts allowed per sequence in decode this step (each also runs its own newest
        token); `other_tokens`: query tokens of the step's other work (prefill chunks), if known."""
        k_max = self.max_draft_tokens
        self.min_gain = 0.0
        if not self.adaptive or k_max <= 0:
            self.last_mean_limit = float(k_max if seq_ids else 0)
            return dict.fromkeys(seq_ids, k_max)
        limits = dict.fromkeys(seq_ids, 0)
        tokens = len(seq_ids) + other_tokens
        # t(tokens + n) for every prefix of the step's draft slots (and one more for min_gain).
        costs = self.cost.seconds_from(tokens, len(seq_ids) * k_max + 2)
        if costs is None:  # two sizes not measured yet: one draft each, then none, ...
            self._decisions += 1
            per_seq = self._decisions % 2
            self.last_mean_limit = float(per_seq)
            return dict.fromkeys(seq_ids, per_seq)
        # Candidate (gain, k, seq) for every draft slot; gains fall along a chain (every factor
        # is below 1), so taking them best first respects each chain's order.
        candidates = []
        rates = self.depth_rates(k_max) if self.by_depth else []  # once a step: the same for all
        for sid in seq_ids:
            gains = self._gains(self.acceptance(sid), rates, k_max)
            candidates += [(gain, k, sid) for k, gain in enumerate(gains, 1)]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        # Of the prefixes of that order, the one whose step emits the most expected tokens per
        # second, each size priced by the measured cost around it. Not the first draft whose
        # marginal cost exceeds its gain: a verification's first row may cost more than the next
        # few (a multi-row pass has fixed costs of its own), and a chain of four can pay where
        # one draft alone does not.
        expected = float(len(seq_ids))  # tokens the step emits: one per sequence, plus gains
        best, best_rate = 0, expected / costs[0]
        plain_rate = best_rate
        first, further = self.first_draft_seconds, self.draft_seconds
        drafting = 0.0
        for n, (gain, k, _) in enumerate(candidates, 1):
            expected += gain
            drafting += first if k == 1 else further
            rate = expected / (costs[n] + drafting)
            if rate > best_rate:
                best, best_rate = n, rate
        if best and best_rate < plain_rate * (1.0 + self.min_rate_gain):
            # A gain this small is within the cost model's error: its sizes are bucket means (a
            # 33-token step shares 32's bucket) and the kernels' costs rise in steps (16-row
            # panels: a 33rd row starts a third). At 32 streams on a CPU such near-ties drafted
            # one token a step for a modelled +0.3-1 % that came out as a loss (2026-12-05).
            best, best_rate = 0, plain_rate
        # A retry after steps without drafts, in a batch of more than PROBE_SEQS sequences, is a
        # probe: what a first draft costs now was not measured (each sequence has the rows
        # verified while it was not drafted to enter: up to 32 one-row steps' worth, ~13 ms a
        # step at 32 streams on a CPU when all retried at once), so a few sequences try, and the
        # next step prices the rest from what theirs cost. A small batch retries whole, priced
        # as before: its retry costs little, and one catch-up pass is no price for the next steps.
        if self._probe_verdict:  # the first decision priced by a probe's measurement
            self._probe_verdict = False
            self._probe_backoff = 0 if best else min(self._probe_backoff + 1, self.max_probe_backoff)
        elif best and not self._faded:
            self._probe_backoff = 0  # drafting pays at measured prices (the load fell, say)
        self._probing = bool(best) and self._faded and len(seq_ids) > self.probe_seqs > 0
        cap = self.probe_seqs if self._probing else len(seq_ids)
        drafting_seqs = 0
        for _, _, sid in candidates[:best]:
            if not limits[sid]:  # a sequence's first slot (its further ones come after it)
                if drafting_seqs >= cap:
                    continue
                drafting_seqs += 1
            limits[sid] += 1
        if best and self.confidence:
            # The drafter knows each draft's odds better than alpha**k does: a chosen sequence
            # may draft to the end, each draft while the drafter's estimate of its gain pays for
            # the query token it adds to the step, at this step's rate. Its drafting is not
            # counted: a draft's odds are known only once its pass has run. (Counted too, the
            # bar stopped chains early and at batch 1 on a CPU more steps drafted nothing:
            # 1.61 tokens per step, 1.17x plain, against 1.81 and 1.22x without; 2026-12-04.)
            # The token's cost is read where the step starts (its first extra row), not at the
            # chain's full length: the sizes there are measured whenever a first draft passes,
            # while the cost at the full length, once a slow step raised it, raised the bar,
            # chains stopped short of that size and it was never measured again (a 2026-12-05
            # benchmark run drafted in only part of its steps: 1.34 tokens a step, 1.04x).
            self.min_gain = (costs[1] - costs[0]) * best_rate
            limits = {sid: k_max if n else 0 for sid, n in limits.items()}
        if not best:
            # Nothing drafted, so nothing new is measured: the remembered drafting cost fades,
            # and drafting is tried again later (the load, or the speculator's cost, may change).
            fade = DRAFT_IDLE_DECAY ** (0.5**self._probe_backoff)
            self._draft_costs = [c * fade for c in self._draft_costs]
            self._first_costs = [c * fade for c in self._first_costs]
            self._faded = bool(self._first_costs)
        for sid, n in limits.items():
            own = self._seqs.get(sid)
            if not n and own is not None:
                # Not drafted: nothing new is measured, so the sequence's own record fades
                # towards the engine-wide rate and it is tried again (text changes as it goes).
                own.accepted *= IDLE_DECAY
                own.rejected *= IDLE_DECAY
        self.last_mean_limit = sum(limits.values()) / len(limits) if limits else 0.0
        return limits
