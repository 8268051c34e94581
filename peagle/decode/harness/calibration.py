"""What a P-EAGLE tree node's path score is worth: the acceptance of each edge, learnt online by kind of edge.

A P-EAGLE pass drafts one distribution per depth, each a marginal over what the earlier depths might have been, and a
candidate tree gives every node of depth d - 1 the same top-k tokens of depth d's distribution as children. A node's
path score, the product of its edges' draft probabilities q, is then a poor estimate of how often the node is
accepted: the drafter's marginals are flat where its first choice is right (on the demo drafter, edges of q near 0.05
that continue the top-1 chain were accepted 39% of the time when their parent was), while the other children of the
same parent, at the same q, were accepted 8% of the time. One scale and one exponent on the whole path (the per-request
calibration autoregressive drafters keep, whose edges are real conditionals) cannot fit both: they under-predicted
the chain's 4th draft 5x and over-predicted the siblings 3x, so the budgets verified wide trees of siblings and
stopped chains early.

So the harness estimates each edge's acceptance given its parent's, a(edge) = min(1, c * q), with a scale c kept per
kind of edge, by two things the candidate tree shows: whether the edge is its parent's first child (the best token of
its depth) or a later one, and the bin of log10 q (:data:`EDGE_BINS`). Each kind's c is the ratio of decayed sums
over the edges verified with their parent accepted, c = (accepted + w q_bin^e) / (sum of q + w q_bin), a prior of
w = :data:`EDGE_PRIOR_WEIGHT` edges accepted q^e of the time (:data:`EDGE_PRIOR_EXPONENT`), decaying by
:data:`EDGE_DECAY` a round. A first child's prior, q^0.5, is optimistic about a flat drafter, so that its chains get
verified and learnt; a later child's is its marginal q (on the demo drafter an exponent of 0.5 did within 1% of it,
and q keeps an honest drafter's trees from widening on siblings nobody has verified yet). A node's score is the
product of its path's a (the chain rule, each a being conditional on the parent's acceptance), which never grows along
a path, so the best n nodes by it are parent-closed. The table is a property of the drafter and target, shared by a
call's requests and carried from call to call. Within a bin, a is proportional to q: where path scores are the true
acceptance probabilities (the simulation of ``python_tests/test_harness_policy.py``), every c goes to 1 and a to q.

On top of the table, each request keeps the harness op's path scale (decayed sums of its accepted and predicted drafts,
:data:`~peagle.decode.harness.policy.PATH_SCALE_DECAY`): how hard its text is right now, which the shared table learns
too slowly.

Replaying the default demo's recorded rounds (the 8 held-out prompts of the benchmark, each round's whole 4-2-2-2-2
candidate tree of 124 nodes and its accepted path; a budget chosen as the harness chooses it, the table learnt online
from a cold start; cost-table seconds plus 0.6 ms a round): budgets by these scores emitted 1.061 tokens a millisecond,
against 0.998 for the best fixed configuration (the best 24 nodes by path score of the 2-2-2-2-2 tree, the engine's
`tree 24 pruned`), 0.938 for chain 5 and 0.922 for the per-request path calibration (20 nodes a round); from the best
32 candidates by path score (the verify limit) 1.025. With verification twice as steep per node as the table says,
0.944 against 0.866 (chain 5) and 0.771. The constants were chosen on such replays.

The math is ops (7) and (8) of ``csrc/include/peagle/harness.h`` (:func:`~peagle.ops.harness_edge_scores`,
:func:`~peagle.ops.harness_edge_observe`): one call each a round, device work without a host read, so a CUDA graph can
hold them (as Python, about 30 small torch ops a round took 0.45 ms of a 4 ms round at batch 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from peagle.ops import TreeSpec, harness_edge_observe, harness_edge_scores

__all__ = ["EDGE_BINS", "EDGE_DECAY", "EDGE_PRIOR_EXPONENT", "EDGE_PRIOR_WEIGHT", "EdgeCalibration", "edge_constants"]

EDGE_BINS = (-3.0, -2.5, -2.0, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25)  # bin edges of log10 q
EDGE_PRIOR_EXPONENT = (0.5, 1.0)  # of first children, of later children
EDGE_PRIOR_WEIGHT = 2.0
EDGE_DECAY = 0.99  # weight of the past per round (about the last 100 rounds)
EDGE_KINDS = 2 * (len(EDGE_BINS) + 1)  # first or later child, times the bins
_LOWEST = -4.0  # the lowest bin's lower end, for its middle q


@functools.cache
def edge_constants(device: torch.device) -> tuple[Tensor, Tensor]:
    """(prior [2, EDGE_KINDS], thresholds [T]) on ``device``: the prior's accepted and drafted sums, w q_bin^e and
    w q_bin at each bin's middle q, and the bins' edges as probabilities."""
    ends = torch.tensor([_LOWEST, *EDGE_BINS, 0.0], dtype=torch.float64)
    middle = 10.0 ** ((ends[:-1] + ends[1:]) / 2)
    exponent = torch.tensor(EDGE_PRIOR_EXPONENT, dtype=torch.float64)
    accepted = (EDGE_PRIOR_WEIGHT * middle[None, :] ** exponent[:, None]).reshape(-1)
    drafted = (EDGE_PRIOR_WEIGHT * middle).repeat(2)
    thresholds = 10.0 ** torch.tensor(EDGE_BINS, dtype=torch.float64)
    return torch.stack([accepted, drafted]).to(device), thresholds.to(device)


@dataclass(eq=False)
class EdgeCalibration:
    """The decayed sums per kind of edge, [2, EDGE_KINDS] float64: the accepted edges and their draft probabilities,
    over the edges verified with their parent accepted."""

    table: Tensor

    @classmethod
    def start(cls, device: torch.device | str = "cpu") -> EdgeCalibration:
        return cls(torch.zeros(2, EDGE_KINDS, dtype=torch.float64, device=device))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EdgeCalibration):
            return NotImplemented
        return torch.equal(self.table, other.table)

    def to(self, device: torch.device | str) -> EdgeCalibration:
        """A copy on ``device`` (a call's harness learns in its own copy)."""
        return EdgeCalibration(self.table.to(device, copy=True))

    def scales(self) -> Tensor:
        """c per kind of edge, [EDGE_KINDS] float64 (the prior where nothing was observed)."""
        prior, _ = edge_constants(self.table.device)
        return (self.table[0] + prior[0]) / (self.table[1] + prior[1])

    def scores(self, spec: TreeSpec) -> tuple[Tensor, Tensor, Tensor]:
        """(path, q, kind) [B, N] of candidate trees: each node's predicted acceptance (the product of its path's
        calibrated edges; 1 at the root, -1 on padding), its edge probability and its kind of edge (-1: root,
        padding)."""
        return self.tree_scores(spec.scores, spec.parent, spec.num_nodes)

    def tree_scores(self, scores: Tensor, parent: Tensor, num_nodes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`scores` of trees given by their path scores (products of draft probabilities), parents and node
        counts alone."""
        prior, thresholds = edge_constants(self.table.device)
        return harness_edge_scores(scores.double(), parent, num_nodes, self.table, prior, thresholds)

    def observe(
        self,
        calibration: Tensor,
        verified: tuple[Tensor, Tensor, Tensor],
        parent: Tensor,
        accepted_path: Tensor,
        num_accepted: Tensor,
        rows: Tensor,
        path_decay: float,
    ) -> None:
        """Folds one verified round in, in place: every verified node whose parent was accepted is one observation of
        its kind of edge (``verified``: q, kind and path of the verified trees' nodes, as :meth:`scores` gave them);
        request ``rows[r]``'s ``calibration`` sums decay by ``path_decay`` and add its accepted and predicted
        drafts."""
        q, kind, path = verified
        harness_edge_observe(
            self.table, calibration, q, kind, path, parent, accepted_path, num_accepted, rows, EDGE_DECAY, path_decay
        )
