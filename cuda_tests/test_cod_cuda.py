"""COD ops on CUDA == the CPU ops (which the CPU suite proves against the references). Skips without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import cod_gather, cod_sample
from testkit import fresh_seed, random_packed_row

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("length", [1, 2, 17, 300, 2048, 16384])
@pytest.mark.parametrize(
    "num_depths,ratio,ratio_min,max_anchors",
    [(1, 0.7, 0.2, None), (8, 0.7, 0.2, None), (8, 0.7, 0.2, 512), (8, 1.0, 0.0, None), (6, 0.3, 0.3, 1)],
)
def test_cod_sample_cuda_equals_cpu(generator, length, num_depths, ratio, ratio_min, max_anchors):
    # The selection keys are a hash of (seed, depth, anchor), so both backends draw the very same elements.
    for _ in range(3):
        row = random_packed_row(generator, length, mean_document_length=max(2.0, length / 8))
        seed = int(torch.randint(-(2**62), 2**62, (), generator=generator))
        cpu = cod_sample(row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, max_anchors, seed)
        gpu = cod_sample(
            row.loss_mask.cuda(), row.document_ids.int().cuda(), num_depths, ratio, ratio_min, max_anchors, seed
        )
        assert gpu[0].is_cuda and gpu[1].is_cuda
        assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("width", [1, 3, 8, 96, 257, 3 * 4096])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_cod_gather_cuda_equals_cpu(generator, dtype, width, id_dtype):
    length = 512
    row = random_packed_row(generator, length)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 8, 0.7, 0.2, None, fresh_seed())
    dup = torch.randint(0, anchors.numel(), (64,), generator=generator)
    anchors, depths = torch.cat([anchors, anchors[dup]]), torch.cat([depths, depths[dup]])
    input_ids = torch.randint(0, 32000, (length,), generator=generator, dtype=id_dtype)
    hidden = torch.randn(length, width, generator=generator).to(dtype)
    mask_hidden = torch.randn(width, generator=generator).to(dtype)
    cpu = cod_gather(input_ids, hidden, mask_hidden, anchors, depths, 31999)
    dev = [t.cuda() for t in (input_ids, hidden, mask_hidden, anchors, depths)]
    gpu = cod_gather(*dev, 31999)
    for name, got, want in zip(cpu._fields, gpu, cpu, strict=True):
        assert torch.equal(got.cpu(), want), name

    grad = torch.randn(anchors.numel(), width, generator=generator).to(dtype)
    cpu_grads = torch.ops.peagle.cod_gather_backward(grad, anchors, depths, length)
    gpu_grads = torch.ops.peagle.cod_gather_backward(grad.cuda(), anchors.cuda(), depths.cuda(), length)
    for got, want in zip(gpu_grads, cpu_grads, strict=True):
        # Both add in the fixed order of csrc/include/peagle/cod.h: bit-identical.
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cod_gather_backward_cuda_is_deterministic(generator, dtype):
    """Many rows (several sort passes and 256-row chunks), duplicate depth-0 anchors: identical gradients run to run
    and equal to the CPU's, bit for bit."""
    length, width, count = 3000, 200, 40000
    anchors = torch.randint(0, length - 8, (count,), generator=generator)
    depths = torch.randint(0, 8, (count,), generator=generator) * (torch.rand(count, generator=generator) < 0.5)
    grad = torch.randn(count, width, generator=generator).to(dtype)
    cpu = torch.ops.peagle.cod_gather_backward(grad, anchors, depths, length)
    args = (grad.cuda(), anchors.cuda(), depths.cuda(), length)
    first = torch.ops.peagle.cod_gather_backward(*args)
    for _ in range(3):
        again = torch.ops.peagle.cod_gather_backward(*args)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    for got, want in zip(first, cpu, strict=True):
        assert torch.equal(got.cpu(), want)


def test_cod_gather_cuda_unaligned_rows_and_views(generator):
    """The kernel copies 16-byte units only when the rows and every pointer allow it. Contiguous views with a storage
    offset (the wrapper passes them on as they are, no copy) reach each narrower copy path."""
    anchors = torch.randint(0, 90, (300,), generator=generator)
    depths = torch.randint(0, 10, (300,), generator=generator)
    ids = torch.arange(100)
    # (width, storage offset in elements): 80-byte rows 2 bytes in (2-byte units), 4 bytes in (4-byte units), 8 bytes
    # in (8-byte units); 82-byte rows (2-byte units); aligned 80-byte rows (16-byte units) as the control.
    for width, offset in [(40, 1), (40, 2), (40, 4), (41, 0), (40, 0)]:
        flat = torch.randn(offset + 100 * width, generator=generator, dtype=torch.bfloat16)
        mask_flat = torch.randn(offset + width, generator=generator, dtype=torch.bfloat16)
        hidden, mask_hidden = flat[offset:].view(100, width), mask_flat[offset:]
        cpu = cod_gather(ids, hidden, mask_hidden, anchors, depths, 7)
        flat_gpu, mask_gpu = flat.cuda(), mask_flat.cuda()
        hidden_gpu, mask_hidden_gpu = flat_gpu[offset:].view(100, width), mask_gpu[offset:]
        assert hidden_gpu.is_contiguous() and hidden_gpu.storage_offset() == offset
        assert (hidden_gpu.data_ptr() % 16 != 0) == (offset != 0)
        gpu = cod_gather(ids.cuda(), hidden_gpu, mask_hidden_gpu, anchors.cuda(), depths.cuda(), 7)
        assert torch.equal(gpu.feats.cpu(), cpu.feats), (width, offset)


def test_cod_gather_cuda_gradcheck(generator):
    # The generator is a CPU one: draw on the host, then move.
    hidden = torch.randn(30, 6, generator=generator, dtype=torch.float64).cuda().requires_grad_()
    mask_hidden = torch.randn(6, generator=generator, dtype=torch.float64).cuda().requires_grad_()
    anchors = torch.randint(0, 25, (60,), generator=generator).cuda()
    depths = torch.randint(0, 5, (60,), generator=generator).cuda()
    ids = torch.arange(30, device="cuda")
    assert torch.autograd.gradcheck(lambda h, m: cod_gather(ids, h, m, anchors, depths, 0).feats, (hidden, mask_hidden))


def test_cod_cuda_opcheck_and_errors(generator):
    row = random_packed_row(generator, 200)
    mask, docs = row.loss_mask.cuda(), row.document_ids.cuda()
    torch.library.opcheck(torch.ops.peagle.cod_sample, (mask, docs, 8, 0.7, 0.2, 32, 5))
    anchors, depths = cod_sample(mask, docs, 8, 0.7, 0.2, None, 5)
    hidden = torch.randn(200, 16, device="cuda", requires_grad=True)
    mask_hidden = torch.randn(16, device="cuda", requires_grad=True)
    ids = torch.arange(200, device="cuda")
    torch.library.opcheck(torch.ops.peagle.cod_gather, (ids, hidden, mask_hidden, anchors, depths, 3, None))
    with pytest.raises(RuntimeError, match="out of range for T = 200"):
        cod_gather(
            ids, hidden, mask_hidden, torch.tensor([0, 199], device="cuda"), torch.tensor([0, 1], device="cuda"), 3
        )
    with pytest.raises(RuntimeError, match="must be on the same device"):
        cod_gather(ids.cpu(), hidden, mask_hidden, anchors, depths, 3)
    with pytest.raises(RuntimeError, match="must be on the same device"):
        cod_sample(mask, row.document_ids, 8, 0.7, 0.2, None, 5)
