"""The paged KV cache shared by the target runner and the drafter's committed cache.

Per layer ``k[l], v[l] [num_blocks, block_size, kv_heads, head_dim]``; per request a block-table row and ``seq_len``
(committed entries). Logical slot s of request r lives at ``(block_table[r, s // block_size], s % block_size)``, and
slot s holds position s. Each request owns ``capacity`` slots; block j of request r is block ``j * R + r``, so a
request's blocks are never contiguous and every read really goes through the table. The last block is a scratch
block: writes of padding elements land there and nothing reads it.

A verification round writes tree node i at slot ``seq_len + i`` (:meth:`PagedKVCache.write`), and
:meth:`PagedKVCache.compact` keeps the accepted path through ``peagle.ops.kv_compact``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.ops import kv_compact

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Paged keys/values of ``num_layers`` layers for ``num_requests`` requests of ``capacity`` slots each."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_requests: int,
        capacity: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        blocks_per_request = -(-capacity // block_size)
        num_blocks = num_requests * blocks_per_request + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        blocks = torch.arange(blocks_per_request, device=device)
        self.block_table = blocks[None, :] * num_requests + torch.arange(num_requests, device=device)[:, None]
        self.seq_len = torch.zeros(num_requests, dtype=torch.long, device=device)
        self.host_len = [0] * num_requests  # mirror of seq_len, so that shapes never wait for the device
        self.block_size = block_size
        self.capacity = blocks_per_request * block_size
        self.scratch = (num_blocks - 1) * block_size

    def max_len(self, rows: list[int]) -> int:
        return max(self.host_len[r] for r in rows)

    def padded_len(self, rows: list[int], extra: int = 0) -> int:
        """The longest of ``rows``'s committed lengths plus ``extra``, rounded up to whole blocks (what
        :meth:`read` returns for :meth:`context_blocks` of that length)."""
        length = self.max_len(rows) + extra
        return min(-(-length // self.block_size) * self.block_size, self.capacity)

    def flat_slots(self, rows: Tensor, logical: Tensor, valid: Tensor | None = None) -> Tensor:
        """Flat slot index [b, m] (into ``k[l].view(-1, kv_heads, head_dim)``) of logical slots [b, m] of ``rows``;
        invalid entries (``valid`` False, or beyond the capacity) map to the scratch block."""
        ok = logical < self.capacity
        if valid is not None:
            ok = ok & valid
        logical = torch.where(ok, logical, 0)
        table = self.block_table[rows]
        flat = table.gather(1, logical // self.block_size) * self.block_size + logical % self.block_size
        return torch.where(ok, flat, self.scratch)

    def context_blocks(self, rows: Tensor, length: int) -> Tensor:
        """Block ids [b, length / block_size] holding logical slots 0 .. length - 1 of ``rows`` (``length`` a
        multiple of the block size, e.g. :meth:`padded_len`; the caller masks the slots past its requests' ends)."""
        return self.block_table[rows, : length // self.block_size]

    def window_blocks(self, rows: Tensor, first: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """Block ids [b, m] covering logical slots ``first[b] .. first[b] + count - 1`` of ``rows`` (m is the same
        for every row and depends on ``count`` only: a sliding window reads the same amount at any context length)
        and the logical slot of each entry they hold [b, m * block_size]. Blocks past a request's last one read as
        its last block; their slots lie past the capacity (the caller masks slots at or past ``seq_len``)."""
        width = count // self.block_size + 2 if count else 0
        start = (first // self.block_size)[:, None] + torch.arange(width, device=first.device)
        blocks = self.block_table[rows[:, None], start.clamp(max=self.block_table.shape[1] - 1)]
        slots = (start[..., None] * self.block_size + torch.arange(self.block_size, device=first.device)).flatten(1)
        return blocks, slots

    def read(self, layer: int, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [b, m * block_size, kv_heads, head_dim] of the blocks [b, m] (whole live blocks are
        copied, never the whole cache)."""
        return self.k[layer][blocks].flatten(1, 2), self.v[layer][blocks].flatten(1, 2)

    def write(self, layer: int, slots: Tensor, key: Tensor, value: Tensor) -> None:
        """Stores keys/values [b, m, kv_heads, head_dim] at flat ``slots`` [b, m]."""
        k, v = self.k[layer], self.v[layer]
        k.view(-1, *k.shape[2:])[slots] = key.to(k.dtype)
        v.view(-1, *v.shape[2:])[slots] = value.to(v.dtype)

    def advance(self, rows: Tensor, host_rows: list[int], counts: Tensor, host_counts: list[int]) -> None:
        """Commits ``counts`` entries written in place at ``seq_len ..`` (a prefill chunk, drafter elements)."""
        self.seq_len[rows] += counts
        for r, c in zip(host_rows, host_counts, strict=True):
            self.host_len[r] += c

    def compact(
        self, rows: Tensor, host_rows: list[int], accepted_path: Tensor, num_accepted: Tensor, host_accepted: list[int]
    ) -> None:
        """Keeps each request's accepted path of the last round (``kv_compact``) and commits it."""
        if max(host_accepted) == 0:  # every path is the root alone, already at slot seq_len: nothing moves
            self.seq_len[rows] += 1
        else:
            seq_len = self.seq_len[rows]
            kv_compact(self.k, self.v, self.block_table[rows], seq_len, accepted_path, num_accepted)
            self.seq_len[rows] = seq_len
        for r, m in zip(host_rows, host_accepted, strict=True):
            self.host_len[r] += m + 1
