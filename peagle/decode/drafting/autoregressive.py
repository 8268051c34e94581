"""Autoregressive drafting node by node (an EAGLE-3 drafter, K = 1): the drafter's forward over drafted nodes
(temporary cache entries a round drops), the steps of one round (:class:`NodeSteps`: chains, trees grown depth by
depth, the draft step of an EAGLE-2 dynamic tree) and :func:`eagle2_dynamic_tree`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from peagle.decode.drafting.base import CachedDrafter, DraftTree, Sampling, node_tree
from peagle.decode.sampling import draft_distribution, gumbel_order
from peagle.model.drafter import window_visible
from peagle.ops import TreeSpec, tree_expand_topk, tree_select

__all__ = ["NodeSteps", "eagle2_dynamic_tree", "node_forward"]


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


def node_forward(
    owner: CachedDrafter,
    context: list[tuple[Tensor, Tensor]],
    committed: Tensor,
    key_positions: Tensor,
    root_position: Tensor,
    tokens: Tensor,
    feats: Tensor,
    depth: int,
    sees: Tensor,
) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """The drafter on w drafted nodes (draft ids [b, w], features [b, w, H]) at ``depth`` below the root element at
    ``root_position`` [b]. ``context`` per layer: the C committed keys/values (``committed`` [b, C] marks the real ones,
    at ``key_positions`` [b, C]) then the T temporary entries of earlier drafted nodes, of which ``sees`` [b, w, T]
    marks each node's ancestors. Returns logits [b, w, Vd], hidden [b, w, H] and the nodes' keys/values per layer."""
    batch, width = tokens.shape
    eye = torch.eye(width, dtype=torch.bool, device=tokens.device).expand(batch, -1, -1)
    positions = (root_position + depth)[:, None].expand(-1, width)
    # A node sees its ancestors, and of the committed keys those in its window and the root's element (its anchor).
    anchor = root_position[:, None].expand(-1, width)
    window = owner.config.sliding_window
    visible = committed[:, None, :] & window_visible(positions, key_positions, anchor, window)
    mask = torch.cat([visible, sees, eye], dim=2)
    return owner.drafter.forward_cached(owner.draft_ids[tokens], feats, positions, context, mask)


class NodeSteps:
    """One round of autoregressive drafting: temporary entries of drafted nodes and their hidden states."""

    def __init__(self, owner: CachedDrafter, rows: Tensor, host_rows: list[int], root_hidden: Tensor) -> None:
        self.owner = owner
        self.context, self.committed, self.key_positions = owner.context(rows, host_rows)
        self.root_position = owner.cache.seq_len[rows] - 1  # the last committed element drafts the root's children
        # Temporary entries of the drafted nodes, per layer [b, T, kv_heads, head_dim].
        self.temp: list[tuple[Tensor, Tensor]] = [(k[:, :0], v[:, :0]) for k, v in self.context]
        self.root_hidden = root_hidden

    def run(self, tokens: Tensor, feats: Tensor, depth: int, sees: Tensor) -> tuple[Tensor, Tensor]:
        """Drafter on w new nodes (draft ids [b, w], features [b, w, H]) at ``depth``; ``sees`` [b, w, T] marks the
        temporary entries of their ancestors. Returns logits [b, w, Vd] and hidden [b, w, H]; their entries join the
        temporary ones."""
        context = [
            (torch.cat([k, tk], 1), torch.cat([v, tv], 1))
            for (k, v), (tk, tv) in zip(self.context, self.temp, strict=True)
        ]
        logits, hidden, new_kv = node_forward(
            self.owner, context, self.committed, self.key_positions, self.root_position, tokens, feats, depth, sees
        )
        self.temp = [
            (torch.cat([tk, k], 1), torch.cat([tv, v], 1)) for (tk, tv), (k, v) in zip(self.temp, new_kv, strict=True)
        ]
        return logits, hidden

    def eagle2_step(self, root_probs: Tensor, topk: int, temperature: float):
        """The ``draft_step`` of :func:`eagle2_dynamic_tree`. It is told the new frontier's tokens only, so
        it repeats the expansion (deterministic) to learn each frontier node's parent."""
        batch, device = root_probs.shape[0], root_probs.device
        state = {
            "scores": torch.ones(batch, 1, dtype=torch.float64, device=device),
            "probs": root_probs[:, None],
            "hidden": self.root_hidden[:, None],  # [b, F, H] of the frontier
            "sees": torch.zeros(batch, 1, 0, dtype=torch.bool, device=device),  # [b, F, T] ancestors' entries
            "depth": 0,
        }

        def draft_step(tokens: Tensor, candidate_index: Tensor) -> Tensor:
            _, slot, scores = tree_expand_topk(state["scores"], state["probs"], topk)
            width = tokens.shape[1]
            slot = slot[:, :width]
            feats = state["hidden"].gather(1, slot[..., None].expand(-1, -1, state["hidden"].shape[2]))
            sees = state["sees"].gather(1, slot[..., None].expand(-1, -1, state["sees"].shape[2]))
            state["depth"] += 1
            logits, hidden = self.run(tokens, feats, state["depth"], sees)
            own = torch.eye(width, dtype=torch.bool, device=device).expand(batch, -1, -1)
            state.update(scores=scores[:, :width], hidden=hidden, sees=torch.cat([sees, own], dim=2))
            state["probs"] = draft_distribution(logits, temperature)
            return state["probs"]

        return draft_step

    def grow(
        self,
        roots: Tensor,
        root_probs: Tensor,
        topk: int,
        budget: int,
        sampling: Sampling,
        max_depth: int | None = None,
    ) -> DraftTree:
        """A tree grown depth by depth: the best ``topk`` nodes of a depth (by path probability) each get up to
        ``topk`` children (top-k, or draws when sampling) while the budget lasts; no node is pruned afterwards."""
        owner = self.owner
        batch, device = roots.shape[0], roots.device
        arange = torch.arange(batch, device=device)[:, None]

        def pick(probs: Tensor, count: int, depth: int) -> Tensor:  # [b, w, V] -> [b, w, count] draft ids
            if sampling.gumbel:
                first = depth * owner.config.draft_vocab_size * max(topk, 1)
                return gumbel_order(probs, count, sampling.seeds, sampling.offset, first)
            return torch.topk(probs, count, dim=-1).indices

        first = min(topk, budget - 1)
        tokens = [pick(root_probs[:, None], first, 0)[:, 0]]  # draft ids per level
        scores = [root_probs.double().gather(1, tokens[0])]
        parents = [torch.zeros(batch, first, dtype=torch.long, device=device)]
        node_probs = [root_probs[:, None]]  # distributions of the nodes that have children (node order)
        level_hidden = self.root_hidden[:, None].expand(-1, first, -1)  # features of the level's nodes (parent's)
        level_sees = torch.zeros(batch, first, 0, dtype=torch.bool, device=device)
        start, total = 1, 1 + first
        for depth in range(1, self.owner.depth if max_depth is None else max_depth):
            counts = [min(topk, budget - total - j * topk) for j in range(min(topk, tokens[-1].shape[1]))]
            counts = [c for c in counts if c > 0]
            if not counts:
                break
            order = torch.sort(-scores[-1], dim=1, stable=True).indices[:, : len(counts)]  # frontier: best first
            frontier_tokens = tokens[-1].gather(1, order)
            feats = level_hidden.gather(1, order[..., None].expand(-1, -1, level_hidden.shape[2]))
            sees = level_sees.gather(1, order[..., None].expand(-1, -1, level_sees.shape[2]))
            logits, hidden = self.run(frontier_tokens, feats, depth, sees)
            probs = draft_distribution(logits, sampling.temperature)
            children = pick(probs, max(counts), depth)  # [b, F, max(counts)]
            rank = torch.tensor([j for j, c in enumerate(counts) for _ in range(c)], device=device)
            sib = torch.tensor([s for c in counts for s in range(c)], device=device)
            new_tokens = children[:, rank, sib]
            new_scores = scores[-1].gather(1, order)[:, rank] * probs.double()[arange, rank, new_tokens]
            parents.append(start + order[:, rank])
            tokens.append(new_tokens)
            scores.append(new_scores)
            # Node order within a level is the order of the level's nodes; record the frontier's distributions there.
            level_probs = probs.new_zeros(batch, scores[-2].shape[1], probs.shape[2])
            level_probs.scatter_(1, order[..., None].expand(-1, -1, probs.shape[2]), probs)
            node_probs.append(level_probs)
            own = torch.eye(len(counts), dtype=torch.bool, device=device).expand(batch, -1, -1)
            level_hidden = hidden[:, rank]
            level_sees = torch.cat([sees, own], dim=2)[:, rank]
            start += scores[-2].shape[1]
            total += new_tokens.shape[1]
        all_tokens = owner.draft_ids[torch.cat(tokens, 1)]
        parent = torch.cat([torch.full((batch, 1), -1, dtype=torch.long, device=device), *parents], 1)
        depth = torch.cat(
            [
                torch.full((batch, t.shape[1]), d, dtype=torch.long, device=device)
                for d, t in enumerate([roots[:, None], *tokens])
            ],
            1,
        )
        draft_probs = None
        if sampling.gumbel:
            levels = torch.cat(node_probs, 1)  # a row per node of every level but the last (its leaves: padding)
            draft_probs = torch.nn.functional.pad(levels, (0, 0, 0, parent.shape[1] - levels.shape[1]))
            draft_probs = owner.full_vocab(draft_probs)
        return node_tree(roots, all_tokens, parent, depth, draft_probs)
