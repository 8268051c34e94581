"""Tree verification on CUDA: CUDA op == CPU op, bit for bit (greedy, and sampling with the same uniforms / seed), the
same error messages. The CUDA kernels reduce rows in vocabulary chunks of CHUNK entries (then walk each tree), so the
cases below put ties, NaNs, bad values, drafted tokens and sampling boundaries on both sides of chunk edges.
Construction: test_tree_build_cuda.py; GPU timings: benchmarks/bench_tree_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import (
    check_errors,
    deferred_checks,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_verify_greedy,
)
from testkit import fresh_seed, random_tree_batch, random_tree_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHUNK = 4096  # tree::kVerifyChunk in csrc/include/peagle/tree.h


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


def both_backends(fn, *tensors, **kwargs):
    """fn on the CPU tensors and on their CUDA copies; the outputs must be equal bit for bit."""
    cpu = fn(*tensors, **kwargs)
    assert_same(fn(*cuda(*tensors), **kwargs), cpu)
    return cpu


@pytest.mark.parametrize("batch,n_max,vocab", [(64, 8, 151936), (64, 32, 32000), (33, 20, 3 * CHUNK + 1)])
def test_large_batches_all_modes(generator, batch, n_max, vocab):
    """B = 64 at the largest vocabulary: greedy (with ties), deterministic and stochastic sampling, Philox and explicit
    uniforms, against the CPU kernel."""
    tree = random_tree_batch(generator, batch, n_max, vocab)
    target = random_tree_probs(generator, tree, vocab)
    logits = target.clone()
    logits[:, :, CHUNK - 1 :: CHUNK] = logits.amax(-1, keepdim=True)  # ties of the maximum on chunk edges
    both_backends(tree_verify_greedy, tree.parent, tree.tokens, tree.num_nodes, logits)
    uniforms = torch.rand(batch, n_max, generator=generator)
    for draft in (None, random_tree_probs(generator, tree, vocab)):
        args = (tree.parent, tree.tokens, tree.num_nodes, target, draft)
        both_backends(tree_rejection_sample, *args, seed=fresh_seed(), offset=3)
        both_backends(tree_rejection_sample, *args, uniforms)


@pytest.mark.parametrize("vocab", [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17])
def test_greedy_argmax_edges_across_chunks(generator, vocab):
    """All -inf rows (the first id), +0 / -0 ties, equal maxima in different chunks (the smallest id), the first NaN
    of a row with NaNs in several chunks."""
    parent, tokens, num_nodes = torch.tensor([[-1]]), torch.tensor([[0]]), torch.tensor([1])
    rows = [torch.full((1, 1, vocab), -math.inf), torch.zeros(1, 1, vocab)]
    rows[1][0, 0, ::2] = -0.0
    for positions in ({vocab - 1}, {vocab - 1, vocab // 2}, {0, vocab - 1}, {min(CHUNK, vocab - 1), vocab - 1}):
        row = torch.randn(1, 1, vocab, generator=generator)
        row[0, 0, list(positions)] = 100.0
        rows.append(row)
    for row in rows:
        both_backends(tree_verify_greedy, parent, tokens, num_nodes, row)
    for first in {0, vocab // 2, vocab - 1}:
        row = torch.randn(1, 1, vocab, generator=generator)
        row[0, 0, first] = math.nan
        row[0, 0, vocab - 1] = math.nan
        with pytest.raises(RuntimeError, match=rf"NaN at \[0, 0, {first}\]"):
            tree_verify_greedy(*cuda(parent, tokens, num_nodes, row))


def chunk_edge_tree(batch: int, vocab: int):
    """Every request: a root whose children draft tokens on chunk edges, and a chain below the first child."""
    edge_tokens = [CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 0]
    parent = torch.tensor([[-1, 0, 0, 0, 0, 0, 1, 6]]).expand(batch, 8).clone()
    tokens = torch.tensor([[7, *edge_tokens, 5, 9]]).expand(batch, 8).clone()
    return parent, tokens, torch.full((batch,), 8)


def test_sampling_on_chunk_edges(generator):
    """Rejections of children whose tokens lie on chunk edges, then the correction sample: with deterministic drafts
    it comes from the chunk sums less the rejected tokens (no residual row), with stochastic drafts from the residual.
    One request per final uniform in a sweep over [0, 1): the samples spread over the row, next to chunk edges too."""
    vocab = 3 * CHUNK + 5
    batch = 512
    parent, tokens, num_nodes = chunk_edge_tree(batch, vocab)
    target = torch.rand(batch, 8, vocab, generator=generator).pow_(8)
    target[:, :, CHUNK - 2 : CHUNK + 2] += 2.0  # mass on the edges, where the drafted tokens are
    target[:, :, 2 * CHUNK - 2 : 2 * CHUNK + 2] += 2.0
    target[batch // 2 :, 0, [CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 0]] = 0.0  # drafts that must be rejected
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(batch, 8, vocab, generator=generator)
    draft /= draft.sum(-1, keepdim=True)
    uniforms = ((torch.arange(batch * 8) * 0.6180339887) % 1.0).float().reshape(batch, 8)
    uniforms[:, 0] = (torch.arange(batch) + 0.5) / batch  # the final draw sweeps [0, 1)
    for d in (None, draft):
        out = both_backends(tree_rejection_sample, parent, tokens, num_nodes, target, d, uniforms)
        assert (out.num_accepted[batch // 2 :] == 0).all()  # every root child rejected: a correction
    # Drafts with all their mass on the drafted tokens: each rejection moves the residual far from the target.
    point = torch.zeros(batch, 8, vocab)
    point[:, :, [CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 0]] = 0.2
    both_backends(tree_rejection_sample, parent, tokens, num_nodes, target, point, uniforms)


def test_rejection_corner_cases_match_cpu():
    """The CPU tests' corner cases: a point-mass target on the drafted tokens (always accepted), zero target mass on
    them (always rejected, the correction avoids them), u = 0."""
    parent, tokens, num_nodes = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 2, 4]]), torch.tensor([3])
    target = torch.zeros(1, 3, 5)
    target[0, 0, 2] = target[0, 1, 4] = target[0, 2, 1] = 1.0
    for draft in (None, torch.full((1, 3, 5), 0.2)):
        for seed in range(10):
            both_backends(tree_rejection_sample, parent, tokens, num_nodes, target, draft, seed=seed)
    parent = torch.tensor([[-1, 0, 0]])
    target = torch.full((1, 3, 5), 0.2)
    target[0, 0] = 0.0
    target[0, 0, 1] = target[0, 0, 3] = 0.5
    for seed in range(10):
        both_backends(tree_rejection_sample, parent, tokens, num_nodes, target, seed=seed)
    target[0, 0, 2] = target[0, 0, 1] = 0.25
    both_backends(tree_rejection_sample, parent, tokens, num_nodes, target, None, torch.zeros(1, 3))


def test_grid_loops_past_its_cap(generator):
    """More (request, node, chunk) rows than the first phase's grid (2^20 blocks): its blocks loop over the rest."""
    tree = random_tree_batch(generator, 1, 12, 40, full=True)
    target = random_tree_probs(generator, tree, 40)
    batch = 100_000
    args = (tree.parent.expand(batch, 12), tree.tokens.expand(batch, 12), tree.num_nodes.expand(batch))
    both_backends(tree_verify_greedy, *args, target.expand(batch, 12, 40))
    both_backends(tree_rejection_sample, *args, target.expand(batch, 12, 40), seed=3)


def first_line(error: pytest.ExceptionInfo) -> str:
    return str(error.value).splitlines()[0]


@pytest.mark.parametrize("deferred", [False, True])
def test_errors_in_later_chunks_and_unvisited_rows(deferred):
    """A bad value or a bad sum found in a row's last chunk gives the CPU's message (immediate or deferred); bad rows
    the walk never visits (a padding node's target row, a leaf's draft row) raise nothing."""
    vocab = 2 * CHUNK + 9
    last = vocab - 1  # in the third chunk
    parent, tokens, num_nodes = torch.tensor([[-1, 0, 1, 1]]), torch.tensor([[0, 5, CHUNK + 3, 2]]), torch.tensor([3])
    target = torch.full((1, 4, vocab), 1.0 / vocab)
    draft = target.clone()
    target[0, 0, 5] = target[0, 1, CHUNK + 3] = 0.9  # the walk visits nodes 0, 1 and 2
    target[0, :2] /= target[0, :2].sum(-1, keepdim=True)
    target[0, 3] = math.nan  # node 3 is padding (num_nodes = 3)
    draft[0, 2] = -1.0  # node 2 is a leaf
    uniforms = torch.zeros(1, 4)  # u = 0: every child with target mass is accepted

    def run(fn, *args):
        if not deferred:
            return fn(*args)
        with deferred_checks():
            out = fn(*args)
            check_errors()
        return out

    greedy = both_backends(lambda *a: run(tree_verify_greedy, *a), parent, tokens, num_nodes, target)
    out = both_backends(lambda *a: run(tree_rejection_sample, *a), parent, tokens, num_nodes, target, draft, uniforms)
    assert out.num_accepted.tolist() == greedy.num_accepted.tolist() == [2]
    bad_target_value, bad_target_sum, bad_draft_value = target.clone(), target.clone(), draft.clone()
    bad_target_value[0, 2, last] = math.nan
    bad_target_sum[0, 1, last] = 0.5
    bad_draft_value[0, 1, last] = -0.5
    cases = [
        (bad_target_value, draft, rf"target_probs must hold probabilities.*nan at \[0, 2, {last}\]"),
        (bad_target_sum, draft, r"target_probs row \[0, 1\] must sum to 1 within 0.001"),
        (target, bad_draft_value, rf"draft_probs must hold probabilities.*-0.5 at \[0, 1, {last}\]"),
    ]
    for t, d, match in cases:
        with pytest.raises(RuntimeError, match=match) as on_cpu:
            tree_rejection_sample(parent, tokens, num_nodes, t, d, uniforms)
        with pytest.raises(RuntimeError, match=match) as on_cuda:
            run(tree_rejection_sample, *cuda(parent, tokens, num_nodes, t, d, uniforms))
        assert first_line(on_cuda) == first_line(on_cpu)
