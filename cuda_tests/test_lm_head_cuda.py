"""efficient_lm_head on CUDA: CUDA op == CPU op bit for bit on exactly representable inputs (the CPU tests hold the CPU
op to the reference), within float32 rounding on random ones, across vocabulary chunks, CUTLASS tensor-op / SIMT and
fallback operands, ties, the device check and opcheck."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import efficient_lm_head
from python_tests.test_lm_head import DTYPES, HeadInputs, assert_selection_close, random_inputs, run_op

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_cuda(inputs: HeadInputs, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logits = run_op(inputs.to("cuda"), num_candidates)
    torch.cuda.synchronize()
    return ids.cpu(), logits.cpu()


SHAPES = [  # rows N, hidden H, rank r, vocab V, candidates C
    (1, 8, 2, 5, 1),
    (3, 16, 8, 50, 50),  # r = 8, but V = 50 is no multiple of the tensor-op epilogue's 4: 16-bit falls back to tiles
    (5, 33, 3, 300, 7),  # r = 3: SIMT fallback for 16-bit operands
    (2, 64, 16, 1000, 128),
    (70, 40, 8, 5000, 64),
    (1, 16, 8, 151936, 128),  # one chunk holds the whole vocabulary
    (1024, 24, 8, 40000, 128),  # 32768-token chunks: two, the running top C carried across them
    (0, 8, 2, 10, 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_equals_cpu_on_exact_inputs(generator, dtype, shape):
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype)
    ids, logits = run_cuda(inputs, candidates)
    want_ids, want_logits = run_op(inputs, candidates)
    assert torch.equal(ids, want_ids)
    assert torch.equal(logits, want_logits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 64, 16, 6000, 128), (1, 100, 7, 5000, 1), (300, 128, 32, 151936, 128)])
def test_cuda_matches_cpu_on_random_inputs(generator, dtype, shape):
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype, kind="normal")
    ids, logits = run_cuda(inputs, candidates)
    assert_selection_close(ids, logits, inputs, candidates, dtype)
    want_ids, _ = run_op(inputs, candidates)
    assert (ids == want_ids).float().mean() > 0.9


def test_cuda_ties_and_non_finite_scores():
    hidden, down = torch.tensor([[1.0]]), torch.tensor([[1.0]])
    up = torch.tensor([[float("nan")], [-0.0], [float("-inf")], [0.0], [2.0], [float("inf")], [2.0]])
    weight = torch.arange(7.0)[:, None]
    for c in range(1, 8):
        ids, logits = run_cuda(HeadInputs(hidden, down, up, weight), c)
        assert ids.tolist() == [[5, 4, 6, 1, 3, 0, 2][:c]]
        assert logits.tolist() == [[5.0, 4.0, 6.0, 1.0, 3.0, 0.0, 2.0][:c]]


def test_cuda_device_mismatch_and_opcheck(generator):
    inputs = random_inputs(generator, 3, 16, 8, 50, kind="normal").to("cuda")
    with pytest.raises(RuntimeError, match="weight must be on the same device as hidden"):
        run_op(inputs._replace(weight=inputs.weight.cpu()), 5)
    with pytest.raises(RuntimeError, match=r"num_candidates must be in \[1, V\] = \[1, 50\], got 51"):
        run_op(inputs, 51)
    torch.library.opcheck(torch.ops.peagle.efficient_lm_head, (*inputs, 7))
    with torch.no_grad():
        assert efficient_lm_head(*inputs, 50)[0].shape == (3, 50)
