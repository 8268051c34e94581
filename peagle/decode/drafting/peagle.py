"""P-EAGLE drafting: one drafter pass gives ``depth`` per-depth distributions, drafted as a chain (one token per
depth) or a parallel tree (:func:`peagle.ops.tree_build_parallel`), under a harness's decisions when one plans."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from peagle.decode.drafting.base import CachedDrafter, DraftTree, Sampling
from peagle.decode.sampling import draft_distribution, gumbel_order
from peagle.ops import TreeSpec, tree_build_parallel

__all__ = ["PEagleDrafting", "PassPlanner"]


class PassPlanner(Protocol):
    """What P-EAGLE drafting asks a harness (:class:`peagle.decode.harness.PassHarness` implements it)."""

    candidates: int  # the candidate tree's nodes, root included (select keeps at most the verify limit of them)

    def depth(self, rows: Tensor) -> int: ...

    def topk(self, depth: int, sampled: bool) -> list[int]: ...

    def select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec: ...


def _sibling_rank(parent: Tensor) -> Tensor:
    """Rank of each node among its siblings in node order [b, n]."""
    index = torch.arange(parent.shape[1], device=parent.device)
    earlier = (parent[:, :, None] == parent[:, None, :]) & (index[None, None, :] < index[None, :, None])
    return earlier.sum(-1)


class PEagleDrafting(CachedDrafter):
    """P-EAGLE: ``depth`` per-depth distributions from one pass; chain (one token per depth) or parallel tree."""

    method = "peagle"

    @torch.no_grad()
    def draft(
        self, rows: Tensor, host_rows: list[int], roots: Tensor, sampling: Sampling, harness: PassPlanner | None = None
    ) -> DraftTree:
        """The round's tree; with a ``harness`` (:class:`peagle.decode.harness.PassHarness`) the pass depth, the
        candidate tree's top-k and the verified nodes are its decisions."""
        depths = self.depth if harness is None else harness.depth(rows)
        logits, _ = self.run_pending(rows, host_rows, depths - 1, depths)
        probs = draft_distribution(logits, sampling.temperature)  # [b, depth, Vd]
        if harness is None:
            topk = [1] * depths if self.mode == "chain" else self.topk
            spec = tree_build_parallel(probs, topk, self.max_nodes)
        else:
            topk = harness.topk(depths, sampling.gumbel)
            spec = harness.select(rows, tree_build_parallel(probs, topk, harness.candidates), depths, sampling.gumbel)
        if not sampling.gumbel:
            return self.tree_from_spec(roots, spec)
        # Shape from the unperturbed distributions; node of sibling rank r at depth d = the r-th draw of depth d.
        draws = gumbel_order(probs, max(topk), sampling.seeds, sampling.offset)  # [b, depth, max(topk)]
        depth = spec.depth.clamp(min=1) - 1
        rank = _sibling_rank(spec.parent).clamp(max=max(topk) - 1)
        tokens = draws[torch.arange(rows.numel(), device=self.device)[:, None], depth, rank]
        tree = self.tree_from_spec(roots, spec, tokens)
        # Node i's children were drawn from depth depth[i]'s distribution (leaves at the last depth have none).
        node_probs = self.full_vocab(probs).gather(
            1, tree.depth.clamp(max=depths - 1)[..., None].expand(-1, -1, self.target_vocab)
        )
        return tree._replace(draft_probs=node_probs)
