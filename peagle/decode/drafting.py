"""Drafting policy: how a drafter's distributions become a draft tree. The tree ops of :mod:`peagle.ops.tree_build`
build and select; the loops here decide which nodes to expand and call the drafter between steps.

:func:`eagle2_dynamic_tree`: EAGLE-2's dynamic tree for an autoregressive (EAGLE-3) drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from peagle.ops.tree_build import TreeSpec, tree_expand_topk, tree_select

__all__ = ["eagle2_dynamic_tree"]


def eagle2_dynamic_tree(
    root_probs: Tensor,
    draft_step: Callable[[Tensor, Tensor], Tensor],
    depth: int,
    topk: int,
    num_nodes: int,
) -> TreeSpec:
    """EAGLE-2 dynamic draft tree for an autoregressive drafter.

    Each depth expands the top-``topk`` frontier: every frontier node proposes its top-``topk`` children (cumulative
    path score = product of draft probabilities); all of them become candidates, and the ``topk`` best form the next
    frontier. Finally the best ``num_nodes`` candidates are kept (:func:`tree_select`).

    Args:
        root_probs: [B, V] draft distribution after the root.
        draft_step: called as ``draft_step(tokens, candidate_index)`` with the new frontier ([B, topk] tokens and their
            candidate indices, whose parents are earlier candidates); returns the [B, topk, V] draft distributions
            after those nodes, over the root's vocabulary.
        depth: number of drafted depths, >= 1.
        topk: children per frontier node and frontier width, in [1, V].
        num_nodes: nodes kept (root included), >= 1 (tree_select bounds it above).

    Raises:
        ValueError: naming the argument, for a bad argument or a ``draft_step`` result of another shape.
    """
    _check_dynamic_tree_args(root_probs, draft_step, depth, topk, num_nodes)
    batch = root_probs.shape[0]
    device = root_probs.device
    tokens = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    scores = [torch.ones(batch, 1, dtype=torch.float64, device=device)]
    frontier_index = torch.zeros(batch, 1, dtype=torch.long, device=device)
    frontier_scores = scores[0]
    probs = root_probs[:, None, :]
    count = 1
    for d in range(depth):
        cand_tokens, slot, cand_scores = tree_expand_topk(frontier_scores, probs, topk)
        tokens.append(cand_tokens)
        parents.append(frontier_index.gather(1, slot))
        scores.append(cand_scores)
        width = min(topk, cand_tokens.shape[1])
        frontier_index = count + torch.arange(width, device=device).expand(batch, width)
        frontier_scores = cand_scores[:, :width]
        count += cand_tokens.shape[1]
        if d + 1 < depth:
            probs = draft_step(cand_tokens[:, :width], frontier_index)
            _check_step_output(probs, root_probs, width)
    all_tokens, all_parents, all_scores = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
    num_candidates = torch.full((batch,), all_tokens.shape[1], dtype=torch.long, device=device)
    return tree_select(all_tokens, all_parents, all_scores, num_candidates, num_nodes)


def _check_dynamic_tree_args(root_probs: Tensor, draft_step: Callable, depth: int, topk: int, num_nodes: int) -> None:
    if not isinstance(root_probs, Tensor) or root_probs.dim() != 2:
        shape = tuple(root_probs.shape) if isinstance(root_probs, Tensor) else type(root_probs).__name__
        raise ValueError(f"eagle2_dynamic_tree: root_probs must be 2-D [B, V], got {shape}")
    if not root_probs.is_floating_point():
        raise ValueError(f"eagle2_dynamic_tree: root_probs must be floating, got {root_probs.dtype}")
    if not callable(draft_step):
        raise ValueError(f"eagle2_dynamic_tree: draft_step must be callable, got {type(draft_step).__name__}")
    vocab = root_probs.shape[1]
    if depth < 1:
        raise ValueError(f"eagle2_dynamic_tree: depth must be >= 1, got {depth}")
    if not 1 <= topk <= vocab:
        raise ValueError(f"eagle2_dynamic_tree: topk must be in [1, V] = [1, {vocab}], got {topk}")
    if num_nodes < 1:
        raise ValueError(f"eagle2_dynamic_tree: num_nodes must be >= 1, got {num_nodes}")


def _check_step_output(probs: Tensor, root_probs: Tensor, width: int) -> None:
    """A draft step over another vocabulary would put token ids outside the root's vocabulary into the tree."""
    expected = (root_probs.shape[0], width, root_probs.shape[1])
    if not isinstance(probs, Tensor) or tuple(probs.shape) != expected:
        got = tuple(probs.shape) if isinstance(probs, Tensor) else type(probs).__name__
        raise ValueError(
            f"eagle2_dynamic_tree: draft_step must return [B, width, V] = {list(expected)} (the root's vocabulary), "
            f"got {list(got) if isinstance(got, tuple) else got}"
        )
    if probs.device != root_probs.device:
        raise ValueError(
            f"eagle2_dynamic_tree: draft_step must return a tensor on {root_probs.device}, got {probs.device}"
        )
