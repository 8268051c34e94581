"""Sequence partitioning: train one long row as S segments whose summed loss and gradients equal the whole row's.

A row of T positions is cut at position boundaries 0 = b_0 < b_1 < ... < b_S = T. Element (a, d) is owned by the
segment of position a + min(d, 1): depth 0 by its anchor, depth 1 by its position a + 1, and every deeper element by
its parent (a, d - 1) (the invariant Chunk(p, d) = Chunk(p - 1, d - 1) for d >= 2). A query's allowed keys are depth-0
elements at or before its anchor plus its own chain; the chain is in the same segment (or, for (a, 0), earlier), so each
segment also carries, as loss-free context, the depth-0 elements at positions before b_s that its queries reach through
the attention stack: from the first position of the query's document (or, with a sliding window W over L layers, from
a_q - L (W - 1)). Every owned element then sees exactly the keys (and keys of keys) it sees in the whole row, so the
trainer can run the S forward/backward passes one after another and accumulate.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from peagle.ops.mask import BlockMaskBuilder, mask_dense

__all__ = ["Segment", "partition_elements", "segment_boundaries", "segment_masks"]


class Segment(NamedTuple):
    """One segment's elements, in the order of the whole row's element list (so a COD layout stays a COD layout)."""

    index: Tensor  # [n_s] int64 indices into the whole row's elements
    anchors: Tensor  # [n_s] int64
    depths: Tensor  # [n_s] int64
    owned: Tensor  # [n_s] bool: True = the element's loss belongs to this segment; False = loss-free context


def segment_boundaries(length: int, num_segments: int, device: torch.device | str | None = None) -> Tensor:
    """Equal position boundaries [S + 1] (int64): b_s = floor(s T / S)."""
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    return torch.div(torch.arange(num_segments + 1, device=device) * length, num_segments, rounding_mode="floor")


def _first_position_of_document(document_ids: Tensor) -> Tensor:
    """[T]: the first position (anywhere in the row) holding the same document id; padding maps to itself."""
    docs = document_ids.long()
    length = docs.shape[0]
    positions = torch.arange(length, device=docs.device)
    _, inverse = torch.unique(docs, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1 if length else 0,), length, dtype=torch.long, device=docs.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return torch.where(docs == -1, positions, first[inverse])


def partition_elements(
    anchors: Tensor,
    depths: Tensor,
    document_ids: Tensor,
    num_segments: int | None = None,
    *,
    boundaries: Tensor | None = None,
    window: int | None = None,
    num_layers: int = 1,
) -> list[Segment]:
    """Splits N elements of one row into segments (equal position ranges unless ``boundaries`` [S + 1] is given).

    Args:
        anchors, depths: [N] elements of the row (any order; the segment keeps the row's order).
        document_ids: [T] document of each position, -1 = padding.
        num_segments: S, for equal position boundaries; exactly one of num_segments / boundaries.
        boundaries: [S + 1] increasing positions with b_0 = 0 and b_S = T.
        window: the attention's sliding window (None = none); context then reaches back num_layers * (window - 1).
        num_layers: attention layers of the model (only matters with a window).
    """
    length = document_ids.shape[0]
    device = anchors.device
    if (num_segments is None) == (boundaries is None):
        raise ValueError("give exactly one of num_segments and boundaries")
    if boundaries is None:
        boundaries = segment_boundaries(length, num_segments, device)
    boundaries = boundaries.to(device=device, dtype=torch.long)
    if boundaries.dim() != 1 or boundaries.numel() < 2:
        raise ValueError(f"boundaries must be 1-D [S + 1] with S >= 1, got shape {tuple(boundaries.shape)}")
    if int(boundaries[0]) != 0 or int(boundaries[-1]) != length or bool((boundaries[1:] < boundaries[:-1]).any()):
        raise ValueError(f"boundaries must be non-decreasing from 0 to T = {length}, got {boundaries.tolist()}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")

    a, d = anchors.long(), depths.long()
    owner_position = a + d.clamp(max=1)
    segment = torch.searchsorted(boundaries[1:-1], owner_position, right=True)
    # Earliest depth-0 position each element can reach through the stack (itself included).
    reach = _first_position_of_document(document_ids)[a]
    if window is not None:
        reach = torch.maximum(reach, a - num_layers * (window - 1))
    reach = torch.minimum(reach, a)
    is_root = d == 0
    segments = []
    for s in range(boundaries.numel() - 1):
        owned = segment == s
        start = int(boundaries[s])
        lo = int(reach[owned].min()) if bool(owned.any()) else start
        context = is_root & (a >= lo) & (a < start) & ~owned
        index = torch.nonzero(owned | context).squeeze(1)
        segments.append(Segment(index, a[index], d[index], owned[index]))
    return segments


def segment_masks(
    segments: list[Segment],
    document_ids: Tensor,
    window: int | None = None,
    kind: Literal["dense", "block"] = "dense",
    block_size: int = 128,
) -> list[Tensor] | list[BlockMask]:
    """Attention masks of the segments from the mask ops: dense boolean [n_s, n_s] (SDPA) or flex ``BlockMask``s.

    Block masks of different segments are built with separate builders (a builder's BlockMask is valid until its next
    build), so all of them stay valid together.
    """
    if kind == "dense":
        return [mask_dense(seg.anchors, seg.depths, document_ids, window) for seg in segments]
    if kind == "block":
        return [BlockMaskBuilder(block_size).build(seg.anchors, seg.depths, document_ids, window) for seg in segments]
    raise ValueError(f"kind must be 'dense' or 'block', got {kind!r}")
