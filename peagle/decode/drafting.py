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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from peagle.decode.harness.graphs import GraphChainCache
from peagle.decode.harness.policy import DepthRound, DepthStepper
from peagle.decode.kv_cache import PagedKVCache
from peagle.decode.sampling import draft_distribution, gumbel_order
from peagle.model import PEagleDrafter
from peagle.model.drafter import window_visible
from peagle.ops import (
    TreeSpec,
    ancestor_mask,
    tree_build_parallel,
    tree_expand_topk,
    tree_expand_topk_reference,
    tree_select,
)

__all__ = ["DraftTree", "Eagle3Drafting", "PEagleDrafting", "eagle2_dynamic_tree", "root_tree"]

# Drafter elements per pass when committing a long prompt.
PREFILL_CHUNK = 256


class DraftTree(NamedTuple):
    """A batch of draft trees as the target verifies them (padding nodes beyond num_nodes[b])."""

    tokens: Tensor  # [b, n] int64 target ids; node 0 = the root (the last emitted token)
    parent: Tensor  # [b, n] int64, -1 at the root and on padding
    depth: Tensor  # [b, n] int64
    num_nodes: Tensor  # [b] int64
    mask: Tensor  # [b, n, n] bool, node j is node i or an ancestor of it
    draft_probs: Tensor | None  # [b, n, V] the distribution node i's children were drawn from; None: deterministic


class PassPlanner(Protocol):
    """What P-EAGLE drafting asks a harness (:class:`peagle.decode.harness.PassHarness` implements it)."""

    candidates: int  # the candidate tree's nodes, root included (select keeps at most the verify limit of them)

    def depth(self, rows: Tensor) -> int: ...

    def topk(self, depth: int, sampled: bool) -> list[int]: ...

    def select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec: ...


class DepthPlanner(Protocol):
    """What autoregressive drafting asks a harness (:class:`peagle.decode.harness.DepthHarness` implements it)."""

    max_width: int
    chain_mode: str
    chain_report: str

    def padded(self, rows: Tensor) -> int: ...

    def start(self, rows: Tensor) -> DepthRound: ...

    def chain_depth(self, rows: Tensor) -> int: ...


class Sampling(NamedTuple):
    """How a round drafts: temperature (0 = greedy), stochastic drafts, the requests' seeds and the stream offset."""

    temperature: float
    gumbel: bool
    seeds: Tensor | list[int]
    offset: int


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


def root_tree(roots: Tensor) -> DraftTree:
    """Trees of the root alone (target-only decoding)."""
    batch, device = roots.shape[0], roots.device
    return DraftTree(
        roots[:, None].long(),
        torch.full((batch, 1), -1, dtype=torch.long, device=device),
        torch.zeros(batch, 1, dtype=torch.long, device=device),
        torch.ones(batch, dtype=torch.long, device=device),
        torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
        None,
    )


def _node_tree(roots: Tensor, tokens: Tensor, parent: Tensor, depth: Tensor, draft_probs: Tensor | None) -> DraftTree:
    """A tree from per-node arrays (node 0 = root; tokens are target ids of nodes 1..)."""
    batch = roots.shape[0]
    tokens = torch.cat([roots[:, None].long(), tokens], dim=1)
    num_nodes = torch.full((batch,), tokens.shape[1], dtype=torch.long, device=roots.device)
    return DraftTree(tokens, parent, depth, num_nodes, ancestor_mask(parent), draft_probs)


def _sibling_rank(parent: Tensor) -> Tensor:
    """Rank of each node among its siblings in node order [b, n]."""
    index = torch.arange(parent.shape[1], device=parent.device)
    earlier = (parent[:, :, None] == parent[:, None, :]) & (index[None, None, :] < index[None, :, None])
    return earlier.sum(-1)


class _CachedDrafter:
    """The drafter's committed cache, pending elements and the batched pass over them (shared by both methods)."""

    def __init__(
        self, drafter: PEagleDrafter, target_vocab: int, mode: str, depth: int, topk: int | list[int], num_nodes: int
    ) -> None:
        self.mode, self.depth, self.topk, self.num_nodes = mode, depth, topk, num_nodes
        self.drafter = drafter.eval()
        self.config = drafter.config
        self.device = drafter.fc.weight.device
        self.dtype = drafter.fc.weight.dtype
        self.draft_ids = drafter.draft_ids().to(self.device)
        self.target_vocab = target_vocab
        self.cache: PagedKVCache | None = None

    @property
    def max_nodes(self) -> int:
        """Nodes of a round's tree, root included: depth + 1 for a chain, the node budget for a tree."""
        return self.depth + 1 if self.mode == "chain" else self.num_nodes

    def allocate(self, num_requests: int, capacity: int, pending_width: int, block_size: int) -> None:
        cfg = self.config
        self.cache = PagedKVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_requests, capacity, block_size, self.dtype, self.device
        )
        self.pending_tokens = torch.zeros(num_requests, pending_width, dtype=torch.long, device=self.device)
        self.pending_feats = torch.zeros(
            num_requests, pending_width, cfg.hidden_size, dtype=self.dtype, device=self.device
        )
        self.host_pending = [0] * num_requests
        with torch.no_grad():
            self.mask_feat = self.drafter.projected_mask_hidden()

    @torch.no_grad()
    def set_pending(
        self, rows: Tensor, host_rows: list[int], tokens: Tensor, aux: Tensor, counts: list[int], append: bool = False
    ) -> None:
        """The next pass's new elements of ``rows``: tokens [b, m] (target ids) paired with target aux states
        [b, m, num_aux * H]; the first ``counts[b]`` of them are real. ``append``: after the elements already pending
        (rounds that did not draft: the next pass catches up on them, in chunks when they are many)."""
        offsets = [self.host_pending[r] if append else 0 for r in host_rows]
        width = tokens.shape[1] + max(offsets)
        if width > self.pending_tokens.shape[1]:
            grow = width - self.pending_tokens.shape[1]
            self.pending_tokens = torch.nn.functional.pad(self.pending_tokens, (0, grow))
            self.pending_feats = torch.nn.functional.pad(self.pending_feats, (0, 0, 0, grow))
        feats = self.drafter.project(aux.to(self.dtype))
        if append:
            columns = torch.arange(tokens.shape[1], device=self.device)
            slots = torch.tensor(offsets, device=self.device)[:, None] + columns
            self.pending_tokens[rows[:, None], slots] = tokens.long()
            self.pending_feats[rows[:, None], slots] = feats
        else:
            self.pending_tokens[rows, : tokens.shape[1]] = tokens.long()
            self.pending_feats[rows, : tokens.shape[1]] = feats
        for r, offset, c in zip(host_rows, offsets, counts, strict=True):
            self.host_pending[r] = offset + c

    def _context(
        self, rows: Tensor, host_rows: list[int] | None, length: int | None = None
    ) -> tuple[list[tuple[Tensor, Tensor]], Tensor, Tensor]:
        """Committed keys/values of every layer [b, C, ...], which of the C slots are committed [b, C] and their
        positions [b, C]. With a sliding window W only the blocks of the last max(W - 1, 1) committed positions are
        read (all a new element or a drafted node can see: keys after its position - W, and its anchor), so a pass
        costs the same at any context length. Without one, C = ``length`` (a multiple of the block size; default the
        longest of ``host_rows``, padded to whole blocks)."""
        seq = self.cache.seq_len[rows]
        window = self.config.sliding_window
        if window is None:
            length = self.cache.padded_len(host_rows) if length is None else length
            blocks = self.cache.context_blocks(rows, length)
            positions = torch.arange(length, device=self.device)[None, :].expand(rows.numel(), -1)
        else:
            keep = max(window - 1, 1)
            blocks, positions = self.cache.window_blocks(rows, (seq - keep).clamp(min=0), keep)
        context = [self.cache.read(layer, blocks) for layer in range(self.config.num_layers)]
        return context, positions < seq[:, None], positions

    def _pass(self, rows: Tensor, host_rows: list[int], num_mask: int, logit_rows: int) -> tuple[Tensor, Tensor]:
        """Runs the pending elements (committing them) then ``num_mask`` mask elements per request.

        Returns the logits [b, logit_rows, draft_vocab] and hidden states [b, logit_rows, H] of the last pending
        element and the ``logit_rows - 1`` elements after it."""
        host_counts = [self.host_pending[r] for r in host_rows]
        tokens, feats = self.pending_tokens[rows], self.pending_feats[rows]
        host_done = [max(0, c - PREFILL_CHUNK) for c in host_counts]
        if max(host_done) > 0:  # long prompts: commit all but the last PREFILL_CHUNK elements first, a chunk per pass
            done = torch.tensor(host_done, device=self.device)
            for start in range(0, max(host_done), PREFILL_CHUNK):
                part = [min(max(d - start, 0), PREFILL_CHUNK) for d in host_done]
                piece = slice(start, start + PREFILL_CHUNK)
                self._run(rows, host_rows, tokens[:, piece], feats[:, piece], part, 0, None)
            shift = (done[:, None] + torch.arange(PREFILL_CHUNK, device=self.device)).clamp(max=tokens.shape[1] - 1)
            tokens, feats = tokens.gather(1, shift), feats.gather(1, shift[..., None].expand(-1, -1, feats.shape[2]))
            host_counts = [c - d for c, d in zip(host_counts, host_done, strict=True)]
        index = (
            torch.tensor(host_counts, device=self.device)[:, None] - 1 + torch.arange(logit_rows, device=self.device)
        )
        return self._run(rows, host_rows, tokens, feats, host_counts, num_mask, index)

    def _run(
        self,
        rows: Tensor,
        host_rows: list[int],
        tokens: Tensor,
        feats: Tensor,
        host_counts: list[int],
        num_mask: int,
        logit_index: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """One pass: ``host_counts[b]`` real elements (tokens [b, m], feats [b, m, H]) then ``num_mask`` mask
        elements; the real ones enter the cache. Logits/hidden at ``logit_index`` [b, k] (None: element 0)."""
        batch = rows.numel()
        width = max(host_counts) + num_mask
        tokens, feats = tokens[:, : max(host_counts)], feats[:, : max(host_counts)]
        counts = torch.tensor(host_counts, device=self.device)
        slot = torch.arange(width, device=self.device)
        tokens = torch.nn.functional.pad(tokens, (0, num_mask))
        feats = torch.nn.functional.pad(feats, (0, 0, 0, num_mask))
        real = slot[None, :] < counts[:, None]
        valid = slot[None, :] < (counts + num_mask)[:, None]
        ids = torch.where(real, tokens, self.config.mask_token_id)
        feats = torch.where(real[..., None], feats, self.mask_feat)
        seq = self.cache.seq_len[rows]
        context, committed, key_positions = self._context(rows, host_rows)
        # Under a sliding window an element sees the keys after its position - W and its own chain from its anchor
        # (the last real element) on, as in training (window_visible; all keys without a window).
        positions = seq[:, None] + slot
        anchor = positions.clamp(max=(seq + counts - 1)[:, None])
        window = self.config.sliding_window
        causal = (slot[:, None] >= slot[None, :])[None] & valid[:, None, :]
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        own = (causal & window_visible(positions, positions, anchor, window)) | eye
        sees = committed[:, None, :] & window_visible(positions, key_positions, anchor, window)
        mask = torch.cat([sees, own], dim=2)
        if logit_index is None:
            logit_index = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        logits, hidden, new_kv = self.drafter.forward_cached(ids, feats, positions, context, mask, logit_index)
        write = self.cache.flat_slots(rows, seq[:, None] + slot, real)
        for layer, (k, v) in enumerate(new_kv):
            self.cache.write(layer, write, k, v)
        self.cache.advance(rows, host_rows, counts, host_counts)
        return logits, hidden

    def _full_vocab(self, probs: Tensor) -> Tensor:
        """Draft-vocabulary probabilities [..., Vd] as target-vocabulary rows [..., V] (zero outside it)."""
        if probs.shape[-1] == self.target_vocab:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.target_vocab)
        return full.index_copy_(-1, self.draft_ids, probs)

    def _from_spec(self, roots: Tensor, spec: TreeSpec, tokens: Tensor | None = None) -> DraftTree:
        """A DraftTree from a TreeSpec over draft ids (``tokens`` replaces the spec's drafted ids)."""
        tokens = spec.tokens if tokens is None else tokens
        target_ids = self.draft_ids[tokens.clamp(min=0)]
        tokens = torch.where(spec.depth > 0, target_ids, roots[:, None].long())
        return DraftTree(tokens, spec.parent, spec.depth.clamp(min=0), spec.num_nodes, spec.mask, None)


class PEagleDrafting(_CachedDrafter):
    """P-EAGLE: ``depth`` per-depth distributions from one pass; chain (one token per depth) or parallel tree."""

    @torch.no_grad()
    def draft(
        self, rows: Tensor, host_rows: list[int], roots: Tensor, sampling: Sampling, harness: PassPlanner | None = None
    ) -> DraftTree:
        """The round's tree; with a ``harness`` (:class:`peagle.decode.harness.PassHarness`) the pass depth, the
        candidate tree's top-k and the verified nodes are its decisions."""
        depths = self.depth if harness is None else harness.depth(rows)
        logits, _ = self._pass(rows, host_rows, depths - 1, depths)
        probs = draft_distribution(logits, sampling.temperature)  # [b, depth, Vd]
        if harness is None:
            topk = [1] * depths if self.mode == "chain" else self.topk
            spec = tree_build_parallel(probs, topk, self.max_nodes)
        else:
            topk = harness.topk(depths, sampling.gumbel)
            spec = harness.select(rows, tree_build_parallel(probs, topk, harness.candidates), depths, sampling.gumbel)
        if not sampling.gumbel:
            return self._from_spec(roots, spec)
        # Shape from the unperturbed distributions; node of sibling rank r at depth d = the r-th draw of depth d.
        draws = gumbel_order(probs, max(topk), sampling.seeds, sampling.offset)  # [b, depth, max(topk)]
        depth = spec.depth.clamp(min=1) - 1
        rank = _sibling_rank(spec.parent).clamp(max=max(topk) - 1)
        tokens = draws[torch.arange(rows.numel(), device=self.device)[:, None], depth, rank]
        tree = self._from_spec(roots, spec, tokens)
        # Node i's children were drawn from depth depth[i]'s distribution (leaves at the last depth have none).
        node_probs = self._full_vocab(probs).gather(
            1, tree.depth.clamp(max=depths - 1)[..., None].expand(-1, -1, self.target_vocab)
        )
        return tree._replace(draft_probs=node_probs)


class Eagle3Drafting(_CachedDrafter):
    """EAGLE-3: autoregressive drafting of a K = 1 drafter; chain of ``depth`` drafts or EAGLE-2 dynamic tree."""

    _rounds: GraphChainCache[_HarnessRound] | None = None  # harness rounds per padded batch size, of one harness
    _rounds_harness: DepthPlanner | None = None

    def allocate(self, num_requests: int, capacity: int, pending_width: int, block_size: int) -> None:
        self._close_rounds()  # their buffers and graphs belong to the old cache
        super().allocate(num_requests, capacity, pending_width, block_size)

    def _close_rounds(self) -> None:
        if self._rounds is not None:
            self._rounds.close()
        self._rounds, self._rounds_harness = None, None

    def _harness_round(self, harness: DepthPlanner, rows: Tensor, temperature: float) -> _HarnessRound:
        """The round buffers and stepper of ``rows``'s padded batch size (built on first use; one generate call's
        harness and temperature)."""
        if self._rounds_harness is not harness:
            self._close_rounds()
            self._rounds = GraphChainCache(lambda padded: _HarnessRound(self, harness, padded, temperature))
            self._rounds_harness = harness
        return self._rounds.get(harness.padded(rows))

    @torch.no_grad()
    def draft(
        self, rows: Tensor, host_rows: list[int], roots: Tensor, sampling: Sampling, harness: DepthPlanner | None = None
    ) -> DraftTree:
        """The round's tree; with a ``harness`` (:class:`peagle.decode.harness.DepthHarness`) greedy rounds draft
        depth by depth under its decisions, and sampled rounds draft the chain length it fixed last round."""
        logits, hidden = self._pass(rows, host_rows, 0, 1)
        root_probs = draft_distribution(logits[:, 0], sampling.temperature)
        if harness is not None and not sampling.gumbel:
            spec = self._harness_round(harness, rows, sampling.temperature).draft(
                rows, host_rows, root_probs, hidden[:, 0]
            )
            return self._from_spec(roots, spec)
        steps = _Steps(self, rows, host_rows, hidden[:, 0])
        if harness is not None:
            length = harness.chain_depth(rows)
            return steps.grow(roots, root_probs, 1, length + 1, sampling, max_depth=length)
        if self.mode == "tree" and not sampling.gumbel:
            step = steps.eagle2_step(root_probs, self.topk, sampling.temperature)
            spec = eagle2_dynamic_tree(root_probs, step, self.depth, self.topk, self.num_nodes)
            return self._from_spec(roots, spec)
        # Chains (a tree of top-1 children) and sampled trees: shapes decided depth by depth, never pruned later.
        topk, budget = (1, self.depth + 1) if self.mode == "chain" else (self.topk, self.num_nodes)
        return steps.grow(roots, root_probs, topk, budget, sampling)


def _node_forward(
    owner: _CachedDrafter,
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


def _expand_topk(scores: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tree_expand_topk`; on CUDA its reference (the same candidates from device ops a CUDA graph can capture:
    outside deferred checks (peagle.ops.errors) the op's CUDA kernel reads its error table back, a synchronisation)."""
    if probs.device.type == "cuda":
        return tree_expand_topk_reference(scores, probs, topk)
    return tree_expand_topk(scores, probs, topk)


class _HarnessRound:
    """The harness's depth-by-depth drafting at one padded batch size: every buffer its steps read or write,
    preallocated once and reset in place each round (:meth:`load`), and the
    :class:`~peagle.decode.harness.DepthStepper` over those steps (CUDA graphs chained on the device on a GPU, captured
    on the first round; the host loop on the CPU).

    Step d runs the drafter on the ``cap`` candidates step d - 1 expanded (those the harness did not choose are
    padding: score 0; step 0 knows the root's distribution), expands their top children by path score
    (:func:`tree_expand_topk`) and lets the harness decide how many of the best become depth d + 1's nodes. The
    finalize step keeps the verify budget of the chosen candidates; the tree is laid out after the chain
    (:meth:`DepthRound.tree`). Keys/values: the committed context (``context_len`` slots; on the GPU always the
    cache capacity or the window, so shapes never change), then ``cap`` temporary entries per drafted depth.
    """

    def __init__(self, owner: Eagle3Drafting, harness: DepthPlanner, padded: int, temperature: float) -> None:
        cfg, cache, device = owner.config, owner.cache, owner.device
        self.owner, self.harness, self.padded, self.temperature = owner, harness, padded, temperature
        self.cap = cap = min(harness.max_width, cfg.draft_vocab_size)
        self.depths = depths = owner.depth
        self.static = device.type == "cuda"  # one context length for every round: graphs can be captured
        if cfg.sliding_window is None:
            self.max_context = cache.capacity
        else:
            self.max_context = (max(cfg.sliding_window - 1, 1) // cache.block_size + 2) * cache.block_size
        self.context_len = self.max_context
        temp = (depths - 1) * cap
        zeros = functools.partial(torch.zeros, device=device)
        kv = (padded, self.max_context + temp, cfg.num_kv_heads, cfg.head_dim)
        self.keys = [zeros(kv, dtype=owner.dtype) for _ in range(cfg.num_layers)]
        self.values = [zeros(kv, dtype=owner.dtype) for _ in range(cfg.num_layers)]
        self.committed = zeros(padded, self.max_context, dtype=torch.bool)
        self.key_positions = zeros(padded, self.max_context, dtype=torch.long)
        self.root_position = zeros(padded, dtype=torch.long)
        self.root_probs = zeros(padded, cfg.draft_vocab_size, dtype=torch.float32)
        self.root_hidden = zeros(padded, cfg.hidden_size, dtype=owner.dtype)
        # Level d: the candidates step d expanded, and what step d + 1 needs of their parents.
        self.tokens = zeros(padded, depths, cap, dtype=torch.long)
        self.parent = zeros(padded, depths, cap, dtype=torch.long)
        self.scores = zeros(padded, depths, cap, dtype=torch.float64)
        self.chosen = zeros(padded, depths, cap, dtype=torch.bool)
        self.feats = zeros(padded, depths, cap, cfg.hidden_size, dtype=owner.dtype)
        self.sees = zeros(padded, depths, cap, temp, dtype=torch.bool)  # ancestors among the temporary entries
        nodes = 1 + depths * cap
        # What finalize keeps: the arguments of tree_select.
        self.kept = (
            zeros(padded, nodes, dtype=torch.long),
            zeros(padded, nodes, dtype=torch.long),
            zeros(padded, nodes, dtype=torch.float64),
            zeros(padded, dtype=torch.long),
        )
        self.round: DepthRound | None = None
        self.stepper: DepthStepper | None = None

    def load(self, rows: Tensor, host_rows: list[int], root_probs: Tensor, root_hidden: Tensor) -> None:
        """Resets every buffer for a round of ``rows`` whose root pass gave ``root_probs`` / ``root_hidden``."""
        owner, count = self.owner, rows.numel()
        self.round = self.harness.start(rows)
        padded_rows = self.round.rows
        length = self.max_context if self.static else owner.cache.padded_len(host_rows)
        context, committed, positions = owner._context(padded_rows, host_rows, length)
        self.context_len = width = committed.shape[1]
        for (k, v), keys, values in zip(context, self.keys, self.values, strict=True):
            keys[:, :width].copy_(k)
            values[:, :width].copy_(v)
        self.committed[:, :width].copy_(committed)
        self.key_positions[:, :width].copy_(positions)
        self.root_position.copy_(owner.cache.seq_len[padded_rows] - 1)
        for buffer, value in ((self.root_probs, root_probs), (self.root_hidden, root_hidden)):
            buffer[:count].copy_(value)
            buffer[count:].copy_(value[:1].expand(self.padded - count, -1))
        self.chosen.zero_()  # levels this round does not reach stay unchosen
        self.scores.zero_()

    def step(self, depth: int) -> None:
        padded, cap, device = self.padded, self.cap, self.root_probs.device
        if depth == 0:
            probs = self.root_probs[:, None]
            scores = torch.ones(padded, 1, dtype=torch.float64, device=device)
            hidden = self.root_hidden[:, None]
            sees = torch.zeros(padded, 1, 0, dtype=torch.bool, device=device)
            index = torch.zeros(padded, 1, dtype=torch.long, device=device)
        else:
            level, context = depth - 1, self.context_len
            start = context + level * cap  # this depth's temporary entries
            sees = self.sees[:, level, :, : level * cap]
            scores = torch.where(self.chosen[:, level], self.scores[:, level], 0.0)
            logits, hidden, new_kv = _node_forward(
                self.owner,
                [(k[:, :start], v[:, :start]) for k, v in zip(self.keys, self.values, strict=True)],
                self.committed[:, :context],
                self.key_positions[:, :context],
                self.root_position,
                self.tokens[:, level],
                self.feats[:, level],
                depth,
                sees,
            )
            for (k, v), keys, values in zip(new_kv, self.keys, self.values, strict=True):
                keys[:, start : start + cap].copy_(k)
                values[:, start : start + cap].copy_(v)
            probs = draft_distribution(logits, self.temperature)
            own = torch.eye(cap, dtype=torch.bool, device=device).expand(padded, -1, -1)
            sees = torch.cat([sees, own], dim=2)
            index = (1 + level * cap + torch.arange(cap, device=device)).expand(padded, cap)
        tokens, slot, cand = _expand_topk(scores, probs, cap)
        tokens, slot, cand = tokens[:, :cap], slot[:, :cap], cand[:, :cap]
        self.round.decide(torch.where(cand > 0, cand, -torch.inf), depth + 1)
        self.tokens[:, depth].copy_(tokens)
        self.parent[:, depth].copy_(index.gather(1, slot))
        self.scores[:, depth].copy_(cand)
        self.chosen[:, depth].copy_(torch.arange(cap, device=device)[None, :] < self.round.state.width[:, None])
        if depth + 1 < self.depths:
            self.feats[:, depth].copy_(hidden.gather(1, slot[..., None].expand(-1, -1, hidden.shape[2])))
            self.sees[:, depth, :, : depth * cap].copy_(sees.gather(1, slot[..., None].expand(-1, -1, sees.shape[2])))

    def finalize(self) -> None:
        padded, device = self.padded, self.root_probs.device
        none = torch.full((padded, 1), -1, dtype=torch.long, device=device)
        tokens = torch.cat([none, self.tokens.flatten(1)], 1)
        parent = torch.cat([none, self.parent.flatten(1)], 1)
        chosen = torch.cat([torch.ones(padded, 1, dtype=torch.bool, device=device), self.chosen.flatten(1)], 1)
        root = torch.ones(padded, 1, dtype=torch.float64, device=device)
        scores = torch.where(chosen, torch.cat([root, self.scores.flatten(1)], 1), 0.0)
        for buffer, value in zip(self.kept, self.round.select(tokens, parent, scores, chosen), strict=True):
            buffer.copy_(value)

    def draft(self, rows: Tensor, host_rows: list[int], root_probs: Tensor, root_hidden: Tensor) -> TreeSpec:
        """The round's candidate tree (draft ids) of ``rows``."""
        self.load(rows, host_rows, root_probs, root_hidden)
        if self.stepper is None:
            steps = [functools.partial(self.step, d) for d in range(self.depths)]
            self.stepper = DepthStepper(steps, self.finalize, self.round.state.go, self.harness.chain_mode)
            self.load(rows, host_rows, root_probs, root_hidden)  # building a graph chain ran every step once
            fallback = self.stepper.fallback
            self.harness.chain_report = self.stepper.mode + (f" ({fallback})" if fallback else "")
        self.stepper.run()
        # A failed tail launch leaves ``kept`` stale: its error first, before tree() trips over the stale buffers (both
        # wait for the chain: the round needs its tree's width on the host anyway).
        self.stepper.check()
        return self.round.tree(*self.kept)

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.close()


class _Steps:
    """One round of autoregressive drafting: temporary entries of drafted nodes and their hidden states."""

    def __init__(self, owner: Eagle3Drafting, rows: Tensor, host_rows: list[int], root_hidden: Tensor) -> None:
        self.owner = owner
        self.context, self.committed, self.key_positions = owner._context(rows, host_rows)
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
        logits, hidden, new_kv = _node_forward(
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
            draft_probs = owner._full_vocab(draft_probs)
        return _node_tree(roots, all_tokens, parent, depth, draft_probs)
