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


def random_tree(generator: torch.Generator, nodes: int, kind: str = "random") -> Tensor:
    """Parent array [n] (int64) of a draft tree: node 0 is the root (-1), every parent precedes its child.

    kind: "chain" (parent = i - 1), "star" (every node hangs off the root), "deep" (parent among the last 2 nodes,
    so depth grows ~ n / 1.5), "random" (parent uniform among earlier nodes), "forest" (like random, but some nodes
    start from the committed state again: parent -1, as padding nodes do).
    """
    if kind == "chain":
        return torch.arange(nodes, dtype=torch.long) - 1
    parent = torch.empty(nodes, dtype=torch.long)
    parent[0] = -1
    for i in range(1, nodes):
        if kind == "star":
            parent[i] = 0
        elif kind == "deep":
            parent[i] = i - 1 - int(torch.randint(0, min(2, i), (), generator=generator))
        elif kind == "random":
            parent[i] = int(torch.randint(0, i, (), generator=generator))
        elif kind == "forest":
            parent[i] = int(torch.randint(-1, i, (), generator=generator))
        else:
            raise ValueError(f"unknown tree kind {kind!r}")
    return parent


class GdnInputs(NamedTuple):
    q: Tensor  # [B, n, H, K]
    k: Tensor  # [B, n, H, K]
    v: Tensor  # [B, n, HV, V]
    g: Tensor  # [B, n, HV] log decay (<= 0)
    beta: Tensor  # [B, n, HV] in (0, 1)
    parent: Tensor  # [B, n]
    state_pool: Tensor  # [P, HV, K, V] fp32
    slots: Tensor  # [B]


def random_gdn_inputs(
    generator: torch.Generator,
    batch: int,
    nodes: int,
    qk_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    *,
    kind: str = "random",
    dtype: torch.dtype = torch.float32,
    pool_extra: int = 2,
    key_scale: float | None = None,
) -> GdnInputs:
    """Random GDN tree-verification inputs. ``key_scale`` keeps un-normalised keys stable (norm ~ key_scale)."""
    key_scale = key_dim**-0.5 if key_scale is None else key_scale

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    q = randn(batch, nodes, qk_heads, key_dim).to(dtype)
    k = (randn(batch, nodes, qk_heads, key_dim) * key_scale).to(dtype)
    v = randn(batch, nodes, value_heads, value_dim).to(dtype)
    g = -torch.nn.functional.softplus(randn(batch, nodes, value_heads)) * 0.5
    beta = torch.sigmoid(randn(batch, nodes, value_heads))
    parent = (
        torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
        if batch
        else torch.empty(0, nodes, dtype=torch.long)
    )
    pool = batch + pool_extra
    state_pool = randn(pool, value_heads, key_dim, value_dim) * 0.5
    slots = torch.randperm(pool, generator=generator)[:batch]
    return GdnInputs(q, k, v, g.to(dtype), beta.to(dtype), parent, state_pool, slots)
