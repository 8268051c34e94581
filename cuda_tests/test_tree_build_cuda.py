"""Tree construction on CUDA tensors: a host fallback (the CPU kernels on host copies, until construction gets CUDA
kernels) whose outputs equal the CPU op's and come back on the inputs' device, with the CPU op's device check, and
listed by torch.ops.peagle.cuda_host_fallbacks()."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import tree_build_parallel, tree_expand_topk, tree_select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def assert_same(cuda_out, cpu_out):
    for name, a, e in zip(cpu_out._fields, cuda_out, cpu_out, strict=True):
        assert a.is_cuda and a.dtype == e.dtype, name
        assert torch.equal(a.cpu(), e), f"{name}:\n{a.cpu()}\n{e}"


def test_construction_on_cuda_equals_cpu(generator):
    probs = torch.softmax(torch.randn(4, 3, 500, generator=generator), -1)
    cpu = tree_build_parallel(probs, [4, 3, 2], 20)
    assert_same(tree_build_parallel(probs.cuda(), [4, 3, 2], 20), cpu)
    scores = torch.rand(4, 5, generator=generator, dtype=torch.float64)
    child = torch.softmax(torch.randn(4, 5, 500, generator=generator), -1)
    out = tree_expand_topk(scores.cuda(), child.cuda(), 4)
    for a, e in zip(out, tree_expand_topk(scores, child, 4), strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), e)
    spec = tree_select(*cuda(cpu.tokens, cpu.parent, cpu.scores, cpu.num_nodes), 8)
    assert_same(spec, tree_select(cpu.tokens, cpu.parent, cpu.scores, cpu.num_nodes, 8))


def test_construction_device_mismatch_and_cpu_errors(generator):
    """The host fallback rejects tensors on two devices with the CPU kernels' message, and reports the CPU kernel's
    errors for bad values on CUDA tensors."""
    scores = torch.rand(2, 3, generator=generator, dtype=torch.float64)
    child = torch.softmax(torch.randn(2, 3, 50, generator=generator), -1)
    with pytest.raises(RuntimeError, match=r"child_probs must be on the same device as frontier_scores \(cpu\)"):
        tree_expand_topk(scores, child.cuda(), 2)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    parent = torch.tensor([[-1, 0, 0, 1]] * 2)
    count = torch.tensor([4, 4])
    with pytest.raises(RuntimeError, match="tree_select: cand_scores must be on the same device as cand_tokens"):
        tree_select(tokens.cuda(), parent.cuda(), torch.ones(2, 4, dtype=torch.float64), count.cuda(), 3)
    with pytest.raises(RuntimeError, match=r"num_candidates\[1\] must be in \[1, M\], got 5"):
        tree_select(*cuda(tokens, parent, torch.ones(2, 4, dtype=torch.float64), torch.tensor([4, 5])), 3)
    with pytest.raises(RuntimeError, match=r"topk must have one entry per depth \(K = 3\), got 2"):
        tree_build_parallel(child.cuda(), [2, 2], 4)


def test_construction_ops_are_the_listed_host_fallbacks():
    assert sorted(torch.ops.peagle.cuda_host_fallbacks()) == ["tree_build_parallel", "tree_expand_topk", "tree_select"]
