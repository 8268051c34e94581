"""Drafting: P-EAGLE (one drafter pass -> chain or parallel tree) and EAGLE-3 (autoregressive -> chain or EAGLE-2
dynamic tree), over the drafter's own KV cache.

Elements (DESIGN's convention): element i pairs token x_{i+1} with the target state g_i and sits at position i. The
drafter's paged cache (:class:`peagle.decode.kv_cache.PagedKVCache`) holds committed elements only. After a round
whose accepted path is [0, a_1 .. a_m] plus the bonus token, the new elements are (token of a_1, g of the root), ..,
(bonus, g of a_m): m + 1 pending elements (after prefill: one per prompt token, the last paired with the first
generated token). The next draft pass runs them (their keys/values enter the cache) followed by what the method
drafts from the last one, which never enters the cache:

* P-EAGLE: ``depth - 1`` mask elements (mask token, ``project(mask_hidden)``) in the same pass; the last real element
  and the mask elements give the ``depth`` per-depth distributions. Chain: one token per depth (argmax, or one draw).
  Tree: :func:`peagle.ops.tree_build_parallel` with a top-k per depth and a node budget.
* EAGLE-3 (the way vLLM's eagle3 proposer runs a K = 1 drafter, as ``peagle.train.evaluate.chain_drafts``): a drafted
  node is one more element whose token is the node's token and whose features are the pre-norm hidden state the
  drafter produced at its parent, at position (root element) + depth; it sees the committed cache and its ancestors'
  temporary entries, which are dropped after the round. Chain, or the EAGLE-2 dynamic tree
  (:func:`eagle2_dynamic_tree`).

Stochastic drafts (temperature > 0, ``draft_sampling="gumbel"``) are draws without replacement from the drafter's
distribution (:func:`peagle.decode.sampling.gumbel_order`), returned with those distributions for
``tree_rejection_sample``. The tree's shape is fixed before the draws it depends on: a P-EAGLE tree takes its shape from
the unperturbed distributions and gives the child of sibling rank r at depth d the r-th draw of depth d; a sampled
EAGLE-3 tree decides how many children a node gets from the draws at its own depth and above only (frontier = the best
``topk`` nodes of a depth by path probability, each given ``topk`` draws while the node budget lasts; no later
pruning). Deterministic drafts (greedy, or ``draft_sampling="topk"``) are top-k and verified without draft
probabilities. A draft vocabulary (d2t) maps drafted ids to target ids.

The rooms: ``base`` (trees, sampling, the drafter's cache and pass: what both methods share), ``peagle`` (P-EAGLE
passes), ``autoregressive`` (drafted nodes, EAGLE-2 dynamic trees), ``depth_round`` (the harness's depth-by-depth
rounds) and ``eagle3`` (EAGLE-3 drafting over the two before it).
"""

from peagle.decode.drafting.autoregressive import NodeSteps, eagle2_dynamic_tree
from peagle.decode.drafting.base import CachedDrafter, DraftTree, Sampling, root_tree
from peagle.decode.drafting.depth_round import DepthDraftRound, DepthPlanner
from peagle.decode.drafting.eagle3 import Eagle3Drafting
from peagle.decode.drafting.peagle import PassPlanner, PEagleDrafting

__all__ = [
    "CachedDrafter",
    "DepthDraftRound",
    "DepthPlanner",
    "DraftTree",
    "Eagle3Drafting",
    "NodeSteps",
    "PEagleDrafting",
    "PassPlanner",
    "Sampling",
    "eagle2_dynamic_tree",
    "root_tree",
]
