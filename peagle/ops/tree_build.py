"""Draft-tree construction: P-EAGLE parallel trees from one drafter pass (:func:`tree_build_parallel`), the best-N
selection of scored candidates (:func:`tree_select`) and one EAGLE-2 expansion step (:func:`tree_expand_topk`), over
batches (verification: :mod:`peagle.ops.tree_verify`; the EAGLE-2 drafting loop that calls these:
:mod:`peagle.decode.drafting`).

A built tree is a :class:`TreeSpec`: nodes ordered by depth, then path score (the product of the draft probabilities
along the path, in float64: one IEEE multiplication per node, so every backend computes the same bits), with its
ancestor mask, bit-packed mask and root-to-leaf paths. Ties go to the smaller candidate index / token id.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "TreeSpec",
    "ancestor_mask",
    "tree_build_parallel",
    "tree_build_parallel_reference",
    "tree_expand_topk",
    "tree_expand_topk_reference",
    "tree_select",
    "tree_select_reference",
]


class TreeSpec(NamedTuple):
    """A batch of built draft trees (N = num_nodes slots; nodes beyond num_nodes[b] are -1 / False padding).

    Node 0 is the root (its token is -1: the caller's last committed token). Nodes are ordered by depth, then by path
    score (siblings most likely first), so parents come before children. The position of node i is the committed
    length + depth[i]; ``mask[b, i, j]`` is True when node j is node i's ancestor or itself (the tree attention mask).
    """

    tokens: Tensor  # [B, N] int64
    parent: Tensor  # [B, N] int64, -1 at the root
    depth: Tensor  # [B, N] int64 (= position offset)
    num_nodes: Tensor  # [B] int64
    scores: Tensor  # [B, N] float64 path scores (product of draft probabilities)
    mask: Tensor  # [B, N, N] bool
    mask_packed: Tensor  # [B, N, ceil(N / 32)] int32, bit j % 32 of word j // 32
    paths: Tensor  # [B, N, L] int64 root-to-leaf node indices, -1 padded
    num_paths: Tensor  # [B] int64 number of leaves


def tree_select(
    cand_tokens: Tensor, cand_parent: Tensor, cand_scores: Tensor, num_candidates: Tensor, num_nodes: int
) -> TreeSpec:
    """Keeps the best ``num_nodes`` candidates (root included) by path score and lays them out as a tree.

    Candidates [B, M]: candidate 0 is the root (parent -1), ``0 <= cand_parent[i] < i``, and a child's score must not
    exceed its parent's (true for products of probabilities), so the best N always contain each kept node's parent.
    Ties go to the smaller candidate index. Paths have length L = N.
    """
    return TreeSpec(*torch.ops.peagle.tree_select(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes))


def tree_build_parallel(draft_probs: Tensor, topk: list[int], num_nodes: int) -> TreeSpec:
    """P-EAGLE parallel draft tree from the K per-depth distributions of ONE drafter pass.

    The top-``topk[d]`` tokens of depth d's distribution (ties to the smaller id) are the children of every depth-d
    node: a Cartesian candidate tree whose path score is the product of the draft probabilities. The best
    ``num_nodes`` nodes are kept. ``topk = [1] * K`` gives the greedy chain. Paths have length L = min(N, K + 1).
    Entries must be probabilities in [0, 1] (rows need not sum to 1), so that no child outscores its parent.
    """
    return TreeSpec(*torch.ops.peagle.tree_build_parallel(draft_probs, list(topk), num_nodes))


def tree_expand_topk(frontier_scores: Tensor, child_probs: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """One EAGLE-2 expansion step: each frontier node proposes its top-k children with score = its score * p.

    Args:
        frontier_scores: [B, F] path scores of the frontier nodes (float64 recommended).
        child_probs: [B, F, V] float32 draft distributions after each frontier node (entries in [0, 1]).

    Returns:
        tokens, frontier_slot, scores: [B, F * topk] candidates sorted best first (score, then slot-major order).
    """
    return torch.ops.peagle.tree_expand_topk(frontier_scores, child_probs, topk)


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


def _spec_fake(ref: Tensor, batch, nodes: int, path_len: int):
    words = (nodes + 31) // 32
    long = torch.long
    return (
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, dtype=long),
        ref.new_empty(batch, nodes, dtype=torch.float64),
        ref.new_empty(batch, nodes, nodes, dtype=torch.bool),
        ref.new_empty(batch, nodes, words, dtype=torch.int32),
        ref.new_empty(batch, nodes, path_len, dtype=long),
        ref.new_empty(batch, dtype=long),
    )


@torch.library.register_fake("peagle::tree_select")
def _tree_select_fake(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes):
    return _spec_fake(cand_tokens, cand_tokens.shape[0], num_nodes, num_nodes)


@torch.library.register_fake("peagle::tree_build_parallel")
def _tree_build_parallel_fake(draft_probs, topk, num_nodes):
    return _spec_fake(draft_probs, draft_probs.shape[0], num_nodes, min(num_nodes, draft_probs.shape[1] + 1))


@torch.library.register_fake("peagle::tree_expand_topk")
def _tree_expand_topk_fake(frontier_scores, child_probs, topk):
    batch, width = child_probs.shape[0], child_probs.shape[1]
    return (
        child_probs.new_empty(batch, width * topk, dtype=torch.long),
        child_probs.new_empty(batch, width * topk, dtype=torch.long),
        child_probs.new_empty(batch, width * topk, dtype=torch.float64),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Pure-PyTorch references (the executable spec): the same trees as the kernels of csrc/cpu/tree_build_cpu.cpp.


def ancestor_mask(parent: Tensor) -> Tensor:
    """[B, n, n] bool: ``mask[b, i, j]`` = node j is node i or one of its ancestors (``parent[b, i]`` in [-1, i)).

    The tree attention mask, as :attr:`TreeSpec.mask` holds it for built trees. Transitive closure of the parent
    relation by repeated squaring (log2 n boolean matmuls, no loop over nodes).
    """
    nodes = parent.shape[1]
    index = torch.arange(nodes, device=parent.device)
    reach = (parent[:, :, None] == index) | (index[:, None] == index)  # self or parent
    for _ in range(max(1, (nodes - 1).bit_length())):
        reach = reach | (reach.float() @ reach.float() > 0)
    return reach


def _stable_order(*keys: Tensor) -> Tensor:
    """Row-wise permutation sorting by keys[0], then keys[1], ... (ascending), ties by index."""
    order = torch.arange(keys[0].shape[1], device=keys[0].device).expand_as(keys[0])
    for key in reversed(keys):
        order = order.gather(1, torch.sort(key.gather(1, order), dim=1, stable=True).indices)
    return order


def tree_select_reference(
    cand_tokens: Tensor, cand_parent: Tensor, cand_scores: Tensor, num_candidates: Tensor, num_nodes: int
) -> TreeSpec:
    """Reference of :func:`tree_select` (no input validation)."""
    return _select_reference(
        cand_tokens.long(), cand_parent.long(), cand_scores.double(), num_candidates.long(), num_nodes, num_nodes
    )


def _select_reference(tok: Tensor, par: Tensor, sc: Tensor, count: Tensor, nodes: int, path_len: int) -> TreeSpec:
    if tok.shape[1] < nodes:  # pad with invalid candidates so that every output slot has a source column
        pad = nodes - tok.shape[1]
        tok = torch.nn.functional.pad(tok, (0, pad), value=-1)
        par = torch.nn.functional.pad(par, (0, pad), value=-1)
        sc = torch.nn.functional.pad(sc, (0, pad), value=0.0)
    batch, m = tok.shape
    device = tok.device
    idx = torch.arange(m, device=device).expand(batch, m)
    valid = idx < count[:, None]
    safe_par = torch.where(valid & (idx > 0), par, 0).clamp(0, m - 1)
    depth = torch.zeros(batch, m, dtype=torch.long, device=device)
    for _ in range(m):
        new = torch.where(idx > 0, depth.gather(1, safe_par) + 1, 0)
        if torch.equal(new, depth):
            break
        depth = new
    # Selection: root first, then by score (desc) and index; invalid candidates last.
    rank_order = _stable_order((~valid).long(), (idx > 0).long(), -sc)
    rank = torch.empty_like(rank_order).scatter_(1, rank_order, idx)
    keep = torch.minimum(count, torch.tensor(nodes, device=device))
    selected = valid & (rank < keep[:, None])
    out_order = _stable_order((~selected).long(), depth, -sc)[:, :nodes]  # [B, N] candidate index per output slot
    slot_valid = torch.arange(nodes, device=device)[None, :] < keep[:, None]
    new_index = torch.full((batch, m), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, out_order, torch.arange(nodes, device=device).expand(batch, nodes))
    new_index = torch.where(selected, new_index, -1)

    def take(values: Tensor, fill):
        return torch.where(slot_valid, values.gather(1, out_order), fill)

    tokens = take(tok, -1)
    depth_out = take(depth, -1)
    scores = take(sc, 0.0)
    parent = take(torch.where(idx > 0, new_index.gather(1, safe_par), -1), -1)
    mask = ancestor_mask(parent) & slot_valid[..., None]  # padding slots (parent -1) keep no row
    words = (nodes + 31) // 32
    padded = torch.zeros(batch, nodes, words * 32, dtype=torch.long, device=device)
    padded[..., :nodes] = mask.long()
    packed = (padded.view(batch, nodes, words, 32) << torch.arange(32, device=device)).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).int()
    # Leaves in node order; path position of an ancestor = its depth.
    has_child = torch.zeros(batch, nodes + 1, dtype=torch.bool, device=device)
    has_child.scatter_(1, torch.where(parent >= 0, parent, nodes), True)
    leaf = slot_valid & ~has_child[:, :nodes]
    num_paths = leaf.sum(1)
    leaf_rank = torch.where(leaf, leaf.long().cumsum(1) - 1, nodes)  # row of each leaf in paths
    paths = torch.full((batch, nodes + 1, path_len), -1, dtype=torch.long, device=device)
    # For each (leaf i, ancestor j): paths[b, leaf_rank[i], depth[j]] = j.
    b_idx, i_idx, j_idx = torch.nonzero(mask & leaf[..., None], as_tuple=True)
    paths[b_idx, leaf_rank[b_idx, i_idx], depth_out[b_idx, j_idx]] = j_idx
    return TreeSpec(tokens, parent, depth_out, keep, scores, mask, packed, paths[:, :nodes], num_paths)


def _topk_stable(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k (values, ids) along the last dim, ties to the smaller id."""
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def tree_build_parallel_reference(draft_probs: Tensor, topk: list[int], num_nodes: int) -> TreeSpec:
    """Reference of :func:`tree_build_parallel`."""
    batch, depths, _ = draft_probs.shape
    device = draft_probs.device
    tokens = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    scores = [torch.ones(batch, 1, dtype=torch.float64, device=device)]
    level_start, level_count = 0, 1
    for d, k in enumerate(topk):
        values, ids = _topk_stable(draft_probs[:, d], k)
        tokens.append(ids.repeat(1, level_count))
        parents.append((level_start + torch.arange(level_count, device=device)).repeat_interleave(k).expand(batch, -1))
        scores.append((scores[-1][:, :, None] * values.double()[:, None, :]).reshape(batch, level_count * k))
        level_start += level_count
        level_count *= k
    tok, par, sc = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
    count = torch.full((batch,), tok.shape[1], dtype=torch.long, device=device)
    return _select_reference(tok, par, sc, count, num_nodes, min(num_nodes, depths + 1))


def tree_expand_topk_reference(
    frontier_scores: Tensor, child_probs: Tensor, topk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of :func:`tree_expand_topk`."""
    batch, width, _ = child_probs.shape
    values, ids = _topk_stable(child_probs, topk)
    m = width * topk  # explicit: an empty batch has no -1 to infer
    scores = (frontier_scores.double()[:, :, None] * values.double()).reshape(batch, m)
    order = _stable_order(-scores)
    slots = torch.arange(width, device=child_probs.device).repeat_interleave(topk).expand(batch, m)
    return ids.reshape(batch, m).gather(1, order), slots.gather(1, order), scores.gather(1, order)
