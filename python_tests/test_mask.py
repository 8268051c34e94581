"""P-EAGLE attention masks on the CPU: dense mask and block classification against the references and the predicate."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from peagle.ops import (
    BlockMaskBuilder,
    MaskSlicer,
    block_kinds,
    block_kinds_from_dense,
    block_kinds_from_predicate,
    build_block_mask,
    cod_sample,
    make_mask_mod,
    mask_block,
    mask_block_reference,
    mask_dense,
    mask_dense_reference,
    mask_slice_block,
    mask_slice_block_reference,
    mask_slice_dense,
    mask_slice_dense_reference,
    mask_slice_table,
)
from peagle.ops.mask import EMPTY, FULL, PARTIAL
from testkit import random_packed_row

# T, num_depths, ratio, ratio_min, mean document length, window, block size
CASES = [
    (1, 1, 0.7, 0.2, 50.0, None, 128),
    (5, 4, 1.0, 0.0, 3.0, None, 2),
    (64, 4, 0.7, 0.2, 16.0, 3, 4),
    (64, 8, 1.0, 1.0, 1000.0, None, 1),
    (200, 8, 0.8, 0.2, 60.0, None, 16),
    (300, 2, 0.5, 0.0, 30.0, 7, 32),
    (513, 8, 0.8, 0.2, 200.0, None, 128),
    (700, 6, 0.9, 0.1, 5000.0, 100, 64),
    (1024, 8, 0.8, 0.2, 400.0, 256, 128),
    (1500, 3, 0.3, 0.3, 8.0, None, 128),
]


def sample(generator, length, num_depths, ratio, ratio_min, mean_doc, *, shuffle=False, int32=False):
    row = random_packed_row(generator, length, mean_document_length=mean_doc)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, None, seed)
    docs = row.document_ids
    if shuffle:  # the ops must not rely on the COD layout
        order = torch.randperm(anchors.numel(), generator=generator)
        anchors, depths = anchors[order], depths[order]
    if int32:
        anchors, depths, docs = anchors.int(), depths.int(), docs.int()
    return anchors, depths, docs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["cod", "shuffled_int32"])
def test_mask_dense_matches_reference(generator, case, variant):
    length, k, r, r_min, mean_doc, window, _ = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=variant != "cod", int32=variant != "cod")
    dense = mask_dense(a, d, docs, window)
    assert dense.dtype == torch.bool and dense.shape == (a.numel(), a.numel())
    assert torch.equal(dense, mask_dense_reference(a, d, docs, window))


@pytest.mark.parametrize("shift", ["documents", "past_row_end", "window"])
def test_mask_dense_values_beyond_int32(generator, shift):
    """The dense kernel runs on 32-bit copies of the fields when they fit; values that do not take the 64-bit path."""
    a, d, docs = sample(generator, 300, 6, 0.8, 0.2, 40.0, shuffle=True)
    window = 2**40 if shift == "window" else 5
    if shift == "documents":
        docs = torch.where(docs == -1, docs, docs + 2**40)
    if shift == "past_row_end":  # chains from the last anchors run past the row (depth < T still holds)
        d = torch.where(d > 0, d + (300 - a).clamp(min=0), d).clamp(max=299)
        assert ((a + d) >= 300).any()
    assert torch.equal(mask_dense(a, d, docs, window), mask_dense_reference(a, d, docs, window))


def test_mask_dense_against_scalar_predicate(generator):
    """The reference itself, checked pair by pair against the DESIGN.md predicate written out in plain Python."""
    a, d, docs = sample(generator, 40, 5, 0.9, 0.3, 12.0, shuffle=True)
    for window in (None, 1, 4):
        dense = mask_dense(a, d, docs, window).tolist()
        al, dl, doc = a.tolist(), d.tolist(), docs.tolist()
        for q in range(len(al)):
            for k in range(len(al)):
                dq, dk = doc[al[q]], doc[al[k]]
                causal = dl[k] == 0 and al[k] <= al[q] and (window is None or al[k] > al[q] + dl[q] - window)
                chain = al[k] == al[q] and dl[k] <= dl[q]
                assert dense[q][k] == (dq != -1 and dq == dk and (causal or chain))


def check_exact(kinds: torch.Tensor, tight: torch.Tensor) -> None:
    assert not ((tight != EMPTY) & (kinds == EMPTY)).any(), "a block with an allowed pair was marked empty"
    assert not ((tight != FULL) & (kinds == FULL)).any(), "a block with a disallowed pair was marked full"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["cod", "shuffled_int32"])
def test_mask_block_matches_reference_and_is_exact(generator, case, variant):
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=variant != "cod", int32=variant != "cod")
    blocks = mask_block(a, d, docs, block, window)
    ref = mask_block_reference(a, d, docs, block, window)
    nb = -(-a.numel() // block)
    for got, want in zip(blocks, ref, strict=True):
        assert got.dtype == torch.int32 and got.shape[0] == nb
        assert torch.equal(got, want)
    kinds = block_kinds(blocks)
    check_exact(kinds, block_kinds_from_predicate(a, d, docs, block, window))
    # Indices are listed ascending, without repeats, and a block is never both partial and full.
    for num, idx in ((blocks.kv_num_blocks, blocks.kv_indices), (blocks.full_kv_num_blocks, blocks.full_kv_indices)):
        for row in range(nb):
            live = idx[row, : num[row]]
            assert torch.equal(live, torch.sort(torch.unique(live)).values)
    assert torch.equal((kinds == PARTIAL).sum(1).int(), blocks.kv_num_blocks)
    assert torch.equal((kinds == FULL).sum(1).int(), blocks.full_kv_num_blocks)


def test_block_classification_exact_many_random_samples(generator):
    """Many random rows and layouts; also reports how often a block create_block_mask calls full is partial here."""
    full_tight, full_missed, nonempty_tight, empty_missed = 0, 0, 0, 0
    for _ in range(40):
        length = int(torch.randint(1, 1200, (), generator=generator))
        k = int(torch.randint(1, 9, (), generator=generator))
        r = float(torch.empty(()).uniform_(0.3, 1.0, generator=generator))
        r_min = r * float(torch.rand((), generator=generator))
        mean_doc = float(torch.empty(()).uniform_(2.0, 2000.0, generator=generator))
        window = [None, 1, 5, 64, 500][int(torch.randint(0, 5, (), generator=generator))]
        block = [1, 3, 16, 64, 128][int(torch.randint(0, 5, (), generator=generator))]
        a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=bool(torch.rand(()) < 0.2))
        kinds = block_kinds(mask_block(a, d, docs, block, window))
        tight = block_kinds_from_predicate(a, d, docs, block, window)
        check_exact(kinds, tight)
        full_tight += int((tight == FULL).sum())
        full_missed += int(((tight == FULL) & (kinds == PARTIAL)).sum())
        nonempty_tight += int((tight != EMPTY).sum())
        empty_missed += int(((tight == EMPTY) & (kinds != EMPTY)).sum())
    print(f"full blocks kept partial: {full_missed}/{full_tight}; empty blocks kept partial: {empty_missed}")


@pytest.mark.parametrize("length", [2048, 4096])
def test_conservative_partial_rate_at_training_settings(generator, length):
    """At K = 8, ratio 0.8 / 0.2, block 128: under 5% of create_block_mask's full blocks are conservatively partial."""
    a, d, docs = sample(generator, length, 8, 0.8, 0.2, 1500.0)
    kinds = block_kinds(mask_block(a, d, docs, 128))
    tight = block_kinds_from_predicate(a, d, docs, 128)
    check_exact(kinds, tight)
    full = int((tight == FULL).sum())
    missed = int(((tight == FULL) & (kinds == PARTIAL)).sum())
    print(f"T={length}: {missed}/{full} full blocks kept partial ({100.0 * missed / max(full, 1):.2f}%)")
    assert missed <= 0.05 * full


def flex_vs_sdpa(a, d, docs, block, window, generator, builder=None):
    n = a.numel()
    q, k, v = torch.randn(3, 1, 2, n, 16, generator=generator).unbind(0)
    if builder is None:
        block_mask = build_block_mask(a, d, docs, block, window)
    else:
        block_mask = builder.build(a, d, docs, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex attention warns that it is unfused
        out = flex_attention(q, k, v, block_mask=block_mask)
    dense = mask_dense(a, d, docs, window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    # Queries that may attend to nothing (padding) are zero in flex attention; SDPA's value there is a convention.
    seen = dense.any(1)
    torch.testing.assert_close(out[..., seen, :], want[..., seen, :], atol=1e-5, rtol=0)
    assert torch.equal(out[..., ~seen, :], torch.zeros_like(out[..., ~seen, :]))


@pytest.mark.parametrize("case", CASES)
def test_flex_attention_with_block_mask_equals_sdpa_with_dense_mask(generator, case):
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc)
    flex_vs_sdpa(a, d, docs, block, window, generator)


def test_builder_reuses_buffers_across_samples(generator):
    builder = BlockMaskBuilder(block_size=32, max_elements=4000, device="cpu")
    capacity = builder._capacity
    mods = []
    for length, window in ((400, None), (150, 20), (380, None), (90, 5)):
        a, d, docs = sample(generator, length, 6, 0.8, 0.2, 80.0)
        flex_vs_sdpa(a, d, docs, 32, window, generator, builder=builder)
        mods.append(builder.build(a, d, docs, window).mask_mod)
    # Samples with the same window share one mask_mod over the same (max-length) buffers.
    assert mods[0] is mods[2] and builder._capacity == capacity == 4000
    # A longer sample grows the buffers (to whole blocks) and still gives the right attention.
    docs = torch.zeros(900, dtype=torch.long)  # one fully trained document: ~7.2K elements at K = 8, ratio 1
    a, d = cod_sample(torch.ones(900, dtype=torch.bool), docs, 8, 1.0, 1.0, None, 0)
    assert a.numel() > capacity
    flex_vs_sdpa(a, d, docs, 32, None, generator, builder=builder)
    assert builder._capacity >= a.numel() and builder._capacity % 32 == 0


def test_mask_mod_matches_dense(generator):
    a, d, docs = sample(generator, 150, 5, 0.8, 0.2, 40.0, shuffle=True)
    n = a.numel()
    for window in (None, 9):
        mod = make_mask_mod(a, d, docs, window)
        q_idx = torch.arange(n)[:, None].expand(n, n)
        kv_idx = torch.arange(n)[None, :].expand(n, n)
        got = mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q_idx, kv_idx)
        assert torch.equal(got, mask_dense(a, d, docs, window))


def test_edge_cases():
    docs = torch.tensor([0, 0, -1, 1])
    empty = torch.empty(0, dtype=torch.long)
    assert mask_dense(empty, empty, docs).shape == (0, 0)
    blocks = mask_block(empty, empty, docs, 4)
    assert all(t.shape[0] == 0 for t in blocks)
    # All padding: nothing is allowed, every block is empty.
    a = torch.tensor([0, 1, 2, 0])
    d = torch.tensor([0, 0, 0, 1])
    pad = torch.full((4,), -1)
    assert not mask_dense(a, d, pad).any()
    assert int(mask_block(a, d, pad, 2).kv_num_blocks.sum()) == 0
    # Block size larger than N: one block, partial (a disallowed pair exists).
    blocks = mask_block(a, d, docs, 1000)
    assert blocks.kv_num_blocks.tolist() == [1] and blocks.full_kv_num_blocks.tolist() == [0]
    # A single element sees itself: one full 1x1 block.
    one = torch.tensor([3])
    blocks = mask_block(one, torch.tensor([0]), docs, 1)
    assert blocks.full_kv_num_blocks.tolist() == [1] and blocks.kv_num_blocks.tolist() == [0]
    # Window 1 keeps only the own chain and, at depth 0, the element itself.
    a = torch.tensor([0, 1, 1])
    d = torch.tensor([0, 0, 1])
    got = mask_dense(a, d, torch.tensor([0, 0, 0]), 1)
    assert got.tolist() == [[True, False, False], [False, True, False], [False, True, True]]


def test_opcheck(generator):
    a, d, docs = sample(generator, 90, 4, 0.8, 0.2, 30.0)
    torch.library.opcheck(torch.ops.peagle.mask_dense, (a, d, docs, None))
    torch.library.opcheck(torch.ops.peagle.mask_dense, (a.int(), d.int(), docs.int(), 7))
    torch.library.opcheck(torch.ops.peagle.mask_block, (a, d, docs, 16, None))
    torch.library.opcheck(torch.ops.peagle.mask_block, (a, d, docs, 128, 12))


def test_compiled_mask_ops(generator):
    a, d, docs = sample(generator, 60, 3, 0.8, 0.2, 30.0)

    def fn(a, d, docs):
        return mask_dense(a, d, docs, 5).sum(), mask_block(a, d, docs, 8).kv_num_blocks.sum()

    got = torch.compile(fn, backend="eager", fullgraph=True)(a, d, docs)
    want = fn(a, d, docs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


BAD = [
    # (anchors, depths, docs, block, window, message)
    (
        torch.zeros(2, 1, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        r"anchors must be 1-D \[N\], got shape \[2, 1\]",
    ),
    (
        torch.zeros(2, dtype=torch.long),
        torch.zeros(3, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        "anchors and depths must have the same length N, got 2 and 3",
    ),
    (
        torch.zeros(2),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        "anchors must be int32 or int64, got Float",
    ),
    (
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4),
        4,
        None,
        "document_ids must be int32 or int64, got Float",
    ),
    (
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4, 1, dtype=torch.long),
        4,
        None,
        r"document_ids must be 1-D \[T\]",
    ),
    (
        torch.tensor([0, 4]),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        r"anchors must be in \[0, T\) with T = 4 \(len\(document_ids\)\), got values in \[0, 4\]",
    ),
    (
        torch.tensor([-1, 2]),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        r"anchors must be in \[0, T\)",
    ),
    (
        torch.tensor([0, 2]),
        torch.tensor([0, -2]),
        torch.zeros(4, dtype=torch.long),
        4,
        None,
        "depths must be >= 0, got -2",
    ),
    (
        torch.tensor([0, 2]),
        torch.tensor([0, 1]),
        torch.zeros(4, dtype=torch.long),
        4,
        0,
        "window must be None or >= 1, got 0",
    ),
]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("op", ["mask_dense", "mask_block"])
def test_bad_inputs(bad, op):
    a, d, docs, block, window, message = bad
    with pytest.raises(RuntimeError, match=f"peagle.{op}: {message}"):
        if op == "mask_dense":
            torch.ops.peagle.mask_dense(a, d, docs, window)
        else:
            torch.ops.peagle.mask_block(a, d, docs, block, window)


def test_bad_block_size():
    a = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"peagle\.mask_block: block_size must be in \[1, 65536\], got 0"):
        torch.ops.peagle.mask_block(a, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0, None)
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 65536\], got 0"):
        BlockMaskBuilder(0)


@pytest.mark.parametrize("op", ["mask_dense", "mask_block"])
def test_document_ids_below_minus_one_are_rejected_as_in_cod_sample(op):
    # One rule for every op: -1 is padding, other negative ids are an error (cod_sample treats them alike).
    a, d = torch.tensor([0, 1]), torch.tensor([0, 0])
    docs = torch.tensor([-2, -2, 0, 0])
    with pytest.raises(RuntimeError, match=rf"peagle\.{op}: document_ids must be >= -1 \(-1 = padding\), got -2"):
        if op == "mask_dense":
            torch.ops.peagle.mask_dense(a, d, docs, None)
        else:
            torch.ops.peagle.mask_block(a, d, docs, 128, None)


@pytest.mark.parametrize("op", ["mask_dense", "mask_block"])
def test_depths_past_the_row_are_rejected_before_window_arithmetic(op):
    # A depth near 2^63 overflowed anchor + depth - window; depths are bounded by the row: depth < T.
    a, d = torch.tensor([0, 1]), torch.tensor([0, 2**63 - 2])
    docs = torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=rf"peagle\.{op}: depths\[1\] = {2**63 - 2} is out of range for T = 4"):
        if op == "mask_dense":
            torch.ops.peagle.mask_dense(a, d, docs, 3)
        else:
            torch.ops.peagle.mask_block(a, d, docs, 128, 3)


def test_block_size_is_bounded():
    a = torch.tensor([0, 1])
    with pytest.raises(
        RuntimeError, match=r"peagle\.mask_block: block_size must be in \[1, 65536\], got 1099511627776"
    ):
        torch.ops.peagle.mask_block(a, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 2**40, None)


# ---------------------------------------------------------------------------------------------------------------------
# mask_slice: the masks sliced out of the max-length table (the paper's amortized construction).


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["cod", "shuffled_int32"])
def test_mask_slice_matches_predicate_and_reference(generator, case, variant):
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=variant != "cod", int32=variant != "cod")
    extra = int(torch.randint(0, 50, (), generator=generator))  # the table covers the longest sample, not this one
    table = mask_slice_table(length + extra, k + int(extra % 3), window)
    if variant != "cod":
        table = table.long()
    dense = mask_slice_dense(table, a, d, docs)
    assert dense.dtype == torch.bool and dense.shape == (a.numel(), a.numel())
    assert torch.equal(dense, mask_dense_reference(a, d, docs, window))  # the predicate itself
    assert torch.equal(dense, mask_slice_dense_reference(table, a, d, docs))
    blocks = mask_slice_block(table, a, d, docs, block)
    for got, want, plain in zip(
        blocks, mask_slice_block_reference(table, a, d, docs, block), mask_block(a, d, docs, block, window), strict=True
    ):
        assert got.dtype == torch.int32 and torch.equal(got, want) and torch.equal(got, plain)
    check_exact(block_kinds(blocks), block_kinds_from_predicate(a, d, docs, block, window))


def test_mask_slice_follows_any_table(generator):
    """Arbitrary tables (negative, past the anchor, per-row): the ops follow table[d, a] as the causal bound."""
    for _ in range(8):
        length = int(torch.randint(1, 300, (), generator=generator))
        a, d, docs = sample(
            generator, length, 5, 0.8, 0.3, 30.0, shuffle=bool(torch.rand((), generator=generator) < 0.5)
        )
        table = torch.randint(-5, length + 5, (5, length), generator=generator)
        block = [1, 4, 16, 64][int(torch.randint(0, 4, (), generator=generator))]
        want = mask_slice_dense_reference(table, a, d, docs)
        assert torch.equal(mask_slice_dense(table, a, d, docs), want)
        blocks = mask_slice_block(table, a, d, docs, block)
        for got, ref in zip(blocks, mask_slice_block_reference(table, a, d, docs, block), strict=True):
            assert torch.equal(got, ref)
        check_exact(block_kinds(blocks), block_kinds_from_dense(want, block))


def test_mask_slice_check_can_fail(generator):
    """Power check: a table one step off the window gives a different mask, and the comparison above would see it."""
    a, d, docs = sample(generator, 200, 6, 0.9, 0.3, 100.0)
    wrong = mask_slice_table(200, 6, 9)  # window 9 instead of 8
    assert not torch.equal(mask_slice_dense(wrong, a, d, docs), mask_dense_reference(a, d, docs, 8))
    tight = block_kinds_from_predicate(a, d, docs, 1, 8)  # block 1: kinds are the dense mask itself
    with pytest.raises(AssertionError):
        check_exact(block_kinds(mask_slice_block(wrong, a, d, docs, 1)), tight)


def test_mask_slice_table_values():
    assert mask_slice_table(4, 2).tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    # Window 2: element (a, d) sees depth-0 anchors a_k > a + d - 2.
    assert mask_slice_table(5, 3, 2).tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert mask_slice_table(3, 1).dtype == torch.int32
    with pytest.raises(ValueError, match="max_length and num_depths must be >= 1, got 0 and 2"):
        mask_slice_table(0, 2)
    with pytest.raises(ValueError, match="window must be None or >= 1, got 0"):
        mask_slice_table(3, 2, 0)


def test_mask_slice_edge_cases():
    table = mask_slice_table(8, 4)
    docs = torch.tensor([0, 0, -1, 1])
    empty = torch.empty(0, dtype=torch.long)
    assert mask_slice_dense(table, empty, empty, docs).shape == (0, 0)
    assert all(t.shape[0] == 0 for t in mask_slice_block(table, empty, empty, docs, 4))
    # The table exactly as long as the row, the last anchor at its deepest depth.
    a, d = torch.tensor([0, 1, 3, 3]), torch.tensor([0, 0, 0, 3])
    exact = mask_slice_table(4, 4, 2)
    assert torch.equal(mask_slice_dense(exact, a, d, docs), mask_dense_reference(a, d, docs, 2))
    # Padding sees nothing; a single element sees itself (one full block).
    assert not mask_slice_dense(table, a, d, torch.full((4,), -1)).any()
    blocks = mask_slice_block(table, torch.tensor([3]), torch.tensor([0]), docs, 1)
    assert blocks.full_kv_num_blocks.tolist() == [1] and blocks.kv_num_blocks.tolist() == [0]


def test_mask_slicer_masks_attend_like_sdpa(generator):
    slicer = MaskSlicer(max_length=500, num_depths=6, window=40, block_size=32)
    for length in (480, 130):
        a, d, docs = sample(generator, length, 6, 0.8, 0.2, 60.0)
        dense = slicer.dense(a, d, docs)
        assert torch.equal(dense, mask_dense_reference(a, d, docs, 40))
        n = a.numel()
        q, k, v = torch.randn(3, 1, 2, n, 16, generator=generator).unbind(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, block_mask=slicer.block_mask(a, d, docs))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        seen = dense.any(1)
        torch.testing.assert_close(out[..., seen, :], want[..., seen, :], atol=1e-5, rtol=0)


def test_mask_slice_opcheck(generator):
    a, d, docs = sample(generator, 90, 4, 0.8, 0.2, 30.0)
    table = mask_slice_table(100, 4, 7)
    torch.library.opcheck(torch.ops.peagle.mask_slice_dense, (table, a, d, docs))
    torch.library.opcheck(torch.ops.peagle.mask_slice_dense, (table.long(), a.int(), d.int(), docs.int()))
    torch.library.opcheck(torch.ops.peagle.mask_slice_block, (table, a, d, docs, 16))
    torch.library.opcheck(torch.ops.peagle.mask_slice_block, (mask_slice_table(90, 4), a, d, docs, 128))


SLICE_BAD = [
    # (table, anchors, depths, message)
    (
        torch.zeros(4, dtype=torch.int32),
        torch.tensor([0]),
        torch.tensor([0]),
        r"table must be 2-D \[num_depths, max_length\]",
    ),
    (torch.zeros(2, 4), torch.tensor([0]), torch.tensor([0]), "table must be int32 or int64, got Float"),
    (
        torch.zeros(2, 3, dtype=torch.int32),
        torch.tensor([0, 3]),
        torch.tensor([0, 0]),
        r"anchors must be < the table's max_length = 3 \(table.shape\[1\]\), got 3",
    ),
    (
        torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([0, 1]),
        torch.tensor([0, 2]),
        r"depths must be < the table's num_depths = 2 \(table.shape\[0\]\), got 2",
    ),
    (torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 4]), torch.tensor([0, 0]), r"anchors must be in \[0, T\)"),
    (torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([0, -1]), "depths must be >= 0, got -1"),
]


@pytest.mark.parametrize("bad", SLICE_BAD)
@pytest.mark.parametrize("op", ["mask_slice_dense", "mask_slice_block"])
def test_mask_slice_bad_inputs(bad, op):
    table, a, d, message = bad
    docs = torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=f"peagle.{op}: {message}"):
        if op == "mask_slice_dense":
            torch.ops.peagle.mask_slice_dense(table, a, d, docs)
        else:
            torch.ops.peagle.mask_slice_block(table, a, d, docs, 4)
    if op == "mask_slice_block":
        with pytest.raises(RuntimeError, match=r"peagle\.mask_slice_block: block_size must be in \[1, 65536\], got 0"):
            torch.ops.peagle.mask_slice_block(mask_slice_table(4, 2), torch.tensor([0]), torch.tensor([0]), docs, 0)
