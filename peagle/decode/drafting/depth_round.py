"""The harness's depth-by-depth drafting of an autoregressive drafter in buffers preallocated per padded batch size
(:class:`DepthDraftRound`), whose steps a :class:`~peagle.decode.harness.DepthStepper` runs as CUDA graphs chained on
the device (a GPU) or as a host loop, and :class:`DepthPlanner`, what those steps ask the harness."""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import Tensor

from peagle.decode.drafting.autoregressive import node_forward
from peagle.decode.drafting.base import CachedDrafter
from peagle.decode.harness.depth_harness import DepthRound, DepthStepper
from peagle.decode.sampling import draft_distribution
from peagle.ops import TreeSpec, tree_expand_topk, tree_expand_topk_reference

__all__ = ["DepthDraftRound", "DepthPlanner"]


class DepthPlanner(Protocol):
    """What autoregressive drafting asks a harness (:class:`peagle.decode.harness.DepthHarness` implements it)."""

    max_width: int
    chain_mode: str
    chain_report: str

    def padded(self, rows: Tensor) -> int: ...

    def start(self, rows: Tensor) -> DepthRound: ...

    def chain_depth(self, rows: Tensor) -> int: ...


def _expand_topk(scores: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tree_expand_topk`; on CUDA its reference (the same candidates from device ops a CUDA graph can capture:
    outside deferred checks (peagle.ops.errors) the op's CUDA kernel reads its error table back, a synchronisation)."""
    if probs.device.type == "cuda":
        return tree_expand_topk_reference(scores, probs, topk)
    return tree_expand_topk(scores, probs, topk)


class DepthDraftRound:
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

    def __init__(self, owner: CachedDrafter, harness: DepthPlanner, padded: int, temperature: float) -> None:
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
        context, committed, positions = owner.context(padded_rows, host_rows, length)
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
            logits, hidden, new_kv = node_forward(
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
