"""The harness's pure budget math: path scores sharpened by a per-request exponent, the verify budget that maximises
tokens per second, the P-EAGLE pass's budget and next depth, keeping a budget's best nodes as a tree, and folding a
round's acceptance into the calibration (derivation: ``csrc/include/peagle/harness.h``; the policy around it:
:mod:`peagle.decode.harness`). Functions of tensors only: no state, no host reads unless a docstring says so.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from peagle.ops import TreeSpec, calibration_scale, harness_observe, harness_pass_decide, tree_select
from peagle.ops.harness import best_candidates, budget_ratios

__all__ = [
    "CALIBRATION_DECAY",
    "SHARPNESS_RANGE",
    "harness_budget",
    "kept_first",
    "pass_budget",
    "predicted_acceptance",
    "ragged_chain_lengths",
    "recalibrate",
    "select_budget",
    "select_candidates",
    "select_widest",
    "sharpen",
    "tree_width",
    "verified_tree_counts",
    "widest",
]

CALIBRATION_DECAY = 0.9  # weight of the past in the observed / predicted sums (about the last 10 rounds)
SHARPNESS_RANGE = (0.02, 1.5)  # bounds of the exponent gamma of the path scores


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


def ragged_chain_lengths(acceptance: Tensor, emitted: float, draft_time: float, verify_cost: Tensor) -> Tensor:
    """Drafts to keep per chain of a batch that the target verifies without padding (a vLLM step: each request's own
    drafts are its own tokens in the forward), maximising the step's tokens per second (``emitted`` + S) / (T_draft +
    V[n]): S the predicted accepted drafts of the n - 1 kept, the best of all the chains' drafts taken together.

    The batch is one tree of chains below a shared root, so its budget is the harness's verify budget of that tree
    (the ``harness_pass_decide`` op, as :func:`harness_budget`: one pass of one depth) with the scores divided by
    ``emitted`` ((1 + S / e) / (T + V) has the argmax of (e + S) / (T + V)), and a chain keeps the drafts of it
    that the budget's best nodes hold: a prefix, since a draft's acceptance never exceeds its parent's (ties go to
    the smaller index: the shallower draft).

    Args:
        acceptance: [R, K] float64 each draft's predicted acceptance (calibrated path scores, already scaled per
            request, in [0, 1], non-increasing along a row; < 0 = no draft).
        emitted: the tokens the step emits whatever is kept: one per request of the batch, plus the predicted
            accepted drafts of requests whose drafts are all verified anyway (their cost is in V).
        draft_time: seconds of the step's drafting.
        verify_cost: [R * K + 2] float64, V[n]: the step's target forward when n - 1 of these drafts are kept.

    Returns:
        [R] int64 drafts to keep per chain.
    """
    rows, depth = acceptance.shape
    device = acceptance.device
    if rows * depth == 0:
        return torch.zeros(rows, dtype=torch.long, device=device)
    levels, count, unscaled, index = _one_level(rows * depth + 1, device)
    scores = torch.empty(1, rows * depth + 1, dtype=torch.float64, device=device)
    scores[:, 0] = 1.0
    torch.div(acceptance.reshape(1, -1), emitted, out=scores[:, 1:])
    seconds = torch.full((1,), float(draft_time), dtype=torch.float64, device=device)
    budget, _, _ = harness_pass_decide(scores, levels, count, unscaled, seconds, verify_cost, 1)
    # The budget's drafts: the best budget - 1 by score, ties to the smaller index (as best_candidates keeps them).
    order = torch.sort(scores[0, 1:], descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, index)
    return (rank < budget - 1).view(rows, depth).sum(1)


@functools.cache
def _one_level(nodes: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(depths [1, nodes]: the root, then every node one level below it; the node count [1]; calibration sums [1, 2]
    of scale 1; the drafts' ranks 0 .. nodes - 2) of :func:`ragged_chain_lengths`' one-level tree (kept per size: a
    server repeats few)."""
    levels = (torch.arange(nodes, device=device) > 0).long()[None, :]
    count = torch.full((1,), nodes, dtype=torch.long, device=device)
    index = torch.arange(nodes - 1, device=device)
    return levels, count, torch.zeros(1, 2, dtype=torch.float64, device=device), index


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
