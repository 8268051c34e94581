"""The harness's decisions on the device. :func:`harness_decide` (autoregressive drafters): how many of the candidate
nodes a request drafts at the next depth, and whether it stops. :func:`harness_pass_decide` (P-EAGLE): the verify
budget of a pass's candidate tree and the next pass's depth. Both from calibrated path scores and the cost table (math:
``csrc/include/peagle/harness.h``; the policy around them: :mod:`peagle.decode.harness.policy`).
:func:`harness_observe` folds a verified round into the calibration those decisions read. P-EAGLE's path scores
come calibrated edge by edge instead (:func:`harness_edge_scores`, whose table :func:`harness_edge_observe` updates).

The op writes into preallocated tensors (no outputs), so a CUDA graph can capture it and a device-side runner can read
``go`` without the host. :func:`harness_decide_reference` is the executable spec in PyTorch, operation for operation
the same float64 arithmetic, so its results equal the kernels' bit for bit; so are
:func:`harness_pass_decide_reference` (on CPU tensors, whose cumulative sums run in order),
:func:`harness_observe_reference` and the edge references.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CALIBRATION_PRIOR",
    "CALIBRATION_SCALE_RANGE",
    "SHARPNESS_RATIO_RANGE",
    "HarnessState",
    "best_candidates",
    "budget_ratios",
    "calibration_scale",
    "harness_decide",
    "harness_decide_reference",
    "harness_edge_observe",
    "harness_edge_observe_reference",
    "harness_edge_scores",
    "harness_edge_scores_reference",
    "harness_observe",
    "harness_observe_reference",
    "harness_pass_decide",
    "harness_pass_decide_reference",
]

# Constants of csrc/include/peagle/harness.h (kPrior, kMinScale, kMaxScale, kMinSharpnessRatio, kMaxSharpnessRatio).
CALIBRATION_PRIOR = 2.0
CALIBRATION_SCALE_RANGE = (0.125, 4.0)
SHARPNESS_RATIO_RANGE = (0.5, 2.0)  # gamma moves by at most sqrt(2) a round


class HarnessState(NamedTuple):
    """The tensors harness_decide updates in place ([B] each; ``go`` [1])."""

    expected: Tensor  # float64: expected accepted drafts of the nodes drafted so far
    draft_time: Tensor  # float64: drafting seconds so far this round
    num_nodes: Tensor  # int64: nodes drafted so far, root included
    width: Tensor  # int32: nodes added at the last decided depth
    stop: Tensor  # int32: 1 once a request stopped drafting this round
    go: Tensor  # int32 [1]: 1 while some request drafts on

    @classmethod
    def start(cls, batch: int, device: torch.device | str, draft_time: Tensor | float = 0.0) -> HarnessState:
        """The state at a round's start: the root alone (1 node, nothing expected), ``draft_time`` already spent."""
        f64 = dict(dtype=torch.float64, device=device)
        spent = torch.as_tensor(draft_time, **f64).expand(batch).clone()
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            torch.zeros(batch, **f64),
            spent,
            torch.ones(batch, dtype=torch.long, device=device),
            torch.zeros(batch, **i32),
            torch.zeros(batch, **i32),
            torch.ones(1, **i32),
        )


def harness_decide(
    frontier_scores: Tensor,
    calibration: Tensor,
    widths: Tensor,
    draft_cost: Tensor,
    verify_cost: Tensor,
    state: HarnessState,
) -> None:
    """Decides the next depth's width of every request and updates ``state`` in place.

    Args:
        frontier_scores: [B, F] float64 path scores of the candidates (-inf = padding), in any order.
        calibration: [B, 2] float64 decayed sums (observed accepted drafts, predicted accepted drafts).
        widths: [W] int64 the widths the cost table has, ascending, >= 1.
        draft_cost: [W] float64 seconds of this depth's drafter forward at each width.
        verify_cost: [M + 1] float64 target verify seconds for n tree nodes (index n, root included).
        state: the running state; requests with ``stop`` set keep width 0.
    """
    torch.ops.peagle.harness_decide(frontier_scores, calibration, widths, draft_cost, verify_cost, *state)


@torch.library.register_fake("peagle::harness_decide")
def _harness_decide_fake(
    frontier_scores, calibration, widths, draft_cost, verify_cost, expected, draft_time, num_nodes, width, stop, go
):
    return None


def calibration_scale(calibration: Tensor) -> Tensor:
    """(2) of harness.h: clamp((observed + prior) / (predicted + prior)) per request, from [B, 2] sums."""
    low, high = CALIBRATION_SCALE_RANGE
    scale = (calibration[:, 0] + CALIBRATION_PRIOR) / (calibration[:, 1] + CALIBRATION_PRIOR)
    return scale.clamp(low, high)


def harness_decide_reference(
    frontier_scores: Tensor,
    calibration: Tensor,
    widths: Tensor,
    draft_cost: Tensor,
    verify_cost: Tensor,
    state: HarnessState,
) -> None:
    """Reference of :func:`harness_decide` (no input validation), vectorised over requests and widths."""
    batch, frontier = frontier_scores.shape
    max_nodes = verify_cost.shape[0] - 1
    live = state.stop == 0
    scale = calibration_scale(calibration.double())
    valid = frontier_scores >= 0
    ordered = torch.sort(torch.where(valid, frontier_scores, -1.0), dim=1, descending=True, stable=True).values
    contrib = torch.clamp(scale[:, None] * ordered, max=1.0)
    sums = torch.cumsum(torch.where(ordered >= 0, contrib, 0.0), dim=1)  # S_w at column w - 1
    nodes, w = state.num_nodes, widths.long()
    count = valid.sum(1)
    feasible = (w[None, :] <= count[:, None]) & (nodes[:, None] + w[None, :] <= max_nodes) & (nodes[:, None] >= 1)
    column = (w - 1).clamp(0, max(frontier - 1, 0)).expand(batch, -1)
    s_w = sums.gather(1, column) if frontier else torch.zeros_like(column, dtype=torch.float64)
    e = state.expected[:, None] + s_w
    t = state.draft_time[:, None] + draft_cost[None, :]
    v = verify_cost[(nodes[:, None] + w[None, :]).clamp(0, max_nodes)]
    ratio = torch.where(feasible, (1.0 + e) / (t + v), -torch.inf)
    current = (1.0 + state.expected) / (state.draft_time + verify_cost[nodes.clamp(0, max_nodes)])
    best = ratio.argmax(1) if len(widths) else torch.zeros(batch, dtype=torch.long)
    pick = lambda x: x.gather(1, best[:, None])[:, 0]  # noqa: E731
    chosen = live & (pick(ratio) > current) & (nodes <= max_nodes)
    state.width.copy_(torch.where(chosen, w[best], 0).int())
    state.stop.copy_(torch.where(chosen, 0, 1).int())
    state.expected.copy_(torch.where(chosen, pick(e), state.expected))
    state.draft_time.copy_(torch.where(chosen, pick(t), state.draft_time))
    state.num_nodes.copy_(torch.where(chosen, nodes + w[best], nodes))
    state.go.fill_(int(bool(chosen.any())))


def harness_pass_decide(
    scores: Tensor,
    depth: Tensor,
    num_nodes: Tensor,
    calibration: Tensor,
    pass_time: Tensor,
    verify_cost: Tensor,
    drafted_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """P-EAGLE: the verify budget of a pass's candidate tree and the next pass's depth ((5) of harness.h).

    Args:
        scores: [B, N] float64 (calibrated-exponent) path scores of the candidate tree, node 0 the root; nodes at or
            beyond ``num_nodes[b]`` are ignored.
        depth: [B, N] int64 node depths (1 .. ``drafted_depth`` for drafted nodes).
        num_nodes: [B] int64 nodes of each request's tree, root included.
        calibration: [B, 2] float64 decayed sums (observed accepted drafts, predicted accepted drafts).
        pass_time: [P] float64 seconds of a pass drafting 1 .. P depths (P <= 32).
        verify_cost: [M + 1] float64 target verify seconds for n tree nodes (index n, root included).
        drafted_depth: the depths this pass drafted, in [1, P].

    Returns:
        (budget [B] int64 nodes to verify, root included, in [1, min(M, drafts + 1)]; next_depth [B] int64 in [1, P];
        predicted [B] float64 = S_(budget - 1), the budget's expected accepted drafts).
    """
    return torch.ops.peagle.harness_pass_decide(
        scores, depth, num_nodes, calibration, pass_time, verify_cost, drafted_depth
    )


@torch.library.register_fake("peagle::harness_pass_decide")
def _harness_pass_decide_fake(scores, depth, num_nodes, calibration, pass_time, verify_cost, drafted_depth):
    batch = scores.shape[0]
    return num_nodes.new_empty(batch), num_nodes.new_empty(batch), scores.new_empty(batch)


def budget_ratios(scores: Tensor, calibration: Tensor, draft_time: Tensor | float, verify_cost: Tensor) -> Tensor:
    """Ratios (1 + S_k) / (T_draft + V[k + 1]) for k = 0 .. drafts, [B, k] (-inf past the valid candidates).

    ``scores`` [B, M] float64 path scores of the drafted candidates (root excluded), < 0 = padding, any order; at most
    the best M' - 1 of them count (V has M' + 1 entries)."""
    ordered, sums = _ordered_sums(scores, calibration, verify_cost.shape[0] - 1)
    nodes = torch.arange(1, sums.shape[1] + 1, device=scores.device)
    draft_time = torch.as_tensor(draft_time, dtype=torch.float64, device=scores.device).reshape(-1, 1)
    ratio = (1.0 + sums) / (draft_time + verify_cost[nodes][None, :])
    return torch.where(torch.cat([torch.ones_like(ordered[:, :1]), ordered], 1) >= 0, ratio, -torch.inf)


def _ordered_sums(scores: Tensor, calibration: Tensor, max_nodes: int) -> tuple[Tensor, Tensor]:
    """The best ``max_nodes - 1`` candidate scores in descending order (-1 = padding) and S_k = the sum of the best k
    of min(1, c * p), k = 0 .. their count (cumulative, in order: the kernels' sequential sum)."""
    scale = calibration_scale(calibration.double())
    ordered = torch.sort(torch.where(scores >= 0, scores.double(), -1.0), dim=1, descending=True, stable=True).values
    ordered = ordered[:, : max_nodes - 1]
    gain = torch.where(ordered >= 0, torch.clamp(scale[:, None] * ordered, max=1.0), 0.0)
    return ordered, torch.cat([gain.new_zeros(scores.shape[0], 1), torch.cumsum(gain, 1)], 1)


def best_candidates(scores: Tensor, valid: Tensor, budget: Tensor) -> Tensor:
    """[B, N] bool: the best ``budget[b]`` valid candidates by score (root first, ties to the smaller index)."""
    batch, nodes = scores.shape
    index = torch.arange(nodes, device=scores.device).expand(batch, nodes)
    key = torch.where(index == 0, 2.0, torch.where(valid, scores.double(), -1.0))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, index)
    return (rank < budget[:, None]) & valid


def harness_pass_decide_reference(
    scores: Tensor,
    depth: Tensor,
    num_nodes: Tensor,
    calibration: Tensor,
    pass_time: Tensor,
    verify_cost: Tensor,
    drafted_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of :func:`harness_pass_decide` (no input validation): every K' in 1 .. ``drafted_depth`` scored in
    one batched :func:`budget_ratios` over the tree with the nodes deeper than K' dropped."""
    batch, nodes = scores.shape
    device = scores.device
    index = torch.arange(nodes, device=device)
    valid = index[None, :] < num_nodes[:, None]
    drafted = valid & (index[None, :] > 0) & (depth >= 1) & (depth <= drafted_depth)
    candidates = torch.where(drafted, scores.double(), -1.0)[:, 1:]
    ks = torch.arange(1, drafted_depth + 1, device=device)
    shallow = torch.where(depth[:, None, 1:] <= ks[None, :, None], candidates[:, None, :], -1.0)
    seconds = pass_time[:drafted_depth].double().repeat(batch)
    ratios = budget_ratios(
        shallow.reshape(batch * drafted_depth, -1),
        calibration.repeat_interleave(drafted_depth, 0),
        seconds,
        verify_cost,
    ).view(batch, drafted_depth, -1)
    budget = ratios[:, drafted_depth - 1].argmax(1) + 1
    best = ratios.amax(2).argmax(1) + 1
    kept = torch.where(best_candidates(scores, drafted | (index[None, :] == 0), budget), depth, 0).amax(1)
    grow = (kept >= drafted_depth) & (best == drafted_depth) & (drafted_depth < pass_time.shape[0])
    _, sums = _ordered_sums(candidates, calibration, verify_cost.shape[0] - 1)
    predicted = sums.gather(1, (budget - 1)[:, None])[:, 0]
    return budget, torch.where(grow, best + 1, best.clamp(min=max(drafted_depth - 1, 1))), predicted


def harness_observe(
    calibration: Tensor,
    gamma: Tensor,
    predicted: Tensor,
    accepted: Tensor,
    rows: Tensor | None,
    decay: float,
    gamma_range: tuple[float, float],
) -> None:
    """Folds a verified round into the calibration of ``rows``, in place ((6) of harness.h): request b = ``rows[r]``
    decays its sums, adds ``accepted[r]`` and ``predicted[b]``, and moves its exponent ``gamma[b]`` toward agreement
    of the two sums, by at most sqrt(2).

    Args:
        calibration: [B, 2] float64 decayed sums (observed accepted drafts, predicted accepted drafts), updated.
        gamma: [B] float64 path-score exponents, updated (kept within ``gamma_range``).
        predicted: [B] float64 accepted drafts predicted for each request's verified tree (indexed by request).
        accepted: [R] int64 or int32 accepted drafts of each row.
        rows: [R] int64 distinct request indices in [0, B), or None for every request (R = B). On CUDA, rows out of
            range are skipped and duplicates race: the CPU op checks both, the CUDA op does not (no host sync).
        decay: the weight of the past sums, in [0, 1].
        gamma_range: (gamma_min, gamma_max), 0 < gamma_min <= gamma_max.
    """
    torch.ops.peagle.harness_observe(calibration, gamma, predicted, accepted, rows, decay, *gamma_range)


@torch.library.register_fake("peagle::harness_observe")
def _harness_observe_fake(calibration, gamma, predicted, accepted, rows, decay, gamma_min, gamma_max):
    return None


def harness_observe_reference(
    calibration: Tensor,
    gamma: Tensor,
    predicted: Tensor,
    accepted: Tensor,
    rows: Tensor | None,
    decay: float,
    gamma_range: tuple[float, float],
) -> None:
    """Reference of :func:`harness_observe` (no input validation): the rows' sums and exponents gathered, updated in
    the order of (6) and scattered back (rows distinct)."""
    index = torch.arange(calibration.shape[0], device=calibration.device) if rows is None else rows
    sums = calibration[index] * decay
    sums[:, 0] += accepted.double()
    sums[:, 1] += predicted[index]
    ratio = ((sums[:, 1] + CALIBRATION_PRIOR) / (sums[:, 0] + CALIBRATION_PRIOR)).clamp(*SHARPNESS_RATIO_RANGE)
    # The square root correctly rounded, like the kernels' (IEEE sqrt): torch's float64 sqrt on the CPU is one ulp off
    # for about 1% of inputs (torch 2.13), Python's math.sqrt is not.
    ratio = torch.tensor([math.sqrt(r) for r in ratio.tolist()], dtype=torch.float64, device=ratio.device)
    calibration[index] = sums
    gamma[index] = (gamma[index] * ratio).clamp(*gamma_range)


def harness_edge_scores(
    scores: Tensor, parent: Tensor, num_nodes: Tensor, table: Tensor, prior: Tensor, thresholds: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """P-EAGLE candidate trees' edge-calibrated path scores ((7) of harness.h; the why:
    :mod:`peagle.decode.harness.calibration`).

    Args:
        scores: [B, N] float64 path scores (products of the draft probabilities), node 0 the root; nodes at or beyond
            ``num_nodes[b]`` are padding.
        parent: [B, N] int64 parent indices (``parent[b, i]`` in [0, i) for real nodes i >= 1); siblings lie best
            first, so a node's first sibling by index is its parent's first child.
        num_nodes: [B] int64 real nodes, root included, in [1, N].
        table: [2, E] float64 decayed sums per kind of edge: accepted edges, and their edge probabilities.
        prior: [2, E] float64 the same sums' prior (the second row > 0).
        thresholds: [T] float64 ascending bin edges of the edge probability; E = 2 * (T + 1).

    Returns:
        (path [B, N] float64: the product of each node's calibrated edges min(1, c * q), 1 at the root, -1 on padding;
        q [B, N] float64 each node's edge probability, 0 at the root and on padding; kind [B, N] int64 each node's kind
        of edge, (first child ? 0 : 1) * (T + 1) + its bin, -1 at the root and on padding).
    """
    return torch.ops.peagle.harness_edge_scores(scores, parent, num_nodes, table, prior, thresholds)


@torch.library.register_fake("peagle::harness_edge_scores")
def _harness_edge_scores_fake(scores, parent, num_nodes, table, prior, thresholds):
    return torch.empty_like(scores), torch.empty_like(scores), torch.empty_like(parent)


def harness_edge_scores_reference(
    scores: Tensor, parent: Tensor, num_nodes: Tensor, table: Tensor, prior: Tensor, thresholds: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of :func:`harness_edge_scores` (no input validation; real nodes' parents in [0, i)): node by node,
    each node's product after its parent's, as the kernels multiply."""
    batch, nodes = scores.shape
    device = scores.device
    index = torch.arange(nodes, device=device)
    real = (index[None, :] > 0) & (index[None, :] < num_nodes[:, None])
    above = scores.gather(1, parent.clamp(min=0))
    q = torch.where(real & (above > 0), scores / torch.where(above > 0, above, 1.0), 0.0)
    earlier = index[None, None, :] < index[None, :, None]
    later = ((parent[:, :, None] == parent[:, None, :]) & earlier & (index[None, None, :] > 0)).any(2)
    bins = torch.bucketize(q, thresholds, right=True)
    kind = torch.where(real, later.long() * (thresholds.shape[0] + 1) + bins, -1)
    scale = (table[0] + prior[0]) / (table[1] + prior[1])
    edge = torch.clamp(scale[kind.clamp(min=0)] * q, max=1.0)
    path = torch.where(index[None, :] == 0, 1.0, -1.0).to(torch.float64).expand(batch, nodes).clone()
    for i in range(1, nodes):
        up = parent[:, i].clamp(min=0)
        path[:, i] = torch.where(real[:, i], path.gather(1, up[:, None])[:, 0] * edge[:, i], -1.0)
    return path, torch.where(real, q, 0.0), kind


def harness_edge_observe(
    table: Tensor,
    calibration: Tensor,
    q: Tensor,
    kind: Tensor,
    path: Tensor,
    parent: Tensor,
    accepted_path: Tensor,
    num_accepted: Tensor,
    rows: Tensor | None,
    edge_decay: float,
    path_decay: float,
) -> None:
    """Folds a verified round into the edge table and the rows' calibration sums, in place ((8) of harness.h).

    Args:
        table: [2, E] float64 decayed sums per kind of edge (accepted, edge probabilities), updated: they decay by
            ``edge_decay``, then each verified drafted node whose parent lies on the accepted path adds its ``q`` to
            its kind's second sum and, if it lies on the accepted path too, 1 to the first.
        calibration: [B, 2] float64 per-request (observed, predicted) sums, updated for each row r's request b =
            ``rows[r]``: decay by ``path_decay``, add ``num_accepted[r]`` and the sum of its nodes' ``path`` values.
        q, kind, path, parent: [R, N] of the verified trees (from :func:`harness_edge_scores` of their nodes; kind -1
            at the root and on padding).
        accepted_path: [R, L] int64 node indices from the root, -1 padded; num_accepted: [R] int64.
        rows: [R] int64 distinct request indices in [0, B), or None (R = B). On CUDA, rows out of range are skipped and
            duplicates race: the CPU op checks both, the CUDA op does not (no host sync).
        edge_decay, path_decay: the weights of the past sums, in [0, 1].
    """
    torch.ops.peagle.harness_edge_observe(
        table, calibration, q, kind, path, parent, accepted_path, num_accepted, rows, edge_decay, path_decay
    )


@torch.library.register_fake("peagle::harness_edge_observe")
def _harness_edge_observe_fake(
    table, calibration, q, kind, path, parent, accepted_path, num_accepted, rows, edge_decay, path_decay
):
    return None


def harness_edge_observe_reference(
    table: Tensor,
    calibration: Tensor,
    q: Tensor,
    kind: Tensor,
    path: Tensor,
    parent: Tensor,
    accepted_path: Tensor,
    num_accepted: Tensor,
    rows: Tensor | None,
    edge_decay: float,
    path_decay: float,
) -> None:
    """Reference of :func:`harness_edge_observe` (no input validation): the table's sums add row by row, node by
    node, in the kernels' order."""
    table.mul_(edge_decay)
    steps = torch.arange(accepted_path.shape[1], device=q.device)
    on_path = (steps[None, :] <= num_accepted[:, None]) & (accepted_path >= 0)
    for r in range(q.shape[0]):
        accepted_nodes = set(accepted_path[r][on_path[r]].tolist())
        predicted = torch.zeros((), dtype=torch.float64, device=q.device)
        for i in range(q.shape[1]):
            k = int(kind[r, i])
            if k < 0:
                continue
            predicted = predicted + path[r, i]
            if int(parent[r, i]) in accepted_nodes:
                table[1, k] += q[r, i]
                table[0, k] += float(i in accepted_nodes)
        b = r if rows is None else int(rows[r])
        calibration[b, 0] = calibration[b, 0] * path_decay + num_accepted[r].double()
        calibration[b, 1] = calibration[b, 1] * path_decay + predicted
