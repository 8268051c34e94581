"""The harness policy: how deep and how wide to draft, and how many nodes to verify, so that a round emits the most
tokens per second (derivation: ``csrc/include/peagle/harness.h``).

With E the expected accepted drafts of the verified tree, T_draft the drafting time and V[n] the target's verify time
for n nodes (root included, from the cost table row of the batch-size bucket and context interval), a round emits
(1 + E) tokens in T_draft + V[n] seconds. Every decision maximises that ratio:

* **Expected acceptance.** E = sum over the verified drafted nodes of min(1, c * p). For autoregressive drafters p
  is the path score (product of the draft probabilities along the path), c a per-request calibration scale fitted
  online: ``calibration[b] =
  (observed, predicted)`` are decayed sums of the accepted drafts and of the predicted E of the verified trees, and
  c = clamp((observed + 2) / (predicted + 2), 1/8, 4) (:func:`recalibrate`). Before that, path scores are
  raised to a per-request exponent gamma (:func:`sharpen`), which recalibrates every edge probability of a path at
  once (p^gamma of a product is the product of the edges' p^gamma); gamma follows the same sums, slowly
  (:func:`recalibrate`), so a drafter whose probabilities are far too flat (right 90% of the time at p = 0.01)
  or too sharp still gets depths and budgets that match its real acceptance; c then corrects what remains. A
  P-EAGLE pass's per-depth distributions are marginals, so its p multiplies edges of another kind: there p is the
  product of the path's edges, each calibrated by its kind (first or later child, bin of its draft probability) in a
  table every call of the drafter learns (:mod:`peagle.decode.harness.calibration`), and c follows how hard the
  request's text is right now (sums decaying by :data:`PATH_SCALE_DECAY`); its candidate trees hold
  :data:`CANDIDATES_PER_VERIFIED` times the nodes a round may verify, so that deep chain nodes are candidates.
* **Depth by depth (autoregressive drafters).** At each depth the candidates are the children of the frontier; the
  ``harness_decide`` op adds the best w of them for the w of the cost table's widths that maximises the ratio after
  paying that depth's drafter forward t_d(w) and the larger verify, and stops a request when no w raises its ratio;
  go = some request continues. :class:`DepthStepper` runs that loop as per-depth step functions over buffers
  preallocated per padded batch size (:class:`DepthRound`): CUDA graphs chained on the device on a GPU, a host loop on
  the CPU.
* **Verify budget.** :func:`harness_budget`: the best n nodes by path score (parent-closed: scores never grow along a
  path and ties go to the smaller index) with n maximising (1 + S_(n-1)) / (T_draft + V[n]).
* **P-EAGLE.** One pass drafts K depths at cost pass(K); the budget is chosen over the parallel candidate tree as
  above (at least one draft, so that the calibration keeps learning), and the next round's K is the K' whose ratio on
  this round's tree (nodes deeper than K' dropped, cost pass(K')) is best, one more when that is the drafted depth and
  the budget used it, one less at most (:func:`pass_budget`): shallow rounds stop paying for depths they do not use,
  and one round's luck does not cap the next. A tree plan drafts
  chains while what its trees gained over chains (accepted drafts off the top-1 chain, observed) does not pay for
  the time tree rounds took beyond chain rounds (measured wall clock once both were timed) at a chain round's tokens
  per second (every 8th to 64th round explores a tree).
* **Round overhead.** A round takes longer than the table's seconds of its drafting and verify (the drafter catching
  up on the accepted tokens, the tree's layout, the commit, the engine's bookkeeping): timed rounds learn that
  difference (:class:`RoundOverhead`), and every decision pays it once per round, as part of T_draft, so a round of
  more drafts spreads it over more tokens (the plan's tree-or-chain rule below counts it as well). Chain widths and
  the break-even rate leave it out: plain rounds have bookkeeping of their own, and the paired calls weigh the two.
* **Batch size.** :meth:`HarnessPolicy.plan`: at batch sizes whose verify cost grows slowly with the node count the
  candidates form a dynamic tree (top-k children per depth); where it grows fast, a chain (one child per depth) whose
  length the budget still chooses per request; :meth:`HarnessPolicy.chain_widths` is the per-bucket table of the best
  chain length at a given acceptance rate, and a bucket whose best length is 0 decodes without speculation. Once a
  generate call has observed :data:`MIN_TRIALS` drafts and rejections, it also stops drafting for the rest of the call
  when the observed per-position acceptance rate lies below the cost table's break-even rate, the rate below which no
  chain length emits more tokens per second than plain decoding (:meth:`HarnessPolicy.speculation_pays`), by
  :data:`EVIDENCE_Z` standard errors, since near break-even drafting costs little and stopping a drafter that pays costs
  its whole speed-up. At batch > 1 a call's verdict for the next calls also needs its drafting rounds to emit at least
  plain decoding's tokens per table second (:class:`CallYield`): a static batch pays for rounds until its slowest
  request is done, which the per-request rate does not see. The wall clock decides in **paired calls**, which count what
  the table leaves out (bookkeeping, commits): now and then a generate call drafts for part of its tokens and decodes
  plainly for the rest (a quarter of them the kind the verdict so far says is slower; plain first or drafting first,
  in turn), and its gain, its drafting rounds' tokens per second over its plain rounds' minus 1, compares the two on
  the same prompt at the same moment (:class:`PairedGains` pools the gains of the calls so far). Comparing rounds of
  different calls instead mixes the machine's drift between calls (+-20% here) and the prompts' difficulty into the
  comparison. While speculating pays, the 2nd call is paired, then every 2nd while the gains lean towards plain
  decoding, intervals that double up to 32 calls while they lean towards drafting (a "control"). Once they say plain
  decoding is faster, or, where they have not decided, the acceptance of the calls so far does (the earlier ones
  weighing less, :data:`CALL_DECAY`), the next calls at that batch size decode plainly,
  except paired calls (a "probe"): the 2nd call after, then intervals that double up to 32 calls while they find the
  same; only gains that say drafting is faster clear the verdict (:meth:`HarnessPolicy.start_call`).
* **Temperature > 0.** Sampled rounds (drafts drawn) draft chains, P-EAGLE's as EAGLE-3's, whose length is fixed
  after the previous round, before this round's draws, so verification stays lossless: the chain length of the cost
  table at the per-position acceptance rate observed so far (:class:`ChainAcceptance`). Path scores of the drafter's
  unperturbed distributions predict the acceptance of drawn drafts poorly: on the demo target at temperature 1 the
  harness's sampled trees ran at 0.81x-0.83x the best fixed chain, these chains at 0.92x.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from peagle.decode.harness.calibration import EdgeCalibration
from peagle.decode.harness.cost import CostTable
from peagle.decode.harness.graphs import DepthGraphChain, device_launch_available, padded_batch_size
from peagle.ops import (
    HarnessState,
    TreeSpec,
    calibration_scale,
    harness_decide,
    harness_observe,
    harness_pass_decide,
    tree_select,
)
from peagle.ops.harness import best_candidates, budget_ratios

__all__ = [
    "CALIBRATION_DECAY",
    "EVIDENCE_Z",
    "MIN_TRIALS",
    "CallHarness",
    "CallYield",
    "ChainAcceptance",
    "DepthHarness",
    "DepthRound",
    "DepthStepper",
    "HarnessPolicy",
    "PairedGains",
    "PassHarness",
    "Plan",
    "RoundOverhead",
    "RoundTimes",
    "SpeculationRecord",
    "TreeLearning",
    "harness_budget",
    "kept_first",
    "paired_gain",
    "pass_budget",
    "predicted_acceptance",
    "recalibrate",
    "select_budget",
    "select_candidates",
    "select_widest",
    "sharpen",
    "tree_width",
    "verified_tree_counts",
    "widest",
]

# Rejections and accepted drafts a generate call observes before the harness may stop speculating for the rest of it.
MIN_TRIALS = 32
# Stopping needs evidence: the observed acceptance rate, or drafting rounds' measured tokens per second, must lie below
# break-even (plain decoding's) by EVIDENCE_Z standard errors. Drafting a little below break-even costs little (there
# drafting and plain decoding are about as fast), but stopping where drafting pays loses its whole speed-up, for the
# rest of the call and for the next calls. (At the point estimate, one call of a hard prompt, or two plain rounds
# timed in a fast moment, stopped a drafter that ran 1.5x the target alone: the demo's harness ran at 0.65x of it.)
EVIDENCE_Z = 2.0
# A round's seconds are taken to vary by at least this share (this shared machine's noise, which rounds of equal
# length would hide from the spread of a few of them).
ROUND_TIME_CV = 0.2
# Paired calls (:class:`PairedGains`): the share of a paired call's tokens decoded the way that the verdict so far
# says is slower (plainly in a control, drafting in a probe: the cost of a paired call is that share at the slower
# speed; at a third, controls on the demo's easy prompts ran at 0.6x of chain 5 and probes at batch 16 at 0.6x-0.85x
# of the target alone); the rounds of each kind a call times before its gain counts (the first round after the
# switch is not timed: the drafter catches up on the plain rounds' tokens there, and the target's caches on its own
# work); the gains of the last PAIRED_MEMORY calls or so count. A call's gain varies from prompt to prompt (how often
# drafts are accepted) and with the machine's noise: by PAIR_CV before calls show their spread, a prior worth
# CALL_PRIOR calls (chain 5's gain over the target alone on the demo's 8 held-out prompts ran from -0.03 to +0.9: at
# 0.15, one control on its hardest prompt stopped drafting for the calls after it). (Comparing rounds of different
# calls, a control call timed in a fast moment put plain decoding 20% above what it ran at in the calls around it, and
# one drafting call on a hard prompt right after it stopped a drafter that ran 1.17x.)
PAIRED_MINORITY_SHARE = 0.25
MIN_PAIRED_ROUNDS = 8
PAIRED_MEMORY = 64
PAIR_CV = 0.3
CALL_PRIOR = 2.0
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
CALIBRATION_DECAY = 0.9  # weight of the past in the observed / predicted sums (about the last 10 rounds)
# ... of the P-EAGLE harness's per-request scale of its edge-calibrated path scores (about the last 2 rounds: the
# shared edge table knows the drafter, the scale follows how hard the request's text is right now; on the demo's
# recorded trees 0.3-0.5 did best, 0.9 lost 1%, and in the simulation 0.9 lost up to 4% to 0.5).
PATH_SCALE_DECAY = 0.5
CANDIDATES_PER_VERIFIED = 2  # a P-EAGLE candidate tree's nodes per node a round may verify
SHARPNESS_RANGE = (0.02, 1.5)  # bounds of the exponent gamma of the path scores
OVERHEAD_DECAY = 0.95  # weight of the past in :class:`RoundOverhead` (about the last 20 rounds)


def sharpen(scores: Tensor, gamma: Tensor) -> Tensor:
    """Path scores p -> p^gamma per request (gamma [B]); padding (p <= 0) is kept. A path score is a product of edge
    probabilities and so is p^gamma (of the edges' p^gamma): the exponent recalibrates every edge at once, which a
    scale of the path cannot do for a drafter whose probabilities are far too flat or too sharp."""
    scores = scores.double()
    return torch.where(scores > 0, scores.clamp(min=1e-300).pow(gamma[:, None]), scores)


def harness_budget(scores: Tensor, calibration: Tensor, draft_time: Tensor | float, verify_cost: Tensor) -> Tensor:
    """Verify budget per request: n nodes (root included) maximising (1 + S_(n-1)) / (T_draft + V[n]).

    Args:
        scores: [B, M] float64 path scores of the drafted candidates (root excluded), < 0 = padding, any order.
        calibration: [B, 2] float64 (observed, predicted) sums.
        draft_time: seconds spent drafting ([B] or one float).
        verify_cost: [Nmax + 1] float64, V[n] for n nodes.

    Returns:
        [B] int64 budgets in [1, min(Nmax, 1 + valid candidates)]; ties go to the smaller budget.
    """
    return budget_ratios(scores, calibration, draft_time, verify_cost).argmax(1) + 1


def pass_budget(
    spec: TreeSpec, calibration: Tensor, pass_time: Tensor, depth: int, verify_cost: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """P-EAGLE: the verify budget of this round's candidate tree and the pass depth K for the next round.

    ``spec`` is the candidate tree of a pass that drafted ``depth`` depths at ``pass_time[depth - 1]`` seconds; the
    budget is :func:`harness_budget` over its nodes. Each K' in 1 .. ``depth`` is scored by the best ratio this tree
    would have given had the pass drafted K' depths (deeper nodes dropped, cost ``pass_time[K' - 1]``); the best K' is
    the next depth, or ``depth + 1`` (up to ``len(pass_time)``) when the best is ``depth`` and the budget reaches it:
    the tree cannot show what a deeper pass would gain, so the harness tries it; never below ``depth - 1`` (one
    round's tree is a noisy sample of the drafter's level, a depth more costs a pass little and a pass too shallow
    caps the next round's acceptance: on the simulation's traces, a fall to the single round's best K' lost up to 9%
    to a depth that falls by one a round). Returns (budget, next depth, the
    budget's predicted accepted drafts), [B] each: the ``harness_pass_decide`` op, one call per round (its reference,
    ``harness_pass_decide_reference``, is the same decision in PyTorch).
    """
    return harness_pass_decide(
        spec.scores.double(), spec.depth, spec.num_nodes, calibration.double(), pass_time, verify_cost, depth
    )


def select_budget(spec: TreeSpec, budget: Tensor, max_nodes: int) -> TreeSpec:
    """Keeps the best ``budget[b]`` nodes of request b's tree (root included, at most ``max_nodes``), as a tree."""
    index = torch.arange(spec.tokens.shape[1], device=spec.tokens.device)
    valid = index[None, :] < spec.num_nodes[:, None]
    return select_candidates(spec.tokens, spec.parent, spec.scores, valid, budget, max_nodes)


def select_candidates(
    tokens: Tensor, parent: Tensor, scores: Tensor, valid: Tensor, budget: Tensor, max_nodes: int
) -> TreeSpec:
    """The best ``budget[b]`` of the valid candidates (candidate 0 = the root, parents before children, scores never
    growing along a path) as a tree: :func:`kept_first` moves them to the front and :func:`tree_select` lays them
    out."""
    tokens, parent, scores, count = kept_first(tokens, parent, scores, valid, budget)
    return tree_select(tokens, parent, scores, count, tree_width(count, tokens.shape[1], max_nodes))


def select_widest(spec: TreeSpec, use: Tensor, max_nodes: int) -> TreeSpec:
    """:func:`select_budget` of budgets :func:`widest` made: request b keeps its best min(W, candidates) nodes, W the
    widest budget. On the CPU, where :func:`tree_width` reads W on the host, that is what one :func:`tree_select` of
    width W over all the candidates keeps (about 15 fewer small ops a round); on a GPU, W stays on the device and
    :func:`kept_first` moves each request's budget to the front first."""
    if use.device.type != "cpu":
        return select_budget(spec, use, max_nodes)
    width = tree_width(use, spec.tokens.shape[1], max_nodes)
    return tree_select(spec.tokens, spec.parent, spec.scores, spec.num_nodes, width)


def widest(budget: Tensor, available: Tensor) -> Tensor:
    """Every request's budget widened to the widest request's (at most its ``available`` nodes): the target verifies
    as many slots for every request as for the widest, padding included, so nodes up to that many cost nothing
    more. Device work only. Budgets are at most their ``available`` nodes, so one request's is its own."""
    return budget if budget.shape[0] == 1 else torch.minimum(budget.max(), available)


def tree_width(count: Tensor, candidates: int, max_nodes: int) -> int:
    """Slots of a verified tree of ``count[b]`` nodes per request: as many as its largest request, not ``max_nodes``
    (the target verifies every slot, padding included). The host read that finds it is free on the CPU; on a GPU the
    candidates' width bounds it without one."""
    width = min(max_nodes, candidates)
    return min(width, max(count.tolist(), default=1)) if count.device.type == "cpu" else width


def kept_first(
    tokens: Tensor, parent: Tensor, scores: Tensor, valid: Tensor, budget: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The best ``budget[b]`` valid candidates moved to the front in their order (so parents still come first, parent
    indices remapped): (tokens, parent, float64 scores, count), the arguments of :func:`tree_select`. Device work
    only (a CUDA graph can capture it)."""
    batch, nodes = tokens.shape
    index = torch.arange(nodes, device=tokens.device).expand(batch, nodes)
    keep = best_candidates(scores, valid, budget)
    perm = torch.sort((~keep).long(), dim=1, stable=True).indices
    inverse = torch.empty_like(perm).scatter_(1, perm, index)
    parent = parent.gather(1, perm)
    parent = torch.where(parent >= 0, inverse.gather(1, parent.clamp(min=0)), -1)
    count = keep.sum(1).clamp(min=1)
    return tokens.gather(1, perm), parent, scores.gather(1, perm).double(), count


def recalibrate(calibration: Tensor, gamma: Tensor, predicted: Tensor, rows: Tensor, accepted: Tensor) -> None:
    """Folds the verified acceptance of ``rows`` (distinct) into their calibration sums and sharpness exponents, in
    place: the sums decay by :data:`CALIBRATION_DECAY` and add the round, and gamma moves toward agreement of the two
    sums within :data:`SHARPNESS_RANGE` (the ``harness_observe`` op, one call per round)."""
    harness_observe(calibration, gamma, predicted, accepted, rows, CALIBRATION_DECAY, SHARPNESS_RANGE)


def predicted_acceptance(spec: TreeSpec, calibration: Tensor) -> Tensor:
    """E of built trees: sum over their drafted nodes of min(1, c * p), [B] float64."""
    scale = calibration_scale(calibration.double())
    index = torch.arange(spec.scores.shape[1], device=spec.scores.device)
    drafted = (index > 0) & (index < spec.num_nodes[:, None])
    return torch.where(drafted, torch.clamp(scale[:, None] * spec.scores, max=1.0), 0.0).sum(1)


def verified_tree_counts(
    parent: Tensor, accepted_path: Tensor, num_accepted: Tensor, num_nodes: Tensor | None = None
) -> tuple[int, int, int]:
    """(accepted drafts, rejections, accepted drafts off the top-1 chain) of a round's verified trees, counted on the
    host after one read of ``parent`` [B, N], ``accepted_path`` [B, L] (node indices from the root, -1 padded) and
    ``num_accepted`` [B] (the round's read-back is about as many bytes, and Python over a few dozen ints costs less
    than the ~20 small ops that count them on the device).

    A rejection is a request whose accepted path ends at a node with verified children, or that verified no draft
    (``num_nodes`` 1). The top-1 chain follows each node's first child (smallest index: siblings are laid out best
    first); the drafts accepted from the first one off it on are what a chain would not have accepted."""
    nodes = parent.shape[1]
    columns = [parent, accepted_path, num_accepted[:, None]]
    if num_nodes is not None:
        columns.append(num_nodes[:, None])
    accepted = rejections = off_chain = 0
    for row in torch.cat([c.long() for c in columns], 1).tolist():
        parents, path, m = row[:nodes], row[nodes : nodes + accepted_path.shape[1]], row[nodes + accepted_path.shape[1]]
        first_child: dict[int, int] = {}
        for node, up in enumerate(parents):
            if up >= 0:
                first_child.setdefault(up, node)
        accepted += m
        rejections += path[m] in first_child or (num_nodes is not None and row[-1] <= 1)
        left = False
        for node in path[1 : m + 1]:
            left = left or first_child[parents[node]] != node
            off_chain += left
    return accepted, rejections, off_chain


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


class PassHarness(CallHarness):
    """The P-EAGLE harness over one generate call: per-request calibration, the next pass's depth K and the budgets.

    Per round: :meth:`select` turns the pass's candidate tree (``topk`` children per node at every depth, at most
    ``max_nodes`` kept by score) into the verified tree, and :meth:`observe` folds the verified acceptance into the
    calibration. Sampled rounds draft a chain whose length :meth:`observe` fixed after the previous round, from the
    observed acceptance rate (see the module doc), and verify it whole.
    """

    def __init__(
        self,
        policy: HarnessPolicy,
        batch: int,
        max_depth: int,
        context: int,
        draft_vocab: int,
        device,
        sampled: bool = False,
    ) -> None:
        super().__init__(policy, batch, context, sampled)
        table = policy.table
        self.draft_vocab, self.max_depth = draft_vocab, max_depth
        self.pass_time = torch.tensor(
            [table.pass_time(batch, k) for k in range(1, max_depth + 1)], dtype=torch.float64, device=device
        )
        self.verify_cost = self.plan.verify_cost.to(device)
        # What an edge of a candidate tree is worth (:mod:`peagle.decode.harness.calibration`), learnt by earlier calls,
        # and per request the op's scale of those path scores (decayed sums of accepted and predicted drafts, from 0:
        # how hard this request's text is, which the shared edge table learns too slowly).
        self.edges = policy.learnt_edges.to(device)
        self.calibration = torch.zeros(batch, 2, dtype=torch.float64, device=device)
        # (q, kind, path) of the nodes of the trees under verification (EdgeCalibration.scores).
        self.verified: tuple[Tensor, Tensor, Tensor] | None = None
        self._index_cache: dict[torch.Size, Tensor] = {}
        # The candidate tree keeps the best nodes by raw path score before the edge calibration scores them: at the
        # verify limit itself, a flat drafter's deep chain nodes lose their places to shallow siblings (on the demo's
        # recorded trees, budgets from 32 candidates emitted 3.5% fewer tokens per second than from 64 or all 124).
        self.candidates = CANDIDATES_PER_VERIFIED * self.max_nodes
        self.next_depth = torch.full((batch,), max_depth, dtype=torch.long, device=device)
        learnt = policy.learnt_trees.get(self.key, TreeLearning())
        # What tree rounds gained over chains: accepted drafts from where a path left the top-1 chain on, and the
        # verify seconds their trees cost beyond a chain of the pass depth (:meth:`topk`).
        self.siblings = list(learnt.siblings)
        # Tokens emitted and batched rounds (greedy), from earlier calls on: the first rounds of a generation alone
        # would understate a chain round's tokens per second.
        self.emitted = list(learnt.emitted)
        self.pass_s = self.pass_time.tolist()  # host copy
        self.explore_every, self.since_tree = learnt.explore_every, 0
        self.chain_round = False  # this round's candidates form a chain (set by topk)
        self.exploring = False  # ... or a tree drafted only to look for accepted drafts off the chain

    def depth(self, rows: Tensor) -> int:
        """The pass depth K of a round of ``rows`` (the deepest any of them wants; one host read)."""
        return max(self._of(rows, self.next_depth).tolist())

    def _of(self, rows: Tensor, values: Tensor) -> Tensor:
        """``values[rows]``: the per-request tensor itself when ``rows`` holds every request (ascending, distinct:
        then it is arange(batch)), which spares a batch-1 round its gathers."""
        return values if rows.numel() == values.shape[0] else values[rows]

    def _set(self, rows: Tensor, name: str, new: Tensor) -> None:
        """Per-request tensor ``name``: ``[rows] = new`` in place, or ``new`` itself when ``rows`` holds every request
        (no copy)."""
        values = getattr(self, name)
        if rows.numel() == values.shape[0]:
            setattr(self, name, new)
        else:
            values[rows] = new

    def topk(self, depth: int, sampled: bool = False) -> list[int]:
        """Children per candidate node: the plan's top-k at the root, then 2 (a tree) or 1 (a chain) per depth; a
        chain when the round's drafts are ``sampled``.

        A tree plan drafts trees while what they gained pays for what they cost: the accepted drafts from where a
        path left the top-1 chain on (plus a prior of one), per second that tree rounds took beyond chain rounds,
        must beat the tokens per second of a chain round (the tokens per round observed so far, earlier calls
        included, over a chain round's seconds). Once both kinds of round have been timed (:meth:`timed`), those
        seconds are the measured ones, every cost of a round included (a tree's wider pass, its layout and
        bookkeeping, not only its verify); before that, the cost table's verify time of the trees beyond chains of the
        same pass depth and its time of a chain round. Budgets come from calibrated path scores, and a drafter whose
        siblings score far above how often they are accepted would otherwise verify wide trees for nothing.
        While trees pay, a chain round is drafted whenever fewer than 1 in EXPLORE_EVERY of the timed rounds were
        chains, so that both kinds are timed (never where no round is timed: the simulation). Otherwise it
        drafts chains, and every ``explore_every``-th round still drafts the tree, so a change is noticed; that
        interval starts at EXPLORE_EVERY, doubles after each exploring round whose accepted drafts all
        stayed on the chain (up to MAX_EXPLORE_EVERY) and starts over when one left it (:meth:`observe`)."""
        self.sampled = sampled
        if sampled:
            self.chain_round, self.exploring, self.round_kind = True, False, "chain"
            return [1] * depth
        self.since_tree += 1
        gain, cost = self.siblings
        tokens, rounds = self.emitted
        tree_times, chain_times = self.timing["tree"], self.timing["chain"]
        chain_round_s = self._chain_seconds(depth)
        if tree_times.rounds and chain_times.rounds:
            chain_round_s = chain_times.seconds / chain_times.rounds
            cost = max(0.0, tree_times.seconds - tree_times.rounds * chain_round_s)
        chain_rate = (tokens / rounds if rounds else 1.0 + depth) / chain_round_s
        on_chain = (gain + 1.0) < chain_rate * cost
        if on_chain:
            chain = self.since_tree < self.explore_every
        else:  # timed chain rounds are kept at 1 in EXPLORE_EVERY timed rounds, so both kinds' times stay known
            chain = chain_times.rounds * EXPLORE_EVERY < tree_times.rounds
        self.exploring = on_chain and not chain
        if not chain:
            self.since_tree = 0
        top = 1 if chain else self.plan.topk
        deeper = min(2, top)
        self.chain_round = top == 1 or self.draft_vocab == 1 or depth == 0
        self.round_kind = "chain" if self.chain_round else "tree"
        return [min(k, self.draft_vocab) for k in [top] + [deeper] * (depth - 1)]

    def _chain_seconds(self, depth: int) -> float:
        """The cost table's seconds of a round that drafts and verifies a chain of ``depth``."""
        return self._round_seconds(depth, depth + 1)

    def _round_seconds(self, depth: int, width: int) -> float:
        """The cost table's seconds of a round whose pass drafted ``depth`` depths and whose trees have ``width``
        slots."""
        return self.pass_s[max(depth, 1) - 1] + self.verify_seconds(width)

    def select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec:
        tree = self._select(rows, spec, depth, sampled)
        self.predicted_s = self._round_seconds(depth, tree.tokens.shape[1])
        return tree

    def _select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec:
        self.verified = None
        if sampled:  # a chain whose length, fixed after the previous round, is the pass depth: verify it whole
            width = tree_width(spec.num_nodes, spec.tokens.shape[1], self.max_nodes)
            return tree_select(spec.tokens, spec.parent, spec.scores, spec.num_nodes, width)
        scores, q, kind = self.edges.scores(spec)
        overhead = self.overhead.seconds  # paid once per round, whatever its depth: part of every depth's pass time
        pass_time = self.pass_time + overhead if overhead > 0 else self.pass_time
        calibration = self._of(rows, self.calibration)
        budget, next_depth, _ = harness_pass_decide(
            scores, spec.depth, spec.num_nodes, calibration, pass_time, self.verify_cost, depth
        )
        # At least one draft: a round that verifies none teaches the calibration nothing.
        floored = torch.maximum(budget, torch.clamp(spec.num_nodes, max=2))
        use = widest(floored, spec.num_nodes)  # every request verifies up to the widest budget of its best nodes
        # Selected with each candidate's index for a token, so that the verified nodes' own tokens, q and kinds follow.
        numbered = spec._replace(tokens=self._candidate_index(spec.tokens), scores=scores)
        if self.chain_round:  # a chain's best n nodes are its first n: tree_select lays them out as they are
            width = tree_width(use, spec.tokens.shape[1], self.max_nodes)
            tree = tree_select(numbered.tokens, spec.parent, scores, use, width)
        else:
            tree = select_widest(numbered, use, self.max_nodes)
            # The target verifies every slot: what this tree costs beyond a chain of the pass depth.
            self.siblings[1] += max(0.0, self.verify_seconds(tree.tokens.shape[1]) - self.verify_seconds(depth + 1))
        source = tree.tokens.clamp(min=0)
        drafted = tree.tokens > 0  # the root is candidate 0, padding -1
        self.verified = (q.gather(1, source), torch.where(drafted, kind.gather(1, source), -1), tree.scores)
        self._set(rows, "next_depth", next_depth)
        return tree._replace(tokens=torch.where(drafted, spec.tokens.gather(1, source), -1))

    def _candidate_index(self, tokens: Tensor) -> Tensor:
        """[B, N] each candidate's index (kept per shape: the rounds of a call repeat few shapes)."""
        index = self._index_cache.get(tokens.shape)
        if index is None:
            index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()
            self._index_cache[tokens.shape] = index
        return index

    def observe(
        self,
        rows: Tensor,
        num_accepted: Tensor,
        num_nodes: Tensor | None = None,
        parent: Tensor | None = None,
        accepted_path: Tensor | None = None,
        host: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Folds the verified acceptance of ``rows`` into the edge calibration (given the verified trees' ``parent``
        and the ``accepted_path``); after a tree round, also counts what the tree gained over a chain (the accepted
        drafts from the first one that was not its parent's first child on). After a sampled round: only the chain
        acceptance rate, and the next chain length from it. Every round with ``num_nodes`` or the trees also counts
        into the acceptance rate that decides whether speculating still pays. ``host``: the requests' accepted drafts
        and verified node counts as the engine read them back (chain rounds then count on the host)."""
        tree_known = parent is not None and accepted_path is not None
        gained = 0
        if host is not None and self.chain_round:
            accepted = self.chain_acceptance.observe(num_accepted, num_nodes, host=host)
        elif tree_known:
            accepted, rejections, gained = verified_tree_counts(parent, accepted_path, num_accepted, num_nodes)
            self.chain_acceptance.count(accepted, rejections)
        elif num_nodes is not None:
            accepted = self.chain_acceptance.observe(num_accepted, num_nodes)
        else:
            accepted = float(num_accepted.sum())
        if self.sampled:
            rate = self.chain_acceptance.rate
            length = self.policy.chain_length(self.batch, self.context, rate, sampled=True)
            self.next_depth.fill_(min(max(1, length), self.max_depth))
            return
        self.emitted[0] += accepted + rows.numel()
        self.emitted[1] += 1
        if tree_known and not self.chain_round:  # a chain would have stopped where the path left it
            self.siblings[0] += gained
            if self.exploring:
                found = gained > 0
                self.explore_every = EXPLORE_EVERY if found else min(2 * self.explore_every, MAX_EXPLORE_EVERY)
        if self.verified is not None and tree_known:
            if parent.shape != self.verified[1].shape:
                raise ValueError(
                    f"PassHarness.observe: parent must be that of the trees select returned, [B, N] = "
                    f"{list(self.verified[1].shape)}, got {list(parent.shape)}"
                )
            self.edges.observe(
                self.calibration, self.verified, parent, accepted_path, num_accepted, rows, PATH_SCALE_DECAY
            )

    def finish(self) -> None:
        """Hands what this call learnt to the policy (the next call starts from it)."""
        super().finish()
        self.policy.learnt_edges = self.edges.to("cpu")
        self.policy.learnt_trees[self.key] = TreeLearning(tuple(self.siblings), tuple(self.emitted), self.explore_every)


class DepthStepper:
    """A round's depth steps and finalize run through a :class:`~peagle.decode.harness.graphs.DepthGraphChain`.

    ``steps[d]`` drafts depth d and ends with :func:`harness_decide` writing ``go``; ``finalize`` runs after the last
    depth that ran. The steps read and write only buffers that outlive the stepper (a :class:`DepthRound` and the
    drafter's round buffers, reset in place before each :meth:`run`) and never read the device from the host, so the
    same callables are captured as CUDA graphs chained by device tail launch (``mode="auto"`` on a GPU: capture here,
    replay every round) or called in the chain's host loop (the CPU; a GPU without device graph launch). A capture
    that fails falls back to the host loop, with the reason in :attr:`fallback`.
    """

    def __init__(self, steps: list[Callable[[], None]], finalize: Callable[[], None], go: Tensor, mode: str = "auto"):
        self.fallback = ""
        if mode == "auto" and go.device.type == "cuda" and not device_launch_available(go.device):
            self.fallback = "device graph launch unavailable (CPU build of peagle, PEAGLE_NO_DLINK=1 or an old torch)"
        try:
            self.chain = DepthGraphChain(steps, finalize, go, mode=mode)
        except RuntimeError as error:  # e.g. a step that synchronises cannot be captured
            if mode != "auto" or go.device.type != "cuda":
                raise
            self.fallback = f"capture failed: {error}".splitlines()[0]
            self.chain = DepthGraphChain(steps, finalize, go, mode="host")

    @property
    def mode(self) -> str:
        """``"device"``, ``"host_graphs"`` or ``"host"`` (see :class:`DepthGraphChain`)."""
        return self.chain.mode

    def run(self) -> None:
        """Runs one round; on ``"device"`` it only launches it (no synchronisation)."""
        self.chain.run()

    def check(self) -> None:
        """Raises if a device tail launch failed (reads the chain's status: call it where the host waits anyway)."""
        self.chain.check()

    def close(self) -> None:
        self.chain.close()


class DepthRound:
    """The harness's state of one round at one padded batch size, in buffers reset in place by :meth:`reset`.

    Rows past the round's requests are padding: they repeat the first request's row (harmless device work) and start
    stopped, so :func:`harness_decide` gives them width 0 and they never keep ``go`` up. :meth:`decide` and
    :meth:`select` read only these buffers and the harness's per-call tensors (device work, no host reads), so a CUDA
    graph captures them once per padded batch size.
    """

    def __init__(self, harness: DepthHarness, padded: int) -> None:
        device = harness.device
        self.harness, self.padded, self.count = harness, padded, 0
        self.rows = torch.zeros(padded, dtype=torch.long, device=device)  # request of each row
        self.gamma = torch.ones(padded, dtype=torch.float64, device=device)
        self.calibration = torch.zeros(padded, 2, dtype=torch.float64, device=device)
        self.state = HarnessState.start(padded, device, harness.root_cost)
        self.overhead = 0.0  # the harness's overhead estimate when the round started (in state.draft_time)
        self._index = torch.arange(padded, device=device)

    def reset(self, rows: Tensor) -> None:
        """Starts a round of ``rows`` (request indices, at most ``padded``): the root alone, the root pass spent."""
        count = rows.numel()
        if not 1 <= count <= self.padded:
            raise ValueError(f"rows must hold 1 to {self.padded} requests, got {count}")
        self.count = count
        self.rows[:count].copy_(rows)
        self.rows[count:].copy_(rows[:1].expand(self.padded - count))
        torch.index_select(self.harness.gamma, 0, self.rows, out=self.gamma)
        torch.index_select(self.harness.calibration, 0, self.rows, out=self.calibration)
        state = self.state
        state.expected.zero_()
        # The round's fixed cost beyond the table's, paid once whatever its depths and budget: part of every ratio.
        self.overhead = self.harness.overhead.seconds
        state.draft_time.fill_(self.harness.root_cost + self.overhead)
        state.num_nodes.fill_(1)
        state.width.zero_()
        state.stop.copy_(self._index >= count)
        state.go.fill_(1)

    def decide(self, candidate_scores: Tensor, depth: int) -> None:
        """:func:`harness_decide` for the candidates of ``depth`` (path scores [padded, F], -inf = padding)."""
        harness = self.harness
        cost = harness.draft_cost[min(depth, len(harness.draft_cost)) - 1]
        scores = sharpen(candidate_scores, self.gamma).contiguous()
        harness_decide(scores, self.calibration, harness.widths, cost, harness.verify_cost, self.state)

    def select(
        self, tokens: Tensor, parent: Tensor, scores: Tensor, chosen: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The verify budget of the chosen candidates (root first; ``scores`` 0 where not chosen): the kept ones first
        (:func:`kept_first`), for :meth:`tree`."""
        scores = sharpen(scores, self.gamma)
        drafted = torch.where(chosen, scores, -1.0)[:, 1:]
        budget = harness_budget(drafted, self.calibration, self.state.draft_time, self.harness.verify_cost)
        # Padding rows repeat the first request's, so the widest budget is a real request's.
        return kept_first(tokens, parent, scores, chosen, widest(budget, chosen.sum(1)))

    def tree(self, tokens: Tensor, parent: Tensor, scores: Tensor, count: Tensor) -> TreeSpec:
        """The round's trees from :meth:`select`'s output (the real rows only); records their predicted acceptance.
        Runs after the chain, where the round waits for its tokens anyway."""
        rows = slice(0, self.count)
        width = tree_width(count[rows], tokens.shape[1], self.harness.max_nodes)
        tree = tree_select(tokens[rows], parent[rows], scores[rows], count[rows], width)
        harness = self.harness
        harness.predicted[self.rows[rows]] = predicted_acceptance(tree, self.calibration[rows])
        # The table's seconds of the round: its deepest request's drafting (a device scalar, read once it is timed)
        # and the verify of its slots.
        verify = harness.verify_seconds(tree.tokens.shape[1])
        harness.predicted_s = self.state.draft_time[rows].max() + (verify - self.overhead)
        return tree


class DepthHarness(CallHarness):
    """The harness of autoregressive drafting over one generate call (the planner the drafting steps ask).

    Per round: :meth:`start` resets the :class:`DepthRound` of the round's padded batch size (the root pass already
    spent); each depth step calls its :meth:`DepthRound.decide` (the ``harness_decide`` op with this depth's drafter
    costs), the finalize step its :meth:`DepthRound.select` (the verify budget of the chosen nodes), and
    :meth:`observe` folds the verified acceptance into the calibration. Sampled rounds draft a chain whose length was
    fixed after the previous round (:meth:`chain_depth`). ``chain_mode`` is the :class:`DepthStepper` mode of the
    drafting steps (``"auto"``: CUDA graphs chained on the device where available); ``chain_report`` says which ran.
    """

    def __init__(
        self,
        policy: HarnessPolicy,
        batch: int,
        max_depth: int,
        context: int,
        draft_vocab: int,
        device,
        sampled: bool = False,
    ) -> None:
        super().__init__(policy, batch, context, sampled)
        table = self.table = policy.table
        self.device = torch.device(device)
        widths = [w for w in table.draft_widths if w <= min(draft_vocab, self.max_nodes - 1)] or [1]
        self.max_width = widths[-1] if self.plan.kind == "tree" else 1
        widths = [w for w in widths if w <= self.max_width]
        self.widths = torch.tensor(widths, dtype=torch.long, device=self.device)
        columns = [table.draft_widths.index(w) for w in widths]
        self.draft_cost = [table.draft_row(batch, d)[columns].to(self.device) for d in range(1, max_depth + 1)]
        self.root_cost = float(table.draft_row(batch, 1)[0])
        self.verify_cost = self.plan.verify_cost.to(self.device)
        self.gamma, self.calibration = policy.start_state(batch, self.device)
        self.predicted = torch.zeros(batch, dtype=torch.float64, device=self.device)
        self.rounds: dict[int, DepthRound] = {}
        self.chain_mode = "auto"
        self.chain_report = ""

    def padded(self, rows: Tensor) -> int:
        """The padded batch size of a round of ``rows``."""
        return padded_batch_size(rows.numel(), self.batch)

    def start(self, rows: Tensor) -> DepthRound:
        """The round of ``rows``: the :class:`DepthRound` of their padded batch size, reset."""
        padded = self.padded(rows)
        if padded not in self.rounds:
            self.rounds[padded] = DepthRound(self, padded)
        self.rounds[padded].reset(rows)
        return self.rounds[padded]

    def chain_depth(self, rows: Tensor) -> int:
        """Sampled rounds: the chain length of the table at the acceptance rate observed so far (prior 0.7)."""
        self.sampled = True
        return max(1, self.policy.chain_length(self.batch, self.context, self.chain_acceptance.rate, sampled=True))

    def observe(
        self,
        rows: Tensor,
        num_accepted: Tensor,
        num_nodes: Tensor,
        parent: Tensor | None = None,
        accepted_path: Tensor | None = None,
        host: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Folds the verified acceptance of ``rows`` into their calibration and the acceptance rate (per level of the
        verified trees when their ``parent`` and the ``accepted_path`` come with it; sampled chains count from
        ``host``, the requests' accepted drafts and node counts as read back)."""
        recalibrate(self.calibration, self.gamma, self.predicted, rows, num_accepted)
        if host is not None and self.sampled:
            self.chain_acceptance.observe(num_accepted, num_nodes, host=host)
        else:
            self.chain_acceptance.observe(num_accepted, num_nodes, parent, accepted_path)

    def finish(self) -> None:
        """Hands what this call learnt to the policy (the next call starts from it)."""
        super().finish()
        self.policy.learn(self.gamma, self.calibration)
