"""Accepted-path compaction of a paged KV cache: the commit step of a speculative decoding round.

Layout. Every attention layer has ``k_cache`` and ``v_cache`` [num_blocks, block_size, kv_heads, head_dim] (float32,
bfloat16 or float16; one shape, dtype and device for all layers, each contiguous and in its own memory). Request b owns
the row ``block_table[b]`` [max_blocks] (int32/int64): logical block i of its sequence is physical block
``block_table[b, i]`` (-1 where unused), so logical slot s lives at ``cache[block_table[b, s // block_size],
s % block_size]``. ``seq_len[b]`` counts its committed tokens.

A round wrote the n nodes of request b's draft tree at logical slots ``seq_len[b] .. seq_len[b] + n - 1`` (node i at
``seq_len[b] + i``) and verification returned ``accepted_path`` [B, P] (node indices from the root, ``path[:, 0] = 0``,
-1 padded) and ``num_accepted`` [B] in [0, P - 1], as :func:`peagle.ops.tree_verify_greedy` and
:func:`peagle.ops.tree_rejection_sample` give them. :func:`kv_compact` then, in every layer's k and v cache, for each
request and j = 1..num_accepted[b], moves the entry of node ``accepted_path[b, j]`` (slot ``seq_len[b] +
accepted_path[b, j]``) to slot ``seq_len[b] + j`` (the root, node 0, is already at ``seq_len[b]``), and sets
``seq_len[b] += num_accepted[b] + 1``. Every source is read before any destination is written, so a destination that
is another accepted node's source (path [0, 2, 4]: slot 2 is written by j = 2 and read by j = 1) gets the right entry.
Nothing else in the caches changes; the rejected nodes' slots past the new length are simply free again.

Checks (the argument named, expected vs got): equal, non-empty layer lists with consistent shapes, dtypes and devices;
index shapes and integer dtypes; num_accepted in [0, P - 1]; seq_len >= 0; each accepted path starts at 0, strictly
increases and stays within the slots its block-table row covers; every block a move touches is a valid physical block
used by no other (request, logical block). The CPU raises before changing anything. CUDA checks shapes on the host and
values on the device: when a value is bad the kernels change nothing and the error is raised after one host read of
the error table (the only synchronisation; see csrc/cuda/kv_cuda.cpp).

The reference below is the executable specification (and the vectorised PyTorch a user would write without the op).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["kv_compact", "kv_compact_reference"]


def kv_compact(
    k_caches: Sequence[Tensor],
    v_caches: Sequence[Tensor],
    block_table: Tensor,
    seq_len: Tensor,
    accepted_path: Tensor,
    num_accepted: Tensor,
) -> None:
    """Moves each request's accepted path to the slots right after its committed prefix, in place, in every layer.

    Args:
        k_caches, v_caches: one [num_blocks, block_size, kv_heads, head_dim] cache per layer (updated in place).
        block_table: [B, max_blocks] int32/int64 physical block of each logical block (-1 unused).
        seq_len: [B] int32/int64 committed tokens; becomes seq_len + num_accepted + 1 (in place).
        accepted_path: [B, P] int32/int64 node indices from the root (path[:, 0] = 0, -1 padded).
        num_accepted: [B] int32/int64 accepted drafts, in [0, P - 1].
    """
    torch.ops.peagle.kv_compact(list(k_caches), list(v_caches), block_table, seq_len, accepted_path, num_accepted)


@torch.library.register_fake("peagle::kv_compact")
def _kv_compact_fake(k_caches, v_caches, block_table, seq_len, accepted_path, num_accepted):
    return None


def kv_compact_reference(
    k_caches: Sequence[Tensor],
    v_caches: Sequence[Tensor],
    block_table: Tensor,
    seq_len: Tensor,
    accepted_path: Tensor,
    num_accepted: Tensor,
) -> None:
    """Pure-PyTorch :func:`kv_compact`, in place like the op (valid inputs assumed: the op holds the checks).

    All moves of a layer at once: ``index_select`` copies every source row, then ``index_copy_`` writes the
    destinations, so sources are read before any destination is written.
    """
    block_size = k_caches[0].shape[1]
    seq = seq_len.long()
    count = num_accepted.long()
    j = torch.arange(1, accepted_path.shape[1], device=seq.device)
    moved = j[None, :] <= count[:, None]  # [B, P - 1]
    request = torch.arange(seq.shape[0], device=seq.device)[:, None].expand_as(moved)[moved]
    src = seq[request] + accepted_path[:, 1:].long()[moved]
    dst = seq[request] + j[None, :].expand_as(moved)[moved]
    table = block_table.long()

    def physical(slot: Tensor) -> Tensor:
        return table[request, slot // block_size] * block_size + slot % block_size

    src_rows, dst_rows = physical(src), physical(dst)
    for cache in (*k_caches, *v_caches):
        rows = cache.view(cache.shape[0] * block_size, -1)
        rows.index_copy_(0, dst_rows, rows.index_select(0, src_rows))
    seq_len.copy_(seq + count + 1)
