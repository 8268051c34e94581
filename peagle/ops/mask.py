"""P-EAGLE attention masks: a dense boolean mask for SDPA/eager attention and a flex-attention ``BlockMask``.

Element (a, d) is anchor a at depth d (see :mod:`peagle.ops.cod`). Query q may attend to key k when (DESIGN.md)::

    doc(a_q) != -1 and doc(a_q) == doc(a_k) and
    ((d_k == 0 and a_k <= a_q and (W is None or a_k > a_q + d_q - W)) or (a_k == a_q and d_k <= d_q))

The block builder never evaluates this predicate per element pair: it summarises every block of ``block_size``
elements once (ranges of anchors, depths, a + d and documents over its valid elements, split into depth-0 and deeper
elements, and its sorted anchors) and classifies each (q block, kv block) pair from them: per-sample work is
O(N log block_size + blocks^2 log block_size).
The classification is exact in the only directions that matter for correctness: a block holding an allowed pair is never
empty and a block holding a disallowed pair is never full; the ``mask_mod`` decides inside partial blocks.

:class:`BlockMaskBuilder` keeps the per-length structure (element buffers padded to the maximum length, so ``mask_mod``
closes over tensors of a fixed shape and a compiled flex attention is not re-traced per sample) and slices it per
sample. On the CPU, flex attention has no backward: training there uses :func:`mask_dense` with SDPA.

The paper's amortized construction (precompute the mask once for the longest length, slice it per sample) is
:class:`MaskSlicer` over the ``mask_slice_*`` ops. The max-length mask of one document is stored losslessly as
:func:`mask_slice_table`: each of its rows, element (a, d), allows the depth-0 anchors [table[d, a], a] plus its own
chain, so one number per row holds it; each sample's dense and block masks are sliced out of it (rows looked up by
(d, a), documents applied per sample). Both ops run the same kernels as :func:`mask_dense` / :func:`mask_block`, with
the window's bound read from the table instead of computed.

Defaults: both paths are exact against the predicate, and ``benchmarks/bench_mask.py`` measures them equal within
noise at T = 2048-16384 (what a sample costs is its documents and writing its output, which no table amortises; looking
the bound up costs what computing it does). So training keeps the paths that need no maximum length up front:
:func:`mask_dense` for SDPA (``peagle.model.drafter.document_blocks``, one per document, and
``peagle.train.partition.segment_masks``) and :class:`BlockMaskBuilder` for flex attention
(``PEagleDrafter.element_mask``, ``segment_masks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "BlockMaskBuilder",
    "MaskBlocks",
    "MaskSlicer",
    "block_kinds",
    "block_kinds_from_dense",
    "block_kinds_from_predicate",
    "build_block_mask",
    "make_mask_mod",
    "mask_block",
    "mask_block_reference",
    "mask_dense",
    "mask_dense_reference",
    "mask_slice_block",
    "mask_slice_block_reference",
    "mask_slice_dense",
    "mask_slice_dense_reference",
    "mask_slice_table",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
_BIG = torch.iinfo(torch.long).max // 4  # mask::kBig: the bound of "no bound" in summaries and lows
MAX_BLOCK_SIZE = 65536  # the bound mask_block checks (csrc/checks/mask.h): block_size sizes its buffers


class MaskBlocks(NamedTuple):
    """Block-sparse structure of a mask over N elements, nb = ceil(N / block_size) blocks per side (int32)."""

    kv_num_blocks: Tensor  # [nb] partial kv blocks per q block
    kv_indices: Tensor  # [nb, nb] their indices (ascending) first, zeros after
    full_kv_num_blocks: Tensor  # [nb] full kv blocks per q block
    full_kv_indices: Tensor  # [nb, nb]


def mask_dense(anchors: Tensor, depths: Tensor, document_ids: Tensor, window: int | None = None) -> Tensor:
    """Dense boolean attention mask [N, N] (True = query row may attend to key column) of N elements.

    Args:
        anchors, depths: [N] int32/int64 elements (any order): anchors in [0, T), depths in [0, T) (a chain
            may run past the row's end, as evaluation's chains from the last anchors do).
        document_ids: [T] int32/int64 document of each position, -1 = padding (padding queries see nothing); ids
            below -1 are an error, as in every op.
        window: sliding window W >= 1 over depth-0 keys, None for none.
    """
    return torch.ops.peagle.mask_dense(anchors, depths, document_ids, window)


def mask_block(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, block_size: int = 128, window: int | None = None
) -> MaskBlocks:
    """Classifies every (q block, kv block) pair of N elements as empty / partial / full from per-block summaries.

    Same arguments as :func:`mask_dense`, plus ``block_size`` (elements per block on both sides, in [1, 65536]).
    """
    return MaskBlocks(*torch.ops.peagle.mask_block(anchors, depths, document_ids, block_size, window))


def mask_slice_table(
    max_length: int, num_depths: int, window: int | None = None, device: torch.device | str | None = None
) -> Tensor:
    """The max-length mask of one document, one row per element (a, d): [num_depths, max_length] int32.

    table[d, a] is the lowest depth-0 anchor that element (a, d) may see (its row allows depth-0 anchors in
    [table[d, a], a] and its own chain at depths <= d): 0 without a window, max(0, a + d - W + 1) with window W.
    Computed once per maximum length; :func:`mask_slice_dense` and :func:`mask_slice_block` slice samples out of it.
    """
    if max_length < 1 or num_depths < 1:
        raise ValueError(f"max_length and num_depths must be >= 1, got {max_length} and {num_depths}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    if window is None:
        return torch.zeros(num_depths, max_length, dtype=torch.int32, device=device)
    a = torch.arange(max_length, device=device)[None, :]
    d = torch.arange(num_depths, device=device)[:, None]
    return (a + d - window + 1).clamp(min=0).to(torch.int32)


def mask_slice_dense(table: Tensor, anchors: Tensor, depths: Tensor, document_ids: Tensor) -> Tensor:
    """The dense mask [N, N] of one sample sliced out of ``table`` (:func:`mask_slice_table`).

    Same elements and documents as :func:`mask_dense`; anchors must be below the table's max_length, depths below
    its num_depths.
    """
    return torch.ops.peagle.mask_slice_dense(table, anchors, depths, document_ids)


def mask_slice_block(
    table: Tensor, anchors: Tensor, depths: Tensor, document_ids: Tensor, block_size: int = 128
) -> MaskBlocks:
    """The block-sparse structure of one sample sliced out of ``table`` (as :func:`mask_block`)."""
    return MaskBlocks(*torch.ops.peagle.mask_slice_block(table, anchors, depths, document_ids, block_size))


def block_kinds(blocks: MaskBlocks) -> Tensor:
    """Kind of every (q block, kv block) pair [nb, nb] int8: 0 empty, 1 partial, 2 full."""
    nb = blocks.kv_num_blocks.shape[0]
    kinds = torch.zeros(nb, nb, dtype=torch.int8, device=blocks.kv_indices.device)
    cols = torch.arange(nb, device=kinds.device)
    for num, idx, kind in (
        (blocks.kv_num_blocks, blocks.kv_indices, PARTIAL),
        (blocks.full_kv_num_blocks, blocks.full_kv_indices, FULL),
    ):
        live = cols[None, :] < num[:, None].long()
        rows = torch.arange(nb, device=kinds.device)[:, None].expand(nb, nb)
        kinds[rows[live], idx.long()[live]] = kind
    return kinds


def make_mask_mod(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The predicate as a flex-attention ``mask_mod(b, h, q_idx, kv_idx)`` over element indices."""
    a = anchors.long()
    d = depths.long()
    doc = document_ids.long()[a] if a.numel() else a.clone()
    return _mask_mod_from(a, d, doc, window)


def _mask_mod_from(a: Tensor, d: Tensor, doc: Tensor, window: int | None) -> Callable:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        aq, dq, docq = a[q_idx], d[q_idx], doc[q_idx]
        ak, dk, dock = a[kv_idx], d[kv_idx], doc[kv_idx]
        causal = (dk == 0) & (ak <= aq)
        if window is not None:
            causal = causal & (ak > aq + dq - window)
        return (docq != -1) & (docq == dock) & (causal | ((ak == aq) & (dk <= dq)))

    return mask_mod


def build_block_mask(
    anchors: Tensor,
    depths: Tensor,
    document_ids: Tensor,
    block_size: int = 128,
    window: int | None = None,
    compute_q_blocks: bool = True,
) -> BlockMask:
    """A flex-attention ``BlockMask`` for N elements (one batch row, one head; it broadcasts over both).

    ``compute_q_blocks=False`` skips the transposed (q-major) tensors that only the backward pass needs.
    """
    return BlockMaskBuilder(block_size).build(anchors, depths, document_ids, window, compute_q_blocks)


class BlockMaskBuilder:
    """Builds the per-sample ``BlockMask`` of many samples, reusing structure that depends only on the maximum length.

    The element buffers (anchor, depth, document of every element) are allocated once at the largest N seen, rounded
    up to whole blocks, and every sample is written into a slice of them: the ``mask_mod`` of every sample closes over
    the same fixed-shape tensors (a compiled flex attention is not re-traced per sample, and reads past N see padding,
    which nothing may attend from or to). The per-sample work is the block summaries and their pairwise classification.
    Not thread-safe: a ``BlockMask`` is valid until the next :meth:`build` on the same builder.

    Compiled flex attention on a GPU tiles queries and keys by its own ``BLOCK_M`` / ``BLOCK_N`` (64 or more by
    default), which must divide the mask's block size: a smaller ``block_size`` needs flex attention's
    ``kernel_options`` with tiles that divide it (torch 2.11 on an H200 refused 16 and 32 with the defaults).
    """

    def __init__(self, block_size: int = 128, max_elements: int = 0, device: torch.device | str | None = None) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        self.block_size = block_size
        self._capacity = 0
        self._device = torch.device(device) if device is not None else None
        self._buffers: tuple[Tensor, Tensor, Tensor] | None = None
        self._mods: dict[int | None, Callable] = {}
        if max_elements > 0 and self._device is not None:
            self._reserve(max_elements, self._device)

    def _reserve(self, num_elements: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self._buffers is None or num_elements > self._capacity or self._buffers[0].device != device:
            capacity = max(num_elements, self._capacity, 1)
            capacity = -(-capacity // self.block_size) * self.block_size
            self._buffers = (
                torch.zeros(capacity, dtype=torch.long, device=device),
                torch.zeros(capacity, dtype=torch.long, device=device),
                torch.full((capacity,), -1, dtype=torch.long, device=device),
            )
            self._capacity = capacity
            self._mods = {}
        return self._buffers

    def build(
        self,
        anchors: Tensor,
        depths: Tensor,
        document_ids: Tensor,
        window: int | None = None,
        compute_q_blocks: bool = True,
    ) -> BlockMask:
        """The ``BlockMask`` of one sample's N elements (same arguments as :func:`mask_block`)."""
        blocks = mask_block(anchors, depths, document_ids, self.block_size, window)
        return self.from_blocks(blocks, anchors, depths, document_ids, window, compute_q_blocks)

    def from_blocks(
        self,
        blocks: MaskBlocks,
        anchors: Tensor,
        depths: Tensor,
        document_ids: Tensor,
        window: int | None = None,
        compute_q_blocks: bool = True,
    ) -> BlockMask:
        """The ``BlockMask`` of one sample from its block structure (of this builder's block size)."""
        n = anchors.shape[0]
        a_buf, d_buf, doc_buf = self._reserve(n, anchors.device)
        a_buf[:n] = anchors
        d_buf[:n] = depths
        doc_buf[:n] = document_ids.long()[anchors.long()] if n else doc_buf[:0]
        doc_buf[n:] = -1
        if window not in self._mods:
            self._mods[window] = _mask_mod_from(a_buf, d_buf, doc_buf, window)
        return BlockMask.from_kv_blocks(
            blocks.kv_num_blocks[None, None],
            blocks.kv_indices[None, None],
            blocks.full_kv_num_blocks[None, None],
            blocks.full_kv_indices[None, None],
            BLOCK_SIZE=self.block_size,
            mask_mod=self._mods[window],
            seq_lengths=(n, n),
            compute_q_blocks=compute_q_blocks,
        )


class MaskSlicer:
    """The paper's amortized mask construction: the max-length table built once, every sample's masks sliced from it.

    Covers samples with anchors < ``max_length`` and depths < ``num_depths``. Not thread-safe (see
    :class:`BlockMaskBuilder`, which it uses for the ``BlockMask``'s element buffers).
    """

    def __init__(
        self,
        max_length: int,
        num_depths: int,
        window: int | None = None,
        block_size: int = 128,
        device: torch.device | str | None = None,
    ) -> None:
        self.window = window
        self.table = mask_slice_table(max_length, num_depths, window, device)
        self._builder = BlockMaskBuilder(block_size)

    def _table_on(self, device: torch.device) -> Tensor:
        if self.table.device != device:
            self.table = self.table.to(device)
        return self.table

    def dense(self, anchors: Tensor, depths: Tensor, document_ids: Tensor) -> Tensor:
        """The dense boolean mask [N, N] (for SDPA) of one sample."""
        return mask_slice_dense(self._table_on(anchors.device), anchors, depths, document_ids)

    def blocks(self, anchors: Tensor, depths: Tensor, document_ids: Tensor) -> MaskBlocks:
        """The block-sparse structure of one sample."""
        table = self._table_on(anchors.device)
        return mask_slice_block(table, anchors, depths, document_ids, self._builder.block_size)

    def block_mask(
        self, anchors: Tensor, depths: Tensor, document_ids: Tensor, compute_q_blocks: bool = True
    ) -> BlockMask:
        """The flex-attention ``BlockMask`` of one sample (valid until the next call)."""
        blocks = self.blocks(anchors, depths, document_ids)
        return self._builder.from_blocks(blocks, anchors, depths, document_ids, self.window, compute_q_blocks)


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


@torch.library.register_fake("peagle::mask_dense")
def _mask_dense_fake(anchors, depths, document_ids, window=None):
    n = anchors.shape[0]
    return anchors.new_empty(n, n, dtype=torch.bool)


@torch.library.register_fake("peagle::mask_block")
def _mask_block_fake(anchors, depths, document_ids, block_size=128, window=None):
    nb = (anchors.shape[0] + block_size - 1) // block_size
    num = anchors.new_empty(nb, dtype=torch.int32)
    idx = anchors.new_empty(nb, nb, dtype=torch.int32)
    return num, idx, num.clone(), idx.clone()


@torch.library.register_fake("peagle::mask_slice_dense")
def _mask_slice_dense_fake(table, anchors, depths, document_ids):
    return _mask_dense_fake(anchors, depths, document_ids)


@torch.library.register_fake("peagle::mask_slice_block")
def _mask_slice_block_fake(table, anchors, depths, document_ids, block_size=128):
    return _mask_block_fake(anchors, depths, document_ids, block_size)


# ---------------------------------------------------------------------------------------------------------------------
# References: the executable specification of both ops (pure PyTorch, vectorised).


def _element_docs(anchors: Tensor, document_ids: Tensor) -> Tensor:
    return document_ids.long()[anchors.long()]


def _window_lows(anchors: Tensor, depths: Tensor, window: int | None) -> Tensor:
    """Lowest depth-0 anchor each element may see causally (a_k > a + d - W), -2^61 without a window."""
    if window is None:
        return torch.full_like(anchors.long(), -_BIG)
    return anchors.long() + depths.long() - window + 1


def _table_lows(table: Tensor, anchors: Tensor, depths: Tensor) -> Tensor:
    return table.long()[depths.long(), anchors.long()].clamp(-_BIG, _BIG)  # as the kernels: +-2^61 is "no bound"


def _dense_from_lows(anchors: Tensor, depths: Tensor, document_ids: Tensor, low: Tensor) -> Tensor:
    a, d = anchors.long(), depths.long()
    doc = _element_docs(a, document_ids)
    aq, dq, docq, lowq = a[:, None], d[:, None], doc[:, None], low[:, None]
    ak, dk, dock = a[None, :], d[None, :], doc[None, :]
    causal = (dk == 0) & (ak <= aq) & (ak >= lowq)
    return (docq != -1) & (docq == dock) & (causal | ((ak == aq) & (dk <= dq)))


def mask_dense_reference(anchors: Tensor, depths: Tensor, document_ids: Tensor, window: int | None = None) -> Tensor:
    """Reference of :func:`mask_dense`: the predicate, broadcast over all pairs."""
    return _dense_from_lows(anchors, depths, document_ids, _window_lows(anchors, depths, window))


def mask_slice_dense_reference(table: Tensor, anchors: Tensor, depths: Tensor, document_ids: Tensor) -> Tensor:
    """Reference of :func:`mask_slice_dense`: the predicate with each query's causal bound looked up in the table."""
    return _dense_from_lows(anchors, depths, document_ids, _table_lows(table, anchors, depths))


def _block_summaries(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, low: Tensor, block_size: int
) -> dict[str, Tensor]:
    """Per-block summaries over valid elements (document != -1), as in csrc/include/peagle/mask.h."""
    n = anchors.shape[0]
    nb = (n + block_size - 1) // block_size
    pad = nb * block_size - n
    a = torch.nn.functional.pad(anchors.long(), (0, pad)).view(nb, block_size)
    d = torch.nn.functional.pad(depths.long(), (0, pad)).view(nb, block_size)
    low = torch.nn.functional.pad(low, (0, pad)).view(nb, block_size)
    doc = torch.nn.functional.pad(_element_docs(anchors, document_ids), (0, pad), value=-1).view(nb, block_size)
    big = _BIG
    valid = doc != -1
    root = valid & (d == 0)
    deep = valid & (d > 0)

    def lo(x: Tensor, keep: Tensor) -> Tensor:
        return torch.where(keep, x, big).amin(1)

    def hi(x: Tensor, keep: Tensor) -> Tensor:
        return torch.where(keep, x, -big).amax(1)

    sorted_anchors = torch.where(valid, a, big).sort(1).values  # valid anchors ascending, then padding
    count = torch.full((nb,), block_size, dtype=torch.long, device=anchors.device)
    if pad:
        count[-1] = block_size - pad
    return {
        "sorted": sorted_anchors,
        "count": count,
        "valid": valid.sum(1),
        "amin": lo(a, valid),
        "amax": hi(a, valid),
        "dmin": lo(d, valid),
        "dmax": hi(d, valid),
        "lmin": lo(low, valid),
        "lmax": hi(low, valid),
        "docmin": lo(doc, valid),
        "docmax": hi(doc, valid),
        "root": root.sum(1),
        "rmin": lo(a, root),
        "rmax": hi(a, root),
        "deep": deep.sum(1),
        "emin": lo(a, deep),
        "emax": hi(a, deep),
        "edmax": hi(d, deep),
    }


def _kinds_to_blocks(kinds: Tensor) -> MaskBlocks:
    nb = kinds.shape[0]
    cols = torch.arange(nb, device=kinds.device)
    out = []
    for kind in (PARTIAL, FULL):
        hit = kinds == kind
        # Stable sort puts the hit columns first, in ascending order; the rest are zeroed like the kernels do.
        order = torch.sort((~hit).to(torch.int8), dim=1, stable=True).indices
        num = hit.sum(1)
        idx = torch.where(cols[None, :] < num[:, None], order, 0)
        out += [num.to(torch.int32), idx.to(torch.int32)]
    return MaskBlocks(*out)


def mask_block_reference(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, block_size: int = 128, window: int | None = None
) -> MaskBlocks:
    """Reference of :func:`mask_block`: the summary-based classification, vectorised over block pairs."""
    return _blocks_from_lows(anchors, depths, document_ids, _window_lows(anchors, depths, window), block_size)


def mask_slice_block_reference(
    table: Tensor, anchors: Tensor, depths: Tensor, document_ids: Tensor, block_size: int = 128
) -> MaskBlocks:
    """Reference of :func:`mask_slice_block`: the classification of :func:`mask_block` with the table's bounds."""
    return _blocks_from_lows(anchors, depths, document_ids, _table_lows(table, anchors, depths), block_size)


def _blocks_from_lows(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, low: Tensor, block_size: int
) -> MaskBlocks:
    s = _block_summaries(anchors, depths, document_ids, low, block_size)
    sorted_anchors = s.pop("sorted")
    q = {k: v[:, None] for k, v in s.items()}
    k = {k: v[None, :] for k, v in s.items()}
    some = (q["valid"] > 0) & (k["valid"] > 0) & (q["docmax"] >= k["docmin"]) & (k["docmax"] >= q["docmin"])
    causal = (k["root"] > 0) & (k["rmin"] <= q["amax"]) & (k["rmax"] >= q["lmin"])
    # The own-chain term needs a_q == a_k: some valid q anchor must lie in the kv block's anchor range.
    nb = sorted_anchors.shape[0]
    first = torch.searchsorted(sorted_anchors, s["amin"][None, :].expand(nb, nb).contiguous())
    hit = sorted_anchors.gather(1, first.clamp(max=sorted_anchors.shape[1] - 1))
    in_range = (first < q["valid"]) & (hit <= k["amax"])
    chain = in_range & (k["dmin"] <= q["dmax"])
    nonempty = some & (causal | chain)
    one_doc = (
        (q["valid"] == q["count"])
        & (k["valid"] == k["count"])
        & (q["docmin"] == q["docmax"])
        & (k["docmin"] == k["docmax"])
        & (q["docmin"] == k["docmin"])
    )
    roots_ok = (k["root"] == 0) | ((k["rmax"] <= q["amin"]) & (k["rmin"] >= q["lmax"]))
    deep_ok = (k["deep"] == 0) | (
        (q["amin"] == q["amax"]) & (k["emin"] == q["amin"]) & (k["emax"] == q["amin"]) & (k["edmax"] <= q["dmin"])
    )
    full = nonempty & one_doc & roots_ok & deep_ok
    kinds = torch.where(full, FULL, torch.where(nonempty, PARTIAL, EMPTY)).to(torch.int8)
    return _kinds_to_blocks(kinds)


def block_kinds_from_predicate(
    anchors: Tensor, depths: Tensor, document_ids: Tensor, block_size: int = 128, window: int | None = None
) -> Tensor:
    """The tightest classification [nb, nb] int8 (what create_block_mask computes): from the dense predicate.

    A block is full when every real pair in it is allowed (a short last block counts only its real elements), empty
    when none is. O(N^2): for tests and benchmarks only.
    """
    return block_kinds_from_dense(mask_dense_reference(anchors, depths, document_ids, window), block_size)


def block_kinds_from_dense(dense: Tensor, block_size: int = 128) -> Tensor:
    """The tightest classification [nb, nb] int8 of a dense mask [N, N] (see :func:`block_kinds_from_predicate`)."""
    n = dense.shape[0]
    nb = (n + block_size - 1) // block_size
    pad = nb * block_size - n
    allowed = torch.nn.functional.pad(dense, (0, pad, 0, pad), value=False)
    real = torch.nn.functional.pad(torch.ones(n, n, dtype=torch.bool, device=dense.device), (0, pad, 0, pad))
    allowed = allowed.view(nb, block_size, nb, block_size)
    real = real.view(nb, block_size, nb, block_size)
    any_allowed = allowed.any(3).any(1)
    all_allowed = (allowed | ~real).all(3).all(1)
    return torch.where(all_allowed & any_allowed, FULL, torch.where(any_allowed, PARTIAL, EMPTY)).to(torch.int8)
