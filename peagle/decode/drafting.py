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

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from peagle.decode.harness.policy import DepthStepper
from peagle.decode.kv_cache import PagedKVCache
from peagle.decode.sampling import draft_distribution, gumbel_order
from peagle.model import PEagleDrafter
from peagle.model.drafter import window_visible
from peagle.ops import HarnessState, TreeSpec, ancestor_mask, tree_build_parallel, tree_expand_topk, tree_select

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

    def depth(self, rows: Tensor) -> int: ...

    def topk(self, depth: int) -> list[int]: ...

    def select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec: ...


class DepthPlanner(Protocol):
    """What autoregressive drafting asks a harness (:class:`peagle.decode.harness.DepthHarness` implements it)."""

    max_width: int
    state: HarnessState

    def start(self, rows: Tensor) -> None: ...

    def chain_depth(self, rows: Tensor) -> int: ...

    def frontier_width(self, cap: int) -> int: ...

    def decide(self, candidate_scores: Tensor, depth: int) -> None: ...

    def finalize(self, tokens: Tensor, parent: Tensor, scores: Tensor, chosen: Tensor) -> TreeSpec: ...


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
    def set_pending(self, rows: Tensor, host_rows: list[int], tokens: Tensor, aux: Tensor, counts: list[int]) -> None:
        """The next pass's new elements of ``rows``: tokens [b, m] (target ids) paired with target aux states
        [b, m, num_aux * H]; the first ``counts[b]`` of them are real."""
        width = tokens.shape[1]
        if width > self.pending_tokens.shape[1]:
            grow = width - self.pending_tokens.shape[1]
            self.pending_tokens = torch.nn.functional.pad(self.pending_tokens, (0, grow))
            self.pending_feats = torch.nn.functional.pad(self.pending_feats, (0, 0, 0, grow))
        self.pending_tokens[rows, :width] = tokens.long()
        self.pending_feats[rows, :width] = self.drafter.project(aux.to(self.dtype))
        for r, c in zip(host_rows, counts, strict=True):
            self.host_pending[r] = c

    def _context(self, rows: Tensor, host_rows: list[int]) -> tuple[list[tuple[Tensor, Tensor]], Tensor, Tensor]:
        """Committed keys/values of every layer [b, C, ...], which of the C slots are committed [b, C] and their
        positions [b, C]. With a sliding window W only the blocks of the last max(W - 1, 1) committed positions are
        read (all a new element or a drafted node can see: keys after its position - W, and its anchor), so a pass
        costs the same at any context length."""
        seq = self.cache.seq_len[rows]
        window = self.config.sliding_window
        if window is None:
            length = self.cache.padded_len(host_rows)
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
            topk = harness.topk(depths)
            spec = harness.select(rows, tree_build_parallel(probs, topk, self.max_nodes), depths, sampling.gumbel)
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

    @torch.no_grad()
    def draft(
        self, rows: Tensor, host_rows: list[int], roots: Tensor, sampling: Sampling, harness: DepthPlanner | None = None
    ) -> DraftTree:
        """The round's tree; with a ``harness`` (:class:`peagle.decode.harness.DepthHarness`) greedy rounds draft
        depth by depth under its decisions, and sampled rounds draft the chain length it fixed last round."""
        logits, hidden = self._pass(rows, host_rows, 0, 1)
        root_probs = draft_distribution(logits[:, 0], sampling.temperature)
        steps = _Steps(self, rows, host_rows, hidden[:, 0])
        if harness is not None:
            harness.start(rows)
            if sampling.gumbel:
                length = harness.chain_depth(rows)
                return steps.grow(roots, root_probs, 1, length + 1, sampling, max_depth=length)
            return self._from_spec(roots, steps.harness_stepper(root_probs, harness, sampling.temperature).run())
        if self.mode == "tree" and not sampling.gumbel:
            step = steps.eagle2_step(root_probs, self.topk, sampling.temperature)
            spec = eagle2_dynamic_tree(root_probs, step, self.depth, self.topk, self.num_nodes)
            return self._from_spec(roots, spec)
        # Chains (a tree of top-1 children) and sampled trees: shapes decided depth by depth, never pruned later.
        topk, budget = (1, self.depth + 1) if self.mode == "chain" else (self.topk, self.num_nodes)
        return steps.grow(roots, root_probs, topk, budget, sampling)


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
        owner = self.owner
        batch, width = tokens.shape
        eye = torch.eye(width, dtype=torch.bool, device=tokens.device).expand(batch, -1, -1)
        positions = (self.root_position + depth)[:, None].expand(-1, width)
        # A node sees its ancestors, and of the committed keys those in its window and the root's element (its anchor).
        anchor = self.root_position[:, None].expand(-1, width)
        window = owner.config.sliding_window
        committed = self.committed[:, None, :] & window_visible(positions, self.key_positions, anchor, window)
        mask = torch.cat([committed, sees, eye], dim=2)
        context = [
            (torch.cat([k, tk], 1), torch.cat([v, tv], 1))
            for (k, v), (tk, tv) in zip(self.context, self.temp, strict=True)
        ]
        logits, hidden, new_kv = owner.drafter.forward_cached(owner.draft_ids[tokens], feats, positions, context, mask)
        self.temp = [
            (torch.cat([tk, k], 1), torch.cat([tv, v], 1)) for (tk, tv), (k, v) in zip(self.temp, new_kv, strict=True)
        ]
        return logits, hidden

    def harness_stepper(self, root_probs: Tensor, harness: DepthPlanner, temperature: float) -> DepthStepper:
        """The harness's depth-by-depth drafting as a :class:`~peagle.decode.harness.DepthStepper`.

        Step d runs the drafter on the nodes depth d chose (step 0: the root's distribution is known), expands their
        top children by path score (:func:`tree_expand_topk`; children of slots a request did not choose score 0 and
        are padding), and lets ``harness.decide`` choose how many of the best candidates become depth d + 1's nodes.
        The finalize step keeps the verify budget of the chosen nodes."""
        batch, device = root_probs.shape[0], root_probs.device
        cap = min(harness.max_width, root_probs.shape[1])
        levels: list[dict[str, Tensor]] = []
        state = {"count": 1}

        def step(depth: int) -> None:
            if depth == 0:
                probs, scores = root_probs[:, None], torch.ones(batch, 1, dtype=torch.float64, device=device)
                hidden, sees = self.root_hidden[:, None], torch.zeros(batch, 1, 0, dtype=torch.bool, device=device)
                index = torch.zeros(batch, 1, dtype=torch.long, device=device)
            else:
                level = levels[-1]
                width = harness.frontier_width(cap)
                tokens, feats, sees = level["tokens"][:, :width], level["feats"][:, :width], level["sees"][:, :width]
                scores = torch.where(level["chosen"][:, :width], level["scores"][:, :width], 0.0)
                logits, hidden = self.run(tokens, feats, depth, sees)
                probs = draft_distribution(logits, temperature)
                own = torch.eye(width, dtype=torch.bool, device=device).expand(batch, -1, -1)
                sees = torch.cat([sees, own], dim=2)
                index = level["index"][:, :width]
            tokens, slot, cand = tree_expand_topk(scores, probs, cap)
            tokens, slot, cand = tokens[:, :cap], slot[:, :cap], cand[:, :cap]
            harness.decide(torch.where(cand > 0, cand, -torch.inf), depth + 1)
            chosen = torch.arange(cand.shape[1], device=device)[None, :] < harness.state.width[:, None]
            width = cand.shape[1]
            levels.append(
                {
                    "tokens": tokens,
                    "parent": index.gather(1, slot),
                    "scores": cand,
                    "chosen": chosen,
                    "index": state["count"] + torch.arange(width, device=device).expand(batch, width),
                    "feats": hidden.gather(1, slot[..., None].expand(-1, -1, hidden.shape[2])),
                    "sees": sees.gather(1, slot[..., None].expand(-1, -1, sees.shape[2])),
                }
            )
            state["count"] += width

        def finalize() -> TreeSpec:
            root = torch.ones(batch, 1, dtype=torch.bool, device=device)
            tokens = torch.cat(
                [torch.full((batch, 1), -1, dtype=torch.long, device=device)] + [lv["tokens"] for lv in levels], 1
            )
            parent = torch.cat(
                [torch.full((batch, 1), -1, dtype=torch.long, device=device)] + [lv["parent"] for lv in levels], 1
            )
            scores = torch.cat(
                [torch.ones(batch, 1, dtype=torch.float64, device=device)] + [lv["scores"] for lv in levels], 1
            )
            chosen = torch.cat([root] + [lv["chosen"] for lv in levels], 1)
            return harness.finalize(tokens, parent, torch.where(chosen, scores, 0.0), chosen)

        steps = [lambda d=d: step(d) for d in range(self.owner.depth)]
        return DepthStepper(steps, finalize, harness.state.go)

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
