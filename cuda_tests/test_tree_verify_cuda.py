"""Tree verification on CUDA: CUDA op == CPU op, bit for bit (greedy, and sampling with the same uniforms / seed), the
same error messages. Construction: test_tree_build_cuda.py; GPU timings: benchmarks/bench_tree_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import tree_rejection_sample, tree_rejection_sample_reference, tree_verify_greedy
from testkit import fresh_seed, random_tree_batch, random_tree_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def assert_same(cuda_out, cpu_out):
    for name, a, e in zip(cpu_out._fields, cuda_out, cpu_out, strict=True):
        assert a.is_cuda and a.dtype == e.dtype, name
        assert torch.equal(a.cpu(), e), f"{name}:\n{a.cpu()}\n{e}"


SIZES = [(1, 1, 1), (3, 2, 5), (16, 8, 100), (64, 32, 1000), (8, 64, 32000), (4, 16, 151936), (2, 9, 262144)]


@pytest.mark.parametrize("batch,n_max,vocab", SIZES)
def test_greedy_cuda_equals_cpu(generator, batch, n_max, vocab):
    tree = random_tree_batch(generator, batch, n_max, max(vocab, n_max - 1))
    vocab = max(vocab, n_max - 1)
    target = random_tree_probs(generator, tree, vocab)
    target[:, :, : min(3, vocab)] = target.amax(-1, keepdim=True)  # ties: the smallest id wins on both backends
    cpu = tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, target)
    out = tree_verify_greedy(*cuda(tree.parent.int(), tree.tokens, tree.num_nodes.int(), target))
    assert_same(out, cpu)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("batch,n_max,vocab", SIZES)
def test_rejection_sample_cuda_equals_cpu(generator, stochastic, batch, n_max, vocab):
    vocab = max(vocab, n_max - 1)
    tree = random_tree_batch(generator, batch, n_max, vocab)
    target = random_tree_probs(generator, tree, vocab)
    draft = random_tree_probs(generator, tree, vocab) if stochastic else None
    args = (tree.parent, tree.tokens, tree.num_nodes, target, draft)
    for seed in (0, fresh_seed()):
        cpu = tree_rejection_sample(*args, seed=seed, offset=seed // 3)
        assert_same(tree_rejection_sample(*cuda(*args), seed=seed, offset=seed // 3), cpu)
    uniforms = torch.rand(batch, n_max, generator=generator)
    cpu = tree_rejection_sample(*args, uniforms)
    assert_same(tree_rejection_sample(*cuda(*args, uniforms)), cpu)
    if batch * n_max * vocab <= 10**6:
        ref = tree_rejection_sample_reference(*cuda(*args, uniforms))
        assert_same(ref, cpu)


def test_broadcast_batch_and_many_draws(generator):
    """A stride-0 batch (one tree, many requests) and the Philox stream per request on both backends."""
    tree = random_tree_batch(generator, 1, 12, 40, full=True)
    target = random_tree_probs(generator, tree, 40)
    draft = random_tree_probs(generator, tree, 40)
    batch = 20000
    args = (tree.parent.expand(batch, 12), tree.tokens.expand(batch, 12), tree.num_nodes.expand(batch))
    cpu = tree_rejection_sample(*args, target.expand(batch, 12, 40), draft.expand(batch, 12, 40), seed=7, offset=1)
    out = tree_rejection_sample(
        *cuda(*args), target.cuda().expand(batch, 12, 40), draft.cuda().expand(batch, 12, 40), seed=7, offset=1
    )
    assert_same(out, cpu)


def test_errors_match_cpu():
    parent = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.tensor([[0, 1, 1, 3]])
    target = torch.full((1, 4, 5), 0.2)
    for fn in (lambda *a: tree_verify_greedy(*a), lambda *a: tree_rejection_sample(*a)):
        with pytest.raises(RuntimeError, match="sibling tokens must be distinct, got duplicate token 1 at node 2"):
            fn(*cuda(parent, tokens, torch.tensor([4]), target))
    tokens[0, 2] = 2
    bad = target.clone()
    bad[0, 0, 3] = math.nan
    with pytest.raises(RuntimeError, match=r"target_probs must not contain NaN, got NaN at \[0, 0, 3\]"):
        tree_verify_greedy(*cuda(parent, tokens, torch.tensor([4]), bad))
    with pytest.raises(RuntimeError, match=r"target_probs must hold probabilities.*nan at \[0, 0, 3\]"):
        tree_rejection_sample(*cuda(parent, tokens, torch.tensor([4]), bad))
    bad = target.clone()
    bad[0, 0] = 0.3
    with pytest.raises(RuntimeError, match=r"target_probs row \[0, 0\] must sum to 1 within 0.001, got 1.5"):
        tree_rejection_sample(*cuda(parent, tokens, torch.tensor([4]), bad))
    with pytest.raises(RuntimeError, match=r"uniforms must be in \[0, 1\)"):
        tree_rejection_sample(*cuda(parent, tokens, torch.tensor([4]), target), uniforms=torch.ones(1, 4).cuda())
    with pytest.raises(RuntimeError, match="target_probs must be on the same device as parent"):
        tree_verify_greedy(parent.cuda(), tokens.cuda(), torch.tensor([4]).cuda(), target)
    with pytest.raises(RuntimeError, match="num_nodes must be on the same device as parent"):
        tree_rejection_sample(parent.cuda(), tokens.cuda(), torch.tensor([4]), target.cuda())
