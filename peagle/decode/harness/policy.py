"""The harness's per-call policy: the round plan of a batch size from the cost table (tree, chain or plain), whether
speculation pays (the acceptance observed, the paired calls' measured gains), what each generate call hands the next,
and :class:`CallHarness`, what both drafting harnesses share over one call (the package doc derives the decisions).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from peagle.decode.harness.calibration import EdgeCalibration
from peagle.decode.harness.cost import CostTable
from peagle.decode.harness.evidence import (
    CallYield,
    ChainAcceptance,
    PairedGains,
    RoundOverhead,
    RoundTimes,
    paired_gain,
)

__all__ = [
    "MIN_TRIALS",
    "PAIRED_MINORITY_SHARE",
    "CallHarness",
    "HarnessPolicy",
    "Plan",
    "SpeculationRecord",
    "TreeLearning",
]

# Rejections and accepted drafts a generate call observes before the harness may stop speculating for the rest of it.
MIN_TRIALS = 32
# The share of a paired call's tokens decoded the way that the verdict so far says is slower (plainly in a control,
# drafting in a probe: the cost of a paired call is that share at the slower speed; at a third, controls on the demo's
# easy prompts ran at 0.6x of chain 5 and probes at batch 16 at 0.6x-0.85x of the target alone). How the paired calls'
# gains are timed and pooled: :mod:`peagle.decode.harness.evidence`.
PAIRED_MINORITY_SHARE = 0.25
# A static batch's drafting calls stop the next calls' drafting below this share of plain decoding's tokens per table
# second (:meth:`HarnessPolicy.batch_yield_pays`): a first call still learning its edges (wide trees) yielded 0.94x
# at batch 4 on the demo, where the best fixed tree ran 1.28x the target alone; stragglers cost 0.6x-0.7x at batch 16.
YIELD_SHARE = 0.85
# Weight of the earlier calls' acceptance counts in the verdict of :meth:`HarnessPolicy.end_call` (halved per call):
# how often a drafter is accepted varies from prompt to prompt, and one hard prompt must not make the next plain.
CALL_DECAY = 0.5
# A call that finds speculation does not pay makes the next calls at its batch size decode plainly; the 2nd call after
# it is paired (a probe), an interval that doubles (up to 32 calls) while probes find the same. While speculation
# pays, the 2nd call is paired too (a control), then every 2nd while the gains lean towards plain decoding,
# intervals that double (up to 32 calls) while they lean towards drafting (decided or not: the acceptance already
# says drafting pays, and each control costs its plain share). A paired call's plain rounds run one after another:
# plain rounds between drafting rounds ran 1.2x-1.4x as long as a plain call's at batch 8 on this machine (the
# drafter's work evicts the target's from the CPU's caches), consecutive ones after a drafting phase as long as a plain
# call's.
FIRST_PROBE_EVERY = 2
MAX_PROBE_EVERY = 32
ROUND_KINDS = ("tree", "chain", "plain")
EXPLORE_EVERY = 8  # ... except every 8th round, an interval that doubles (up to 64) while exploring finds nothing
MAX_EXPLORE_EVERY = 64


@dataclass
class Plan:
    """How one round drafts: a dynamic tree or a chain (top-k children per depth), or plain decoding."""

    kind: Literal["tree", "chain", "plain"]
    topk: int  # children per candidate node at each depth (1 for a chain)
    verify_cost: Tensor  # [max_nodes + 1] V[n] of the batch-size bucket and context interval
    max_nodes: int


@dataclass
class TreeLearning:
    """What a P-EAGLE call's tree decisions learnt (:meth:`PassHarness.topk`), for the next call of its batch-size
    bucket, context interval and kind of round: accepted drafts off the top-1 chain and the verify seconds of trees
    beyond chains, tokens emitted and batched rounds, and the interval between exploring rounds."""

    siblings: tuple[float, float] = (0.0, 0.0)
    emitted: tuple[float, int] = (0.0, 0)
    explore_every: int = EXPLORE_EVERY


@dataclass
class SpeculationRecord:
    """The verdict of the last generate call that decided (:meth:`HarnessPolicy.end_call`, :meth:`HarnessPolicy.
    end_paired`) for one batch-size bucket, context interval and kind of round: whether speculating paid, the calls
    since the last paired call, how many calls apart the next one comes, and the paired calls so far (they decode
    plainly first and last in turn)."""

    pays: bool = True
    skipped: int = 0  # calls since the last paired call: a probe (speculation does not pay) or a control (it pays)
    probe_every: int = FIRST_PROBE_EVERY
    control_every: int = FIRST_PROBE_EVERY
    paired_calls: int = 0


def _record_verdict(record: SpeculationRecord, pays: bool) -> None:
    """A call's verdict on whether speculating pays, with the probe / control intervals it implies."""
    if pays:
        if not record.pays:  # a probe that found speculating pays again: controls start over
            record.control_every, record.skipped = FIRST_PROBE_EVERY, 0
        record.pays, record.probe_every = True, FIRST_PROBE_EVERY
    else:
        if not record.pays:  # a probe that found the same
            record.probe_every = min(2 * record.probe_every, MAX_PROBE_EVERY)
        record.pays, record.skipped = False, 0


class HarnessPolicy:
    """The round plan from the cost table: tree or chain by batch size, and the per-bucket chain widths.

    Args:
        table: the profiled cost table.
        max_nodes: the most nodes (root included) a round may verify.
        tree_topk: children per candidate node of a dynamic tree.
        tree_growth: a bucket drafts trees while V[2 L + 1] + O <= tree_growth * (V[L + 1] + O) for its best chain
            length L and the round overhead O its earlier calls timed (:class:`RoundOverhead`), i.e. while doubling
            the verified nodes costs a round little; chains otherwise.
        acceptance: the per-position acceptance rate the chain-width table assumes before calibration.
        timed: harnesses also decide by the measured wall time of their rounds (plain against drafting rounds, trees
            against chains; :class:`CallHarness`); False: by the table and the observed acceptance alone.
    """

    def __init__(
        self,
        table: CostTable,
        max_nodes: int,
        tree_topk: int = 4,
        tree_growth: float = 1.25,
        acceptance: float = 0.7,
        timed: bool = True,
    ) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.table, self.max_nodes = table, max_nodes
        self.tree_topk, self.tree_growth, self.acceptance = tree_topk, tree_growth, acceptance
        self.timed = timed
        # What earlier generate calls learnt about the drafter (mean exponent and calibration sums): a new call's
        # requests start from it instead of from scratch.
        self.learnt_gamma, self.learnt_calibration = 1.0, (0.0, 0.0)
        # What P-EAGLE calls learnt about the acceptance of each kind of tree edge (shared by every batch size).
        self.learnt_edges = EdgeCalibration.start()
        # What the tree decisions of earlier calls learnt, and {kind of round: its timed rounds}, by (bucket, interval,
        # sampled): a round's tokens, seconds and the verify time its trees cost grow with the batch.
        self.learnt_trees: dict[tuple[int, int, bool], TreeLearning] = {}
        self.learnt_timing: dict[tuple[int, int, bool], dict[str, RoundTimes]] = {}
        self.paired_gains: dict[tuple[int, int, bool], PairedGains] = {}  # the paired calls' gains, by the same keys
        self.learnt_overhead: dict[tuple[int, int, bool], RoundOverhead] = {}  # by the same keys
        self._chain_cost_cache: dict[tuple[int, int, bool], list[float]] = {}
        self._break_even_cache: dict[tuple[int, int, bool], float] = {}  # by (bucket, interval, sampled)
        self._break_even_by_arguments: dict[tuple[int, int, bool], float] = {}
        self._records: dict[tuple[int, int, bool], SpeculationRecord] = {}  # by (bucket, interval, sampled)
        self._pooled: dict[tuple[int, int, bool], ChainAcceptance] = {}  # the calls' acceptance, by the same keys
        self._yields: dict[tuple[int, int, bool], CallYield] = {}  # the calls' drafting yield, by the same keys

    def start_state(self, batch: int, device) -> tuple[Tensor, Tensor]:
        """(gamma [B], calibration [B, 2]) for the requests of a new generate call."""
        gamma = torch.full((batch,), self.learnt_gamma, dtype=torch.float64, device=device)
        calibration = torch.tensor(self.learnt_calibration, dtype=torch.float64, device=device).repeat(batch, 1)
        return gamma, calibration

    def learn(self, gamma: Tensor, calibration: Tensor) -> None:
        """Keeps the mean state of a finished generate call for the next one."""
        self.learnt_gamma = float(gamma.mean())
        self.learnt_calibration = tuple(calibration.mean(0).tolist())

    def chain_length(self, batch: int, context: int, acceptance: float | None = None, sampled: bool = False) -> int:
        """The chain length L (drafts; 0 = plain decoding) maximising (1 + a + .. + a^L) / (pass(L) + V[L + 1]);
        ``sampled``: with the costs of sampled rounds."""
        a = self.acceptance if acceptance is None else acceptance
        costs = self._chain_costs(batch, context, sampled)
        best, length, gain = 1.0 / costs[0], 0, 0.0
        for n in range(1, len(costs)):
            gain += a**n
            if costs[n] > 0 and (1 + gain) / costs[n] > best:
                best, length = (1 + gain) / costs[n], n
        return length

    def break_even_rate(self, batch: int, context: int, sampled: bool = False) -> float:
        """The per-position acceptance rate above which some chain emits more tokens per second than plain decoding
        (``chain_length`` > 0; it grows with the rate), to 1e-6 by bisection, kept per batch-size bucket, context
        interval and kind of round (and per argument, as the harness asks it every round); above 1 when no rate
        makes speculation pay."""
        if (batch, context, sampled) in self._break_even_by_arguments:
            return self._break_even_by_arguments[batch, context, sampled]
        key = self.table_key(batch, context, sampled)
        if key not in self._break_even_cache:
            if self.chain_length(batch, context, 1.0, sampled) == 0:
                rate = 2.0
            elif self.chain_length(batch, context, 0.0, sampled) > 0:
                rate = 0.0
            else:
                low, high = 0.0, 1.0  # chain_length(low) == 0 < chain_length(high)
                while high - low > 1e-6:
                    middle = (low + high) / 2
                    low, high = (
                        (low, middle) if self.chain_length(batch, context, middle, sampled) > 0 else (middle, high)
                    )
                rate = high
            self._break_even_cache[key] = rate
        self._break_even_by_arguments[batch, context, sampled] = self._break_even_cache[key]
        return self._break_even_cache[key]

    def speculation_pays(self, batch: int, context: int, acceptance: ChainAcceptance, sampled: bool = False) -> bool:
        """False once at least :data:`MIN_TRIALS` observations put the acceptance rate below the break-even rate, at
        which no chain beats plain decoding, by EVIDENCE_Z standard errors (:attr:`ChainAcceptance.upper_rate`). The
        rate of tree rounds is per level (a rejection: no verified child of the path's end accepted); a tree that
        accepts a level as often as a chain accepts a position costs more per level, so it does not pay either."""
        return acceptance.trials < MIN_TRIALS or acceptance.upper_rate > self.break_even_rate(batch, context, sampled)

    def batch_yield_pays(self, batch: int, context: int, call_yield: CallYield, sampled: bool = False) -> bool:
        """Whether drafting rounds at ``batch`` > 1 emitted at least YIELD_SHARE of plain decoding's tokens per table
        second (``batch`` tokens per V[1]); True at batch 1 (each round is its request's own) and before a drafting
        round. In a static batch the rounds go on until the slowest request is done: at batch 16 on the demo, chain 5
        ran 115 batched rounds where a request needed 71 on average (its prompts accepted 1.6 to 3.4 tokens a round),
        and the target alone ran 1.57x as fast, while the per-request acceptance rate (0.6) was above break-even
        (0.54). The table's seconds, not the measured ones: the same every run, so one call decides as the acceptance
        does."""
        if batch <= 1 or call_yield.seconds <= 0:
            return True
        plain = batch / self._chain_costs(batch, context, sampled)[0]
        return call_yield.tokens / call_yield.seconds >= YIELD_SHARE * plain

    def start_call(
        self, batch: int, context: int, sampled: bool = False
    ) -> Literal["draft", "probe", "plain", "control"]:
        """How a new generate call decodes: ``"draft"``, unless the last call that decided here (batch-size bucket,
        context interval, kind of round) found that speculating did not pay; then ``"plain"``, except every
        ``probe_every``-th call, a ``"probe"``, so that a drafter that got better, or prompts it suits, are noticed
        (each probe that finds the same doubles the interval, :meth:`end_paired`). Without probes, every call would
        pay for its first MIN_TRIALS observations again. While speculating pays and rounds are timed, every
        ``control_every``-th call is a ``"control"``. Probes and controls are paired calls: they draft for part of
        their tokens and decode plainly for the rest, and time both (:class:`PairedGains`)."""
        record = self._records.setdefault(self.table_key(batch, context, sampled), SpeculationRecord())
        if record.pays and not self.timed:
            return "draft"
        record.skipped += 1
        if record.skipped < (record.control_every if record.pays else record.probe_every):
            return "draft" if record.pays else "plain"
        record.skipped = 0
        record.paired_calls += 1
        return "control" if record.pays else "probe"

    def plain_first(self, batch: int, context: int, sampled: bool = False) -> bool:
        """Whether the paired call :meth:`start_call` just started decodes plainly first (every other one does, so
        that the longer context of a call's later rounds weighs on both kinds alike)."""
        return self._records[self.table_key(batch, context, sampled)].paired_calls % 2 == 0

    def paired_verdict(self, batch: int, context: int, sampled: bool = False) -> float:
        """:meth:`PairedGains.verdict` of the paired calls so far (0 before one)."""
        gains = self.paired_gains.get(self.table_key(batch, context, sampled))
        return gains.verdict() if gains is not None else 0.0

    def _pool(self, key: tuple[int, int, bool], acceptance: ChainAcceptance) -> ChainAcceptance:
        """The calls' acceptance so far, earlier calls weighing CALL_DECAY per call, with this call's added."""
        pooled = self._pooled.setdefault(key, ChainAcceptance())
        pooled.decay(CALL_DECAY)
        pooled.count(acceptance.accepted, acceptance.trials - acceptance.accepted)
        return pooled

    def end_call(
        self,
        batch: int,
        context: int,
        acceptance: ChainAcceptance,
        sampled: bool = False,
        call_yield: CallYield | None = None,
    ) -> None:
        """Records what a drafting call found for the next calls' :meth:`start_call`. The paired calls' gains decide
        where they have (measured speeds, not the table, say whether drafting pays). Where rounds are timed and they
        have not, a verdict that speculating does not pay stands: a probe must show that drafting pays, not merely
        fail to show that it loses (the cost table's break-even rate, which leaves out a round's bookkeeping, would
        clear it). Otherwise the acceptance rate decides once at least :data:`MIN_TRIALS` are observed: this call's
        counts added to the earlier calls' (weighed CALL_DECAY per call, so that one hard prompt does not outweigh
        the rest), and at batch > 1 the drafting rounds' tokens per table second must reach plain decoding's
        (:meth:`batch_yield_pays`, ``call_yield`` pooled over calls the same way)."""
        key = self.table_key(batch, context, sampled)
        pooled = self._pool(key, acceptance)
        yields = self._yields.setdefault(key, CallYield())
        yields.decay(CALL_DECAY)
        if call_yield is not None:
            yields.add(call_yield.tokens, call_yield.seconds)
        record = self._records.setdefault(key, SpeculationRecord())
        verdict = self.paired_verdict(batch, context, sampled) if self.timed else 0.0
        if verdict:
            pays = verdict > 0
        elif self.timed and not record.pays:
            pays = False
        elif pooled.trials >= MIN_TRIALS:
            pays = self.speculation_pays(batch, context, pooled, sampled)
            pays = pays and self.batch_yield_pays(batch, context, yields, sampled)
        else:
            return
        _record_verdict(record, pays)

    def end_paired(
        self,
        batch: int,
        context: int,
        sampled: bool,
        plain: RoundTimes,
        drafting: RoundTimes,
        acceptance: ChainAcceptance,
    ) -> None:
        """Records what a paired call found: its gain (``plain`` and ``drafting``: its timed rounds of each kind)
        joins the gains so far, which then decide. Drafting faster: speculating pays. Plain decoding faster: the next
        calls decode plainly. Undecided: a verdict either way stands. While speculating pays, the interval to the next
        control doubles (up to MAX_PROBE_EVERY) when the gains' mean is above 0, and controls stay FIRST_PROBE_EVERY
        calls apart otherwise; probes stay FIRST_PROBE_EVERY calls apart while they find drafting faster (their
        interval doubles when one finds it no faster, as when they decide it is slower).
        ``acceptance``: its drafting rounds', pooled with the calls' so far."""
        key = self.table_key(batch, context, sampled)
        self._pool(key, acceptance)
        gain = paired_gain(plain, drafting)
        gains = self.paired_gains.setdefault(key, PairedGains())
        if gain is not None:
            gains.add(*gain)
        record = self._records.setdefault(key, SpeculationRecord())
        verdict = gains.verdict()
        if record.pays and verdict >= 0 and gains.mean > 0:
            record.control_every = min(2 * record.control_every, MAX_PROBE_EVERY)
        elif verdict or (not record.pays and (gain is None or gain[0] <= 0)):
            _record_verdict(record, verdict > 0)

    def table_key(self, batch: int, context: int, sampled: bool = False) -> tuple[int, int, bool]:
        """(batch-size bucket, context interval, sampled): what the cached and recorded figures are kept by."""
        return self.table.bucket(batch), self.table.context_index(context), sampled

    def _chain_costs(self, batch: int, context: int, sampled: bool) -> list[float]:
        """Seconds of a round of a chain of n drafts, n = 0 .. max_nodes - 1 (kept per batch-size bucket, context
        interval and kind of round: sampled rounds ask every round)."""
        key = self.table_key(batch, context, sampled)
        if key not in self._chain_cost_cache:
            verify = self.table.verify_row(batch, context, self.max_nodes, sampled).tolist()
            draft = [0.0] + [self._chain_draft_time(batch, n, sampled) for n in range(1, self.max_nodes)]
            self._chain_cost_cache[key] = [d + v for d, v in zip(draft, verify[1:], strict=True)]
        return self._chain_cost_cache[key]

    def _chain_draft_time(self, batch: int, length: int, sampled: bool) -> float:
        if self.table.pass_s:
            return self.table.pass_time(batch, length, sampled)
        return sum(float(self.table.draft_row(batch, d)[0]) for d in range(1, length + 1))

    def chain_widths(self, acceptance: float | None = None, context: int = 0) -> dict[int, int]:
        """{bucket batch size: best chain length} for every profiled batch size (0 = plain decoding)."""
        return {b: self.chain_length(b, context, acceptance) for b in self.table.batch_sizes}

    def plan(self, batch: int, context: int, acceptance: float | None = None) -> Plan:
        verify = self.table.verify_row(batch, context, self.max_nodes)
        length = self.chain_length(batch, context, acceptance)
        if length == 0:
            return Plan("plain", 1, verify, self.max_nodes)
        wide = min(2 * length + 1, self.max_nodes)
        # What rounds take beyond the table (RoundOverhead, learnt by earlier calls) is paid by either kind of round.
        learnt = self.learnt_overhead.get(self.table_key(batch, context))
        overhead = learnt.seconds if learnt is not None else 0.0
        tree_s, chain_s = float(verify[wide]) + overhead, float(verify[length + 1]) + overhead
        kind = "tree" if tree_s <= self.tree_growth * chain_s else "chain"
        return Plan(kind, self.tree_topk if kind == "tree" else 1, verify, self.max_nodes)


class CallHarness:
    """What both harnesses share over one generate call: the plan of its batch size, the per-position acceptance it
    observes, and whether it drafts at all (the plan; what earlier calls found, :meth:`HarnessPolicy.start_call`;
    then what this call observes, :meth:`HarnessPolicy.speculation_pays`). ``sampled``: the call's drafts are drawn.

    A paired call (a probe or a control) drafts in one phase and decodes plainly in the other; the phase of the kind
    the verdict so far says is slower takes PAIRED_MINORITY_SHARE of its tokens: :attr:`drafting_phase` says which
    phase is under way and :meth:`switch` ends the first."""

    def __init__(self, policy: HarnessPolicy, batch: int, context: int, sampled: bool) -> None:
        self.policy, self.batch, self.context, self.sampled = policy, batch, context, sampled
        self.plan = policy.plan(batch, context)
        self.verify_s = self.plan.verify_cost.tolist()  # host copy of V[n]
        self.max_nodes = policy.max_nodes
        self.chain_acceptance = ChainAcceptance()  # sampled chains' length; whether speculating pays
        self.key = policy.table_key(batch, context, sampled)
        start = policy.start_call(batch, context, sampled) if self.plan.kind != "plain" else "plain"
        self.call_start: Literal["draft", "probe", "plain", "control"] = start  # GenerateMetrics.harness_call
        # Untimed, a probe drafts whole and its acceptance decides (end_call); controls come only where timed.
        self.drafts, self.paired = start != "plain", policy.timed and start in ("probe", "control")
        plain_first = self.paired and policy.plain_first(batch, context, sampled)
        self.drafting_phase = not plain_first
        # The share of the call's tokens after which the first phase ends (None: one phase).
        plain_share = PAIRED_MINORITY_SHARE if start == "control" else 1.0 - PAIRED_MINORITY_SHARE
        self.switch_share = (plain_share if plain_first else 1.0 - plain_share) if self.paired else None
        learnt = policy.learnt_timing.get(self.key, {})
        # {kind of round: its timed rounds, earlier calls' included} (tree against chain rounds); this call's alone.
        self.timing = {kind: replace(learnt.get(kind, RoundTimes())) for kind in ROUND_KINDS}
        self.call_timing = {"plain": RoundTimes(), "drafting": RoundTimes()}
        self._skip_timing = False
        # What drafting rounds take beyond the table's seconds of their drafting and verify (:class:`RoundOverhead`),
        # earlier calls' included; the harness sets the table's seconds of the round under way (a float, or a device
        # scalar read once the round is timed).
        self.overhead = replace(policy.learnt_overhead.get(self.key, RoundOverhead()))
        self.predicted_s: float | Tensor | None = None
        self.call_yield = CallYield()  # this call's drafting rounds (:meth:`HarnessPolicy.batch_yield_pays`)
        # The kind of the round under way: plain in a plain phase; P-EAGLE's drafting rounds set tree or chain.
        self.round_kind = "chain" if self.drafting_phase else "plain"

    def verify_seconds(self, slots: int) -> float:
        """The cost table's V[n] for trees of ``slots`` slots (at most the row's last node count)."""
        return self.verify_s[min(slots, len(self.verify_s) - 1)]

    @property
    def speculate(self) -> bool:
        """Whether rounds draft: the cost table's plan and earlier calls, then the paired calls' gains where they have
        decided, else the acceptance this call observed so far. A paired call drafts its drafting phase whole."""
        if not self.drafts:
            return False
        if self.paired:
            return True
        verdict = self.policy.paired_verdict(self.batch, self.context, self.sampled) if self.policy.timed else 0.0
        if verdict:
            return verdict > 0
        return self.policy.speculation_pays(self.batch, self.context, self.chain_acceptance, self.sampled)

    def switch(self, emitted_share: float) -> bool:
        """After a round of a paired call, with ``emitted_share`` of the call's most tokens emitted: True when its
        first phase ends here (once); the next round is then the other kind, and it is not timed."""
        if self.switch_share is None or emitted_share < self.switch_share:
            return False
        self.switch_share, self.drafting_phase, self._skip_timing = None, not self.drafting_phase, True
        self.round_kind = "chain" if self.drafting_phase else "plain"
        return True

    def timed(self, seconds: float, tokens: int, live: int | None = None) -> None:
        """The wall-clock seconds of the round that just ended (drafting, or not, to bookkeeping) and the tokens it
        emitted, counted by its kind (with the policy's ``timed`` only; a drafting round's table seconds, which the
        harness set in :attr:`predicted_s`, and tokens count into :attr:`call_yield` either way). ``live``: the
        requests it ran (default the call's batch); only rounds of the whole batch count towards a paired call's gain,
        since a round of fewer requests emits fewer tokens a second (its phase would look slower: the requests still
        running after a drafting phase, whose progress varies, would fall to the plain phase)."""
        predicted, self.predicted_s = self.predicted_s, None
        if predicted is not None:
            predicted = float(predicted)
            self.call_yield.add(tokens, predicted)
        if self._skip_timing:  # the first round after a switch: the drafter caught up on the plain rounds' tokens
            self._skip_timing = False
        elif self.policy.timed:
            self.timing[self.round_kind].add(seconds, tokens)
            if live is None or live == self.batch:
                self.call_timing["plain" if self.round_kind == "plain" else "drafting"].add(seconds, tokens)
            if predicted is not None:
                self.overhead.add(seconds, predicted)

    def finish(self) -> None:
        """Hands what this call observed to the policy (the next calls start from it)."""
        policy = self.policy
        if self.paired:
            plain, drafting = self.call_timing["plain"], self.call_timing["drafting"]
            policy.end_paired(self.batch, self.context, self.sampled, plain, drafting, self.chain_acceptance)
        else:
            policy.end_call(self.batch, self.context, self.chain_acceptance, self.sampled, self.call_yield)
        policy.learnt_timing[self.key] = self.timing
        policy.learnt_overhead[self.key] = self.overhead
