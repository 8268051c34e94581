"""Sequence partitioning: the summed per-segment loss and every gradient equal the whole row's (float64, CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from peagle.ops import cod_gather, cod_sample, mask_dense
from peagle.train import partition_elements, segment_boundaries, segment_masks
from peagle.train.stack import DrafterLikeStack
from testkit import random_packed_row

HIDDEN, FEATURES, VOCAB, HEADS = 32, 24, 50, 4


def make_row(generator, length, num_depths, mean_doc, ratio=0.8, ratio_min=0.2):
    row = random_packed_row(generator, length, mean_document_length=mean_doc)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, None, seed)
    return row, anchors, depths


def element_loss(model, row, hidden, input_ids, targets, anchors, depths, mask, weight):
    inputs = cod_gather(input_ids, hidden, model.mask_hidden, anchors, depths, VOCAB - 1)
    logits = model(inputs.feats, inputs.ids, inputs.position_ids, mask)
    losses = torch.nn.functional.cross_entropy(logits, targets[inputs.label_index], reduction="none")
    return (losses * weight).sum()


def grads_of(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("num_segments", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("layout", ["short_docs", "one_doc_window", "mixed"])
def test_partitioned_loss_and_gradients_equal_whole_row(generator, num_segments, layout):
    length, num_depths, mean_doc, window = {
        "short_docs": (96, 5, 20.0, None),
        "one_doc_window": (80, 4, 10_000.0, 9),
        "mixed": (120, 6, 45.0, 30),
    }[layout]
    row, anchors, depths = make_row(generator, length, num_depths, mean_doc)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
    model = DrafterLikeStack(HIDDEN, FEATURES, VOCAB, length + num_depths, num_layers=2, heads=HEADS).double()
    hidden = torch.randn(length, FEATURES, dtype=torch.float64, generator=generator, requires_grad=True)
    input_ids = torch.randint(0, VOCAB - 1, (length,), generator=generator)
    targets = torch.randint(0, VOCAB, (length + num_depths,), generator=generator)
    # Loss weight of an element: its label is trained and inside its anchor's document (the COD validity rule).
    label = anchors + depths
    docs = row.document_ids
    in_range = label < length
    label_c = label.clamp(max=length - 1)
    weight = (in_range & row.loss_mask[label_c] & (docs[anchors] == docs[label_c]) & (docs[anchors] != -1)).double()
    weight = weight * torch.rand(weight.shape, dtype=torch.float64, generator=generator)  # per-element weights too

    whole = element_loss(
        model, row, hidden, input_ids, targets, anchors, depths, mask_dense(anchors, depths, docs, window), weight
    )
    whole.backward()
    want_grads = grads_of(model)
    want_hidden = hidden.grad.clone()
    model.zero_grad()
    hidden.grad = None

    segments = partition_elements(anchors, depths, docs, num_segments, window=window, num_layers=2)
    masks = segment_masks(segments, docs, window)
    total = torch.zeros((), dtype=torch.float64)
    owned_count = torch.zeros(anchors.numel(), dtype=torch.long)
    for seg, mask in zip(segments, masks, strict=True):
        owned_count[seg.index[seg.owned]] += 1
        seg_weight = torch.where(seg.owned, weight[seg.index], 0.0)
        loss = element_loss(model, row, hidden, input_ids, targets, seg.anchors, seg.depths, mask, seg_weight)
        loss.backward()  # gradients accumulate across segments
        total = total + loss.detach()
    assert torch.equal(owned_count, torch.ones_like(owned_count)), "every element is owned by exactly one segment"

    def rel(x, y):
        return float((x - y).abs().max() / y.abs().max().clamp(min=1e-300))

    assert rel(total, whole.detach()) <= 1e-10
    for name, p in model.named_parameters():
        assert rel(p.grad, want_grads[name]) <= 1e-10, name
    assert rel(hidden.grad, want_hidden) <= 1e-10


def test_segment_ownership_rules(generator):
    row, anchors, depths = make_row(generator, 200, 6, 50.0)
    bounds = torch.tensor([0, 37, 90, 91, 200])
    segments = partition_elements(anchors, depths, row.document_ids, boundaries=bounds)
    owner = torch.full((anchors.numel(),), -1)
    for s, seg in enumerate(segments):
        owner[seg.index[seg.owned]] = s
        # Context is depth 0 only, before the segment's first position.
        ctx = seg.index[~seg.owned]
        assert bool((depths[ctx] == 0).all()) and bool((anchors[ctx] < bounds[s]).all())
        assert torch.equal(seg.index, torch.sort(seg.index).values)
    segment_of = {(int(a), int(d)): int(o) for a, d, o in zip(anchors, depths, owner, strict=True)}
    for (a, d), s in segment_of.items():
        position = a + min(d, 1)
        if d <= 1:
            assert bounds[s] <= position < bounds[s + 1] or (position == 200 and s == 3)
        else:
            assert s == segment_of[(a, d - 1)], "a deeper element inherits its parent's segment"


def test_block_masks_of_segments_match_dense(generator):
    row, anchors, depths = make_row(generator, 150, 4, 40.0)
    segments = partition_elements(anchors, depths, row.document_ids, 3, window=12, num_layers=2)
    dense = segment_masks(segments, row.document_ids, 12)
    blocks = segment_masks(segments, row.document_ids, 12, kind="block", block_size=16)
    for mask, block_mask in zip(dense, blocks, strict=True):
        n = mask.shape[0]
        q, k, v = torch.randn(3, 1, 1, n, 8, generator=generator).unbind(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, block_mask=block_mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        seen = mask.any(1)
        torch.testing.assert_close(out[..., seen, :], want[..., seen, :], atol=1e-5, rtol=0)


def test_partition_bad_arguments():
    docs = torch.zeros(10, dtype=torch.long)
    a = torch.arange(10)
    d = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one"):
        partition_elements(a, d, docs)
    with pytest.raises(ValueError, match="num_segments must be >= 1"):
        partition_elements(a, d, docs, 0)
    with pytest.raises(ValueError, match=r"boundaries must be non-decreasing from 0 to T = 10"):
        partition_elements(a, d, docs, boundaries=torch.tensor([0, 5, 9]))
    with pytest.raises(ValueError, match="window must be None or >= 1"):
        partition_elements(a, d, docs, 2, window=0)
    assert segment_boundaries(10, 3).tolist() == [0, 3, 6, 10]
