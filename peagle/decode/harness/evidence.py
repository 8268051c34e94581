"""What a generate call observes and the statistics the harness decides by: the per-position acceptance rate, the
timed rounds of each kind and their tokens per second with its error, the paired calls' gains, a round's overhead
beyond the cost table and a static batch's yield (the decisions themselves: :mod:`peagle.decode.harness.policy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from peagle.decode.harness.budget import verified_tree_counts

__all__ = [
    "EVIDENCE_Z",
    "MIN_PAIRED_ROUNDS",
    "PAIRED_MEMORY",
    "CallYield",
    "ChainAcceptance",
    "PairedGains",
    "RoundOverhead",
    "RoundTimes",
    "paired_gain",
]

# Stopping needs evidence: the observed acceptance rate, or drafting rounds' measured tokens per second, must lie below
# break-even (plain decoding's) by EVIDENCE_Z standard errors. Drafting a little below break-even costs little (there
# drafting and plain decoding are about as fast), but stopping where drafting pays loses its whole speed-up, for the
# rest of the call and for the next calls. (At the point estimate, one call of a hard prompt, or two plain rounds
# timed in a fast moment, stopped a drafter that ran 1.5x the target alone: the demo's harness ran at 0.65x of it.)
EVIDENCE_Z = 2.0
# A round's seconds are taken to vary by at least this share (this shared machine's noise, which rounds of equal
# length would hide from the spread of a few of them).
ROUND_TIME_CV = 0.2
# Paired calls (:class:`PairedGains`; how a paired call splits its tokens: :mod:`peagle.decode.harness.policy`): the
# rounds of each kind a call times before its gain counts (the first round after the switch is not timed: the drafter
# catches up on the plain rounds' tokens there, and the target's caches on its own work); the gains of the last
# PAIRED_MEMORY calls or so count. A call's gain varies from prompt to prompt (how often drafts are accepted) and with
# the machine's noise: by PAIR_CV before calls show their spread, a prior worth CALL_PRIOR calls (chain 5's gain over
# the target alone on the demo's 8 held-out prompts ran from -0.03 to +0.9: at 0.15, one control on its hardest prompt
# stopped drafting for the calls after it). (Comparing rounds of different calls, a control call timed in a fast moment
# put plain decoding 20% above what it ran at in the calls around it, and one drafting call on a hard prompt right after
# it stopped a drafter that ran 1.17x.)
MIN_PAIRED_ROUNDS = 8
PAIRED_MEMORY = 64
PAIR_CV = 0.3
CALL_PRIOR = 2.0
OVERHEAD_DECAY = 0.95  # weight of the past in :class:`RoundOverhead` (about the last 20 rounds)


class ChainAcceptance:
    """The per-position acceptance rate of verified rounds, accepted drafts over accepted drafts + rejections (prior
    0.7 over 2 trials): what sampled rounds size their chains by, since their depth is fixed before their draws, and
    what decides whether speculating pays at all (:meth:`HarnessPolicy.speculation_pays`)."""

    def __init__(self) -> None:
        self.accepted, self.trials = 0.0, 0.0

    def observe(
        self,
        num_accepted: Tensor,
        num_nodes: Tensor | None,
        parent: Tensor | None = None,
        accepted_path: Tensor | None = None,
        host: tuple[list[int], list[int]] | None = None,
    ) -> float:
        """Counts a round; returns its accepted drafts. A rejection is a request whose accepted path ends at a node with
        verified children (with the trees' ``parent`` and the ``accepted_path``; without them the trees are chains
        of ``num_nodes``: a path that ends before the last node), or that verified no draft (``num_nodes`` 1: it
        drafted and gained nothing, as a rejection of its first draft would). Chains with ``host`` (the requests'
        accepted drafts and node counts, already read back) are counted on the host; otherwise one host read."""
        if parent is not None and accepted_path is not None:
            accepted, rejections, _ = verified_tree_counts(parent, accepted_path, num_accepted, num_nodes)
        elif host is not None:
            accepted_host, nodes_host = host
            rejections = sum(1 for a, n in zip(accepted_host, nodes_host, strict=True) if a < n - 1 or n <= 1)
            accepted = sum(accepted_host)
        else:
            rejected = (num_accepted < num_nodes - 1) | (num_nodes <= 1)
            accepted, rejections = torch.stack([num_accepted.sum().double(), rejected.sum().double()]).tolist()
        self.count(accepted, rejections)
        return float(accepted)

    def count(self, accepted: float, rejections: float) -> None:
        """Adds a round's accepted drafts and rejections."""
        self.accepted += accepted
        self.trials += accepted + rejections

    def decay(self, weight: float) -> None:
        """Scales the counts: older observations weigh ``weight``."""
        self.accepted *= weight
        self.trials *= weight

    @property
    def rate(self) -> float:
        return (self.accepted + 1.4) / (self.trials + 2.0)

    @property
    def upper_rate(self) -> float:
        """The rate plus EVIDENCE_Z binomial standard errors: what the observations cannot rule out."""
        rate = self.rate
        return rate + EVIDENCE_Z * math.sqrt(rate * (1.0 - rate) / (self.trials + 2.0))


@dataclass
class RoundTimes:
    """The timed rounds of one kind: their count and the sums over them of seconds s, tokens emitted t and of s^2,
    t^2, s t, for the tokens per second T / S and its standard error."""

    seconds: float = 0.0
    rounds: int = 0
    tokens: float = 0.0
    seconds_sq: float = 0.0
    tokens_sq: float = 0.0
    cross: float = 0.0

    def add(self, seconds: float, tokens: float) -> None:
        self.seconds += seconds
        self.rounds += 1
        self.tokens += tokens
        self.seconds_sq += seconds * seconds
        self.tokens_sq += tokens * tokens
        self.cross += seconds * tokens

    def __add__(self, other: RoundTimes) -> RoundTimes:
        return RoundTimes(
            self.seconds + other.seconds,
            self.rounds + other.rounds,
            self.tokens + other.tokens,
            self.seconds_sq + other.seconds_sq,
            self.tokens_sq + other.tokens_sq,
            self.cross + other.cross,
        )

    @property
    def rate(self) -> float:
        """Tokens per second (0 before a round)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def rate_variance(self) -> float:
        """Variance of :attr:`rate`, a ratio estimator (delta method): sum over rounds of (t - rate s)^2 over S^2, times
        n / (n - 1); at least that of rounds whose seconds vary by ROUND_TIME_CV. Infinite below 2 rounds."""
        if self.rounds < 2 or self.seconds <= 0:
            return math.inf
        rate, n = self.rate, self.rounds
        residual = self.tokens_sq - 2.0 * rate * self.cross + rate * rate * self.seconds_sq
        spread = max(residual, 0.0) / (self.seconds * self.seconds) * n / (n - 1)
        return max(spread, (rate * ROUND_TIME_CV) ** 2 / n)


def paired_gain(plain: RoundTimes, drafting: RoundTimes) -> tuple[float, float] | None:
    """A paired call's gain, drafting rounds' tokens per second over its plain rounds' minus 1, and its variance from
    the two rates' (delta method); None below MIN_PAIRED_ROUNDS rounds of either kind."""
    if min(plain.rounds, drafting.rounds) < MIN_PAIRED_ROUNDS:
        return None
    ratio = drafting.rate / plain.rate
    variance = (drafting.rate_variance() + ratio * ratio * plain.rate_variance()) / (plain.rate * plain.rate)
    return ratio - 1.0, variance


@dataclass
class RoundOverhead:
    """The seconds a drafting round takes beyond what the cost table predicts for it (its pass and its verify): the
    drafter catching up on the accepted tokens, the tree's layout, the commit and the engine's bookkeeping, which the
    table's timed forwards leave out. A decayed mean of the rounds' residuals (measured minus predicted, the last
    1 / (1 - OVERHEAD_DECAY) rounds or so), never below 0: residuals below 0 come from a table profiled in a slower
    moment of the machine than now (it ran 1.6x faster on some days) and say nothing of a round's fixed cost, and a
    negative one would make a round look cheaper than its forwards alone. Added to every depth's pass time, it is
    the fixed cost of a round that the budget and depth decisions pay once per round (a round of more drafts spreads
    it over more tokens)."""

    residuals: float = 0.0  # decayed sum of measured - predicted seconds
    weight: float = 0.0  # decayed count of rounds

    def add(self, measured: float, predicted: float) -> None:
        self.residuals = OVERHEAD_DECAY * self.residuals + (measured - predicted)
        self.weight = OVERHEAD_DECAY * self.weight + 1.0

    @property
    def seconds(self) -> float:
        """The overhead estimate (0 before a round)."""
        return max(0.0, self.residuals / self.weight) if self.weight > 0 else 0.0


@dataclass
class CallYield:
    """The tokens a call's drafting rounds emitted and the cost table's seconds of those rounds (their pass and
    verify at the call's batch-size bucket): a static batch pays for every round until its slowest request is done,
    so at batch > 1 the tokens per table second of its rounds can fall below plain decoding's where the per-request
    acceptance rate says drafting pays (:meth:`HarnessPolicy.batch_yield_pays`)."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def decay(self, weight: float) -> None:
        self.tokens *= weight
        self.seconds *= weight


@dataclass
class PairedGains:
    """The gains of paired calls (:func:`paired_gain`) of one batch-size bucket, context interval and kind of round:
    decayed sums (the last PAIRED_MEMORY calls or so) of the calls, their gains, squared gains and own variances."""

    calls: float = 0.0
    total: float = 0.0
    squares: float = 0.0
    within: float = 0.0

    def add(self, gain: float, variance: float) -> None:
        keep = 1.0 - 1.0 / PAIRED_MEMORY
        self.calls = keep * self.calls + 1.0
        self.total = keep * self.total + gain
        self.squares = keep * self.squares + gain * gain
        self.within = keep * self.within + variance

    @property
    def mean(self) -> float:
        return self.total / self.calls if self.calls else 0.0

    def mean_variance(self) -> float:
        """Variance of :attr:`mean`: the calls' spread, shrunk towards PAIR_CV with the weight of CALL_PRIOR calls, or
        their own variances (their rounds' noise) if larger, over the number of calls. Infinite before a call."""
        if not self.calls:
            return math.inf
        spread = max(self.squares - self.total * self.total / self.calls, 0.0)
        between = (CALL_PRIOR * PAIR_CV**2 + spread) / (CALL_PRIOR + max(self.calls - 1.0, 0.0))
        return max(between, self.within / self.calls) / self.calls

    def verdict(self) -> float:
        """The mean gain beyond EVIDENCE_Z standard errors: > 0 where drafting is faster, < 0 where plain decoding
        is, 0 while undecided."""
        margin = EVIDENCE_Z * math.sqrt(self.mean_variance())
        return math.copysign(max(abs(self.mean) - margin, 0.0), self.mean) if math.isfinite(margin) else 0.0
