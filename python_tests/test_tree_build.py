"""Tree construction on the CPU: P-EAGLE parallel trees == reference and brute force, best-N selection and EAGLE-2
expansion steps == reference, the built trees' structural contract (ancestor mask, packed mask, paths), the ancestor
mask of any parent array == its root paths, opcheck and error paths."""

from __future__ import annotations

import math

import pytest
import torch
from tree_spec_checks import check_spec_invariants, spec_token_paths

import peagle  # noqa: F401
from peagle.ops import (
    ancestor_mask,
    tree_build_parallel,
    tree_build_parallel_reference,
    tree_expand_topk,
    tree_expand_topk_reference,
    tree_select,
    tree_select_reference,
    tree_verify_greedy,
)
from peagle.ops.gdn import tree_path
from testkit import fresh_seed, random_tree, random_tree_batch


def assert_specs_equal(a, e):
    for name, x, y in zip(a._fields, a, e, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name}:\n{x}\n{y}"


def brute_force_parallel(probs: torch.Tensor, topk: list[int], num_nodes: int) -> set[tuple[int, ...]]:
    """Token paths of the best num_nodes - 1 Cartesian candidates (scores in float64, ties in BFS order)."""
    import itertools

    cands = []
    for depth in range(1, len(topk) + 1):
        choices = []
        for d in range(depth):
            order = sorted(range(probs.shape[-1]), key=lambda t, d=d: (-float(probs[d, t]), t))
            choices.append(order[: topk[d]])
        for combo in itertools.product(*choices):
            score = 1.0
            for d, t in enumerate(combo):
                score *= float(probs[d, t])
            cands.append((-score, depth, combo))  # BFS index order == (depth, lexicographic rank order)
    cands.sort(key=lambda c: (c[0], c[1]))
    return {c[2] for c in cands[: num_nodes - 1]}


@pytest.mark.parametrize(
    "batch,vocab,topk,num_nodes",
    [
        (1, 5, [1], 1),
        (3, 12, [3, 2, 2], 8),
        (4, 12, [3, 2, 2], 100),
        (2, 9, [1, 1, 1, 1], 5),
        (5, 40, [4, 4, 4], 30),
        (2, 3, [3, 3], 13),
        (3, 64, [8, 4, 2, 2], 64),
    ],
)
def test_build_parallel(generator, batch, vocab, topk, num_nodes):
    probs = torch.softmax(torch.randn(batch, len(topk), vocab, generator=generator) * 2, -1)
    spec = tree_build_parallel(probs, topk, num_nodes)
    assert_specs_equal(spec, tree_build_parallel_reference(probs, topk, num_nodes))
    check_spec_invariants(spec, num_nodes)
    assert torch.all(spec.tokens[:, 0] == -1)
    for b in range(batch):
        assert spec_token_paths(spec, b) == brute_force_parallel(probs[b], topk, num_nodes)
        for i in range(1, int(spec.num_nodes[b])):  # score = product of the path's draft probabilities
            want = float(spec.scores[b, int(spec.parent[b, i])]) * float(
                probs[b, spec.depth[b, i] - 1, spec.tokens[b, i]]
            )
            assert float(spec.scores[b, i]) == want


def test_build_parallel_chain_is_greedy_and_verifies(generator):
    """topk = [1] * K gives the drafter's greedy chain; a target equal to the drafter accepts all of it."""
    probs = torch.softmax(torch.randn(4, 5, 30, generator=generator) * 3, -1)
    spec = tree_build_parallel(probs, [1] * 5, 6)
    assert torch.equal(spec.tokens[:, 1:], probs.argmax(-1))
    assert torch.equal(spec.parent, torch.arange(-1, 5).expand(4, 6))
    target = torch.cat([probs, probs[:, -1:]], 1)  # target after node i == drafter's depth-i distribution
    out = tree_verify_greedy(spec.parent, spec.tokens, spec.num_nodes, target)
    assert out.num_accepted.tolist() == [5] * 4


def random_candidates(generator, batch, m):
    tree = random_tree_batch(generator, batch, m, m, full=True)
    count = torch.randint(1, m + 1, (batch,), generator=generator)
    factor = torch.rand(batch, m, generator=generator, dtype=torch.float64)
    factor[:, 0] = 1.0
    scores = factor.clone()
    parent = tree.parent.clone()
    for i in range(1, m):  # child score = parent score * factor (monotone along paths)
        scores[:, i] = scores[torch.arange(batch), parent[:, i]] * factor[:, i]
    scores[:, 3::4] = scores[:, 3::4].round(decimals=1)  # ties; may break monotonicity, so re-derive below
    for i in range(1, m):
        scores[:, i] = torch.minimum(scores[:, i], scores[torch.arange(batch), parent[:, i]])
    return tree.tokens, parent, scores, count


@pytest.mark.parametrize("batch,m,num_nodes", [(1, 1, 1), (4, 10, 4), (8, 40, 16), (3, 70, 70), (2, 33, 40)])
def test_select_matches_reference(generator, batch, m, num_nodes):
    tokens, parent, scores, count = random_candidates(generator, batch, m)
    spec = tree_select(tokens, parent, scores, count, num_nodes)
    assert_specs_equal(spec, tree_select_reference(tokens, parent, scores, count, num_nodes))
    check_spec_invariants(spec, num_nodes)
    assert torch.equal(spec.num_nodes, torch.minimum(count, torch.tensor(num_nodes)))
    for b in range(batch):  # kept scores are the best ones
        c = int(count[b])
        best = sorted(scores[b, 1:c].tolist(), reverse=True)[: int(spec.num_nodes[b]) - 1]
        assert sorted(spec.scores[b, 1 : int(spec.num_nodes[b])].tolist(), reverse=True) == best


@pytest.mark.parametrize("batch,width,vocab,topk", [(1, 1, 5, 1), (3, 4, 20, 3), (2, 8, 100, 8), (5, 2, 7, 7)])
def test_expand_topk_matches_reference(generator, batch, width, vocab, topk):
    scores = torch.rand(batch, width, generator=generator, dtype=torch.float64)
    probs = torch.softmax(torch.randn(batch, width, vocab, generator=generator), -1)
    probs[:, :, :2] = probs[:, :, 2:3]  # ties
    out = tree_expand_topk(scores, probs, topk)
    ref = tree_expand_topk_reference(scores, probs, topk)
    assert all(torch.equal(a, e) for a, e in zip(out, ref, strict=True))
    assert torch.all(out[2][:, 1:] <= out[2][:, :-1])


def test_construction_opcheck_and_errors(generator):
    probs = torch.softmax(torch.randn(2, 3, 10, generator=generator), -1)
    torch.library.opcheck(torch.ops.peagle.tree_build_parallel, (probs, [2, 2, 1], 6))
    tokens, parent, scores, count = random_candidates(generator, 3, 9)
    torch.library.opcheck(torch.ops.peagle.tree_select, (tokens, parent, scores, count, 5))
    torch.library.opcheck(torch.ops.peagle.tree_expand_topk, (scores[:2, :3], probs, 2))
    with pytest.raises(RuntimeError, match=r"topk must have one entry per depth \(K = 3\), got 2"):
        tree_build_parallel(probs, [2, 2], 4)
    with pytest.raises(RuntimeError, match=r"every topk entry must be in \[1, V\] = \[1, 10\]"):
        tree_build_parallel(probs, [2, 0, 1], 4)
    with pytest.raises(RuntimeError, match="draft_probs must be float32"):
        tree_build_parallel(probs.double(), [1, 1, 1], 4)
    bad = probs.clone()
    bad[1, 2, 4] = math.nan
    with pytest.raises(RuntimeError, match="in row 2 of request 1 at token 4"):
        tree_build_parallel(bad, [1, 1, 1], 4)
    with pytest.raises(RuntimeError, match=r"num_nodes must be in \[1, 4096\], got 0"):
        tree_build_parallel(probs, [1, 1, 1], 0)
    p2 = parent.clone()
    p2[0, 5] = 5
    with pytest.raises(RuntimeError, match=r"cand_parent\[0, 5\] must be in \[0, 5\)"):
        tree_select(tokens, p2, scores, torch.full((3,), 9), 4)
    s2 = scores.clone()
    s2[1, 4] = s2[1, parent[1, 4]] + 1
    with pytest.raises(RuntimeError, match=r"cand_scores\[1, 4\] must be finite and must not exceed its parent"):
        tree_select(tokens, parent, s2, torch.full((3,), 9), 4)
    with pytest.raises(RuntimeError, match=r"num_candidates\[2\] must be in \[1, M\], got 10"):
        tree_select(tokens, parent, scores, torch.tensor([9, 9, 10]), 4)
    with pytest.raises(RuntimeError, match="frontier_scores must have shape"):
        tree_expand_topk(scores[:, :2], probs, 2)


@pytest.mark.parametrize("kind", ["chain", "star", "deep", "random", "forest"])
def test_ancestor_mask_matches_paths(kind):
    gen = torch.Generator().manual_seed(fresh_seed())
    for nodes in (1, 2, 17, 64):
        parent = torch.stack([random_tree(gen, nodes, kind) for _ in range(3)])
        mask = ancestor_mask(parent)
        for b in range(3):
            for i in range(nodes):
                assert mask[b, i].nonzero()[:, 0].tolist() == tree_path(parent[b], i)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_expand_topk_rejects_non_finite_or_negative_frontier_scores(generator, bad):
    probs = torch.softmax(torch.randn(2, 3, 10, generator=generator), -1)
    scores = torch.rand(2, 3, generator=generator, dtype=torch.float64)
    scores[1, 2] = bad
    with pytest.raises(
        RuntimeError, match=r"peagle\.tree_expand_topk: frontier_scores\[1, 2\] must be finite and >= 0"
    ):
        tree_expand_topk(scores, probs, 2)


@pytest.mark.parametrize("op", ["tree_build_parallel", "tree_expand_topk"])
@pytest.mark.parametrize("bad", [math.inf, 1.0001, 2.0], ids=["inf", "just-above-1", "2"])
def test_construction_rejects_draft_probabilities_outside_0_1(generator, op, bad):
    """Above 1 a child would outscore its parent and the best-N selection could drop a kept node's parent (the fuzz
    suite found a tree whose depth-2 node had no parent)."""
    probs = torch.softmax(torch.randn(2, 3, 10, generator=generator), -1)
    probs[1, 2, 4] = bad
    with pytest.raises(RuntimeError, match=r"must be in \[0, 1\].* in row 2 of request 1 at token 4"):
        if op == "tree_build_parallel":
            tree_build_parallel(probs, [1, 1, 1], 4)
        else:
            tree_expand_topk(torch.ones(2, 3, dtype=torch.float64), probs, 2)


def test_select_rejects_infinite_scores(generator):
    tokens, parent, scores, count = random_candidates(generator, 2, 6)
    scores = scores.clone()
    scores[:, 0] = math.inf
    with pytest.raises(RuntimeError, match=r"cand_scores\[0, 0\] must be finite"):
        tree_select(tokens, parent, scores, count, 4)


def test_construction_bounds_num_nodes(generator):
    # num_nodes sizes the [B, N, N] mask: an absurd value must be a clear error, not an allocation attempt.
    probs = torch.softmax(torch.randn(1, 2, 10, generator=generator), -1)
    with pytest.raises(RuntimeError, match=r"tree_build_parallel: num_nodes must be in \[1, 4096\], got 1000000000"):
        tree_build_parallel(probs, [2, 2], 10**9)
    tokens, parent, scores, count = random_candidates(generator, 2, 6)
    with pytest.raises(RuntimeError, match=r"tree_select: num_nodes must be in \[1, 4096\], got 4097"):
        tree_select(tokens, parent, scores, count, 4097)
