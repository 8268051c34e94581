"""Paged KV cache compaction after tree verification (DESIGN: "The serving wing").

Layout: per layer ``k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]``; request b's logical slot s lives
at ``(block_table[b, s // block_size], s % block_size)``. A verification round wrote tree node i of request b at logical
slot ``seq_len[b] + i``. :func:`kv_compact` keeps the accepted path: for j in 1..num_accepted[b] the entry of node
``accepted_path[b, j]`` moves to slot ``seq_len[b] + j`` in every layer (node 0, the root, is already at ``seq_len[b]``;
every source is read before any destination is written), then ``seq_len[b] += num_accepted[b] + 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kv_compact", "kv_compact_reference"]


def kv_compact_reference(
    k_caches: list[Tensor],
    v_caches: list[Tensor],
    block_table: Tensor,
    seq_len: Tensor,
    accepted_path: Tensor,
    num_accepted: Tensor,
) -> None:
    """Pure-PyTorch :func:`kv_compact` (in place, vectorised over requests and layers; no input validation)."""
    block_size = k_caches[0].shape[1]
    path = accepted_path.long()
    count = num_accepted.long()
    steps = torch.arange(1, path.shape[1], device=path.device)
    rows, col = torch.nonzero(steps[None, :] <= count[:, None], as_tuple=True)
    if rows.numel():
        base = seq_len.long()[rows]
        j = steps[col]

        def flat(logical: Tensor) -> Tensor:
            return block_table.long()[rows, logical // block_size] * block_size + logical % block_size

        src, dst = flat(base + path[rows, j]), flat(base + j)
        for cache in (*k_caches, *v_caches):
            view = cache.view(-1, *cache.shape[2:])
            view[dst] = view[src]  # advanced indexing reads every source into a copy first
    seq_len += (count + 1).to(seq_len.dtype)


kv_compact = kv_compact_reference
