"""Attention masks on CUDA: the CUDA ops equal the CPU ops, and flex attention with the built BlockMask equals SDPA with
the dense mask in forward and backward (fp32)."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import (
    BlockMaskBuilder,
    block_kinds,
    block_kinds_from_predicate,
    cod_sample,
    mask_block,
    mask_dense,
    mask_slice_block,
    mask_slice_dense,
    mask_slice_table,
)
from peagle.ops.mask import EMPTY, FULL
from testkit import random_packed_row

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

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
    (2048, 8, 0.8, 0.2, 600.0, 256, 128),
    (4096, 8, 0.8, 0.2, 1500.0, None, 128),
]


def sample(generator, length, num_depths, ratio, ratio_min, mean_doc, *, shuffle=False):
    row = random_packed_row(generator, length, mean_document_length=mean_doc)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, None, seed)
    if shuffle:
        order = torch.randperm(anchors.numel(), generator=generator)
        anchors, depths = anchors[order], depths[order]
    return anchors, depths, row.document_ids


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_cuda_equals_cpu(generator, case, shuffle):
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=shuffle)
    if a.numel() <= 8192:
        want = mask_dense(a, d, docs, window)
        got = mask_dense(a.cuda(), d.cuda().int(), docs.cuda(), window)
        assert got.is_cuda and torch.equal(got.cpu(), want)
    want_blocks = mask_block(a, d, docs, block, window)
    got_blocks = mask_block(a.cuda(), d.cuda(), docs.cuda().int(), block, window)
    for got, want in zip(got_blocks, want_blocks, strict=True):
        assert got.is_cuda and got.dtype == torch.int32 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_cuda_mask_slice_equals_cpu(generator, case, shuffle):
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc, shuffle=shuffle)
    table = mask_slice_table(length + 7, k, window)
    dev = [t.cuda() for t in (table, a, d, docs)]
    if a.numel() <= 8192:
        want = mask_slice_dense(table, a, d, docs)
        got = mask_slice_dense(dev[0], dev[1], dev[2].int(), dev[3])
        assert got.is_cuda and torch.equal(got.cpu(), want)
    want_blocks = mask_slice_block(table, a, d, docs, block)
    got_blocks = mask_slice_block(dev[0].long(), dev[1], dev[2], dev[3].int(), block)
    for got, want in zip(got_blocks, want_blocks, strict=True):
        assert got.is_cuda and got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    if length <= 300:
        torch.library.opcheck(torch.ops.peagle.mask_slice_block, (*dev, block))
        torch.library.opcheck(torch.ops.peagle.mask_slice_dense, tuple(dev))


def test_cuda_mask_slice_bad_inputs():
    docs = torch.zeros(4, dtype=torch.long, device="cuda")
    a, d = torch.tensor([0, 1], device="cuda"), torch.tensor([0, 2], device="cuda")
    with pytest.raises(RuntimeError, match=r"peagle\.mask_slice_dense: depths must be < the table's num_depths = 2"):
        torch.ops.peagle.mask_slice_dense(mask_slice_table(4, 2, device="cuda"), a, d, docs)
    with pytest.raises(RuntimeError, match=r"peagle\.mask_slice_block: table must be on the same device as anchors"):
        torch.ops.peagle.mask_slice_block(mask_slice_table(4, 3), a, d, docs, 4)


def test_cuda_block_classification_is_exact(generator):
    for _ in range(10):
        length = int(torch.randint(1, 1500, (), generator=generator))
        window = [None, 1, 9, 300][int(torch.randint(0, 4, (), generator=generator))]
        block = [1, 16, 128][int(torch.randint(0, 3, (), generator=generator))]
        a, d, docs = sample(generator, length, 8, 0.8, 0.2, 100.0)
        kinds = block_kinds(mask_block(a.cuda(), d.cuda(), docs.cuda(), block, window)).cpu()
        tight = block_kinds_from_predicate(a, d, docs, block, window)
        assert not ((tight != EMPTY) & (kinds == EMPTY)).any()
        assert not ((tight != FULL) & (kinds == FULL)).any()


@pytest.mark.parametrize("case", [c for c in CASES if c[6] >= 16])
def test_flex_forward_backward_equals_sdpa(generator, case):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    length, k, r, r_min, mean_doc, window, block = case
    a, d, docs = sample(generator, length, k, r, r_min, mean_doc)
    a, d, docs = a.cuda(), d.cuda(), docs.cuda()
    n = a.numel()
    block_mask = BlockMaskBuilder(block).build(a, d, docs, window)
    dense = mask_dense(a, d, docs, window)
    seen = dense.any(1)
    # Rows that may attend to nothing (padding) see themselves in the SDPA reference and are left out of the loss.
    ref_mask = dense | torch.diag(~seen)
    q0, k0, v0 = (torch.randn(1, 2, n, 32, generator=generator).cuda() for _ in range(3))
    grad_out = torch.randn(1, 2, n, 32, generator=generator).cuda() * seen[None, None, :, None]

    def run(attend):
        q, kk, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attend(q, kk, v)
        (out * grad_out).sum().backward()
        return out.detach(), q.grad, kk.grad, v.grad

    # flex attention's default tiles (64 or more) must divide the block size: smaller blocks get tiles of their size
    # (forward and both backward passes).
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
    options = {tile: block for tile in tiles} if block < 64 else None
    compiled = torch.compile(flex_attention)
    got = run(lambda q, kk, v: compiled(q, kk, v, block_mask=block_mask, kernel_options=options))
    with sdpa_kernel(SDPBackend.MATH):
        want = run(lambda q, kk, v: torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=ref_mask))
    torch.testing.assert_close(got[0][..., seen, :], want[0][..., seen, :], atol=1e-5, rtol=0)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_cuda_opcheck(generator):
    a, d, docs = sample(generator, 90, 4, 0.8, 0.2, 30.0)
    a, d, docs = a.cuda(), d.cuda(), docs.cuda()
    torch.library.opcheck(torch.ops.peagle.mask_dense, (a, d, docs, None))
    torch.library.opcheck(torch.ops.peagle.mask_block, (a, d, docs, 16, 12))


def test_cuda_bad_inputs():
    docs = torch.zeros(4, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match=r"peagle\.mask_block: anchors must be in \[0, T\) with T = 4"):
        torch.ops.peagle.mask_block(
            torch.tensor([0, 4], device="cuda"), torch.zeros(2, dtype=torch.long, device="cuda"), docs, 4, None
        )
    with pytest.raises(RuntimeError, match=r"peagle\.mask_dense: document_ids must be on the same device as anchors"):
        torch.ops.peagle.mask_dense(
            torch.zeros(2, dtype=torch.long, device="cuda"),
            torch.zeros(2, dtype=torch.long, device="cuda"),
            docs.cpu(),
            None,
        )
    with pytest.raises(RuntimeError, match=r"peagle\.mask_dense: depths must be >= 0, got -1"):
        torch.ops.peagle.mask_dense(
            torch.zeros(2, dtype=torch.long, device="cuda"), torch.tensor([0, -1], device="cuda"), docs, None
        )
