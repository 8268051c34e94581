"""EAGLE-3 drafting: autoregressive drafting of a K = 1 drafter, a chain of ``depth`` drafts or an EAGLE-2 dynamic
tree (:mod:`peagle.decode.drafting.autoregressive`), depth by depth under a harness's decisions when one plans
(:mod:`peagle.decode.drafting.depth_round`)."""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.decode.drafting.autoregressive import NodeSteps, eagle2_dynamic_tree
from peagle.decode.drafting.base import CachedDrafter, DraftTree, Sampling
from peagle.decode.drafting.depth_round import DepthDraftRound, DepthPlanner
from peagle.decode.harness.graphs import GraphChainCache
from peagle.decode.sampling import draft_distribution

__all__ = ["Eagle3Drafting"]


class Eagle3Drafting(CachedDrafter):
    """EAGLE-3: autoregressive drafting of a K = 1 drafter; chain of ``depth`` drafts or EAGLE-2 dynamic tree."""

    method = "eagle3"

    _rounds: GraphChainCache[DepthDraftRound] | None = None  # harness rounds per padded batch size, of one harness
    _rounds_harness: DepthPlanner | None = None

    def allocate(self, num_requests: int, capacity: int, pending_width: int, block_size: int) -> None:
        self._close_rounds()  # their buffers and graphs belong to the old cache
        super().allocate(num_requests, capacity, pending_width, block_size)

    def _close_rounds(self) -> None:
        if self._rounds is not None:
            self._rounds.close()
        self._rounds, self._rounds_harness = None, None

    def _harness_round(self, harness: DepthPlanner, rows: Tensor, temperature: float) -> DepthDraftRound:
        """The round buffers and stepper of ``rows``'s padded batch size (built on first use; one generate call's
        harness and temperature)."""
        if self._rounds_harness is not harness:
            self._close_rounds()
            self._rounds = GraphChainCache(lambda padded: DepthDraftRound(self, harness, padded, temperature))
            self._rounds_harness = harness
        return self._rounds.get(harness.padded(rows))

    @torch.no_grad()
    def draft(
        self, rows: Tensor, host_rows: list[int], roots: Tensor, sampling: Sampling, harness: DepthPlanner | None = None
    ) -> DraftTree:
        """The round's tree; with a ``harness`` (:class:`peagle.decode.harness.DepthHarness`) greedy rounds draft
        depth by depth under its decisions, and sampled rounds draft the chain length it fixed last round."""
        logits, hidden = self.run_pending(rows, host_rows, 0, 1)
        root_probs = draft_distribution(logits[:, 0], sampling.temperature)
        if harness is not None and not sampling.gumbel:
            spec = self._harness_round(harness, rows, sampling.temperature).draft(
                rows, host_rows, root_probs, hidden[:, 0]
            )
            return self.tree_from_spec(roots, spec)
        steps = NodeSteps(self, rows, host_rows, hidden[:, 0])
        if harness is not None:
            length = harness.chain_depth(rows)
            return steps.grow(roots, root_probs, 1, length + 1, sampling, max_depth=length)
        if self.mode == "tree" and not sampling.gumbel:
            step = steps.eagle2_step(root_probs, self.topk, sampling.temperature)
            spec = eagle2_dynamic_tree(root_probs, step, self.depth, self.topk, self.num_nodes)
            return self.tree_from_spec(roots, spec)
        # Chains (a tree of top-1 children) and sampled trees: shapes decided depth by depth, never pruned later.
        topk, budget = (1, self.depth + 1) if self.mode == "chain" else (self.topk, self.num_nodes)
        return steps.grow(roots, root_probs, topk, budget, sampling)
