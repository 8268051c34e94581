"""The harness: cost-aware drafting decisions, made on the device: how deep and how wide to draft, and how many nodes
to verify, so that a round emits the most tokens per second (derivation: ``csrc/include/peagle/harness.h``).

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

The rooms, each importing only those listed before it:

* ``cost``: the profiled cost table (``peagle profile`` writes it, :mod:`peagle.decode.harness.profile` measures it);
* ``graphs``: one round's per-depth CUDA graphs chained by device tail launch (the host loop elsewhere);
* ``calibration``: the P-EAGLE edge calibration, learnt by kind of edge;
* ``budget``: the pure budget math (sharpened path scores, verify budgets, keeping a budget's best nodes);
* ``evidence``: what a call observes and the statistics the verdicts use (acceptance rates, timed rounds, paired gains);
* ``policy``: the per-call plan and verdicts (:class:`HarnessPolicy`) and :class:`CallHarness`, shared by
* ``pass_harness`` (P-EAGLE: :class:`PassHarness`) and ``depth_harness`` (EAGLE-3, depth by depth:
  :class:`DepthHarness`, :class:`DepthRound`, :class:`DepthStepper`);
* ``rounds``: the harness as the round loop sees it (:class:`HarnessRounds`, a
  :class:`peagle.decode.rounds.RoundPolicy`):
  the only module the engine reaches the harness through.
"""

from peagle.decode.harness.budget import harness_budget, pass_budget, predicted_acceptance, select_budget
from peagle.decode.harness.cost import COST_TABLE_VERSION, CostTable, machine_identity
from peagle.decode.harness.depth_harness import DepthHarness, DepthRound, DepthStepper
from peagle.decode.harness.pass_harness import PassHarness
from peagle.decode.harness.policy import HarnessPolicy, Plan

__all__ = [
    "COST_TABLE_VERSION",
    "CostTable",
    "DepthHarness",
    "DepthRound",
    "DepthStepper",
    "HarnessPolicy",
    "PassHarness",
    "Plan",
    "harness_budget",
    "machine_identity",
    "pass_budget",
    "predicted_acceptance",
    "select_budget",
]
