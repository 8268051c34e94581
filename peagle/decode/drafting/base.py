"""What both drafting methods share: the draft trees the target verifies, how a round samples, and
:class:`CachedDrafter`, the drafter's committed cache, its pending elements and the batched pass over them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from peagle.decode.kv_cache import PagedKVCache
from peagle.model import PEagleDrafter
from peagle.model.drafter import window_visible
from peagle.ops import TreeSpec, ancestor_mask

__all__ = ["PREFILL_CHUNK", "CachedDrafter", "DraftTree", "Sampling", "node_tree", "root_tree"]

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


class Sampling(NamedTuple):
    """How a round drafts: temperature (0 = greedy), stochastic drafts, the requests' seeds and the stream offset."""

    temperature: float
    gumbel: bool
    seeds: Tensor | list[int]
    offset: int


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


def node_tree(roots: Tensor, tokens: Tensor, parent: Tensor, depth: Tensor, draft_probs: Tensor | None) -> DraftTree:
    """A tree from per-node arrays (node 0 = root; tokens are target ids of nodes 1..)."""
    batch = roots.shape[0]
    tokens = torch.cat([roots[:, None].long(), tokens], dim=1)
    num_nodes = torch.full((batch,), tokens.shape[1], dtype=torch.long, device=roots.device)
    return DraftTree(tokens, parent, depth, num_nodes, ancestor_mask(parent), draft_probs)


class CachedDrafter:
    """The drafter's committed cache, pending elements and the batched pass over them (shared by both methods)."""

    method: str  # "peagle" or "eagle3"

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

    def context(
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

    def run_pending(self, rows: Tensor, host_rows: list[int], num_mask: int, logit_rows: int) -> tuple[Tensor, Tensor]:
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
        context, committed, key_positions = self.context(rows, host_rows)
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

    def full_vocab(self, probs: Tensor) -> Tensor:
        """Draft-vocabulary probabilities [..., Vd] as target-vocabulary rows [..., V] (zero outside it)."""
        if probs.shape[-1] == self.target_vocab:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.target_vocab)
        return full.index_copy_(-1, self.draft_ids, probs)

    def tree_from_spec(self, roots: Tensor, spec: TreeSpec, tokens: Tensor | None = None) -> DraftTree:
        """A DraftTree from a TreeSpec over draft ids (``tokens`` replaces the spec's drafted ids)."""
        tokens = spec.tokens if tokens is None else tokens
        target_ids = self.draft_ids[tokens.clamp(min=0)]
        tokens = torch.where(spec.depth > 0, target_ids, roots[:, None].long())
        return DraftTree(tokens, spec.parent, spec.depth.clamp(min=0), spec.num_nodes, spec.mask, None)
