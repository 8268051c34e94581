"""Random inputs shared by the CPU tests, the CUDA tests and the benchmarks."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor


def fresh_seed() -> int:
    """A new seed per call (tests print it, so a failure can be replayed)."""
    return int.from_bytes(os.urandom(4), "little")


class PackedRow(NamedTuple):
    loss_mask: Tensor  # [T] bool
    document_ids: Tensor  # [T] int64, -1 = padding


def random_packed_row(
    generator: torch.Generator,
    length: int,
    *,
    mean_document_length: float = 200.0,
    trained_fraction: float = 0.7,
    padding_fraction: float = 0.1,
) -> PackedRow:
    """A packed row: documents of random lengths, a padding tail, and trained spans (runs of loss-masked labels)."""
    padding = int(length * padding_fraction * torch.rand((), generator=generator).item())
    used = length - padding
    document_ids = torch.full((length,), -1, dtype=torch.long)
    position, doc = 0, 0
    while position < used:
        size = 1 + int(torch.empty(()).exponential_(1.0 / mean_document_length, generator=generator).item())
        document_ids[position : min(used, position + size)] = doc
        position += size
        doc += 1
    # Trained labels come in spans, as assistant turns do.
    loss_mask = torch.zeros(length, dtype=torch.bool)
    position = 0
    while position < used:
        span = 1 + int(torch.randint(0, 64, (), generator=generator).item())
        if torch.rand((), generator=generator).item() < trained_fraction:
            loss_mask[position : min(used, position + span)] = True
        position += span
    return PackedRow(loss_mask, document_ids)


class TreeBatch(NamedTuple):
    parent: Tensor  # [B, n_max] int64, -1 at the root; padding nodes hold garbage
    tokens: Tensor  # [B, n_max] int64, siblings distinct; padding nodes hold garbage
    num_nodes: Tensor  # [B] int64 in [1, n_max]


def random_tree_batch(
    generator: torch.Generator,
    batch: int,
    n_max: int,
    vocab: int,
    *,
    chain: bool = False,
    full: bool = False,
) -> TreeBatch:
    """Random draft trees (parents before children, distinct sibling tokens), padded to n_max with garbage nodes.

    Needs vocab >= n_max - 1 so that any sibling group fits in the vocabulary.
    """
    if vocab < n_max - 1:
        raise ValueError(f"random_tree_batch needs vocab >= n_max - 1, got vocab={vocab}, n_max={n_max}")
    idx = torch.arange(n_max)
    if chain:
        parent = (idx - 1).expand(batch, n_max).clone()
    else:
        parent = (torch.rand(batch, n_max, generator=generator) * idx).long()
        parent[:, 0] = -1
    # Rank of each node among its earlier siblings; a sibling group has consecutive tokens (mod V) from a random start.
    same = (parent[:, :, None] == parent[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    rank = same.sum(dim=2)
    start = torch.randint(0, vocab, (batch, n_max), generator=generator)
    tokens = (start.gather(1, parent.clamp(min=0)) + rank) % vocab
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    if full:
        num_nodes = torch.full((batch,), n_max, dtype=torch.long)
    else:
        num_nodes = torch.randint(1, n_max + 1, (batch,), generator=generator)
    pad = idx[None, :] >= num_nodes[:, None]
    parent = torch.where(pad, torch.randint(-3, n_max + 3, (batch, n_max), generator=generator), parent)
    tokens = torch.where(pad, torch.randint(-3, vocab + 3, (batch, n_max), generator=generator), tokens)
    return TreeBatch(parent, tokens, num_nodes)
