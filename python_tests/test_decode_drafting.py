"""Drafting policy: the EAGLE-2 dynamic tree of an autoregressive drafter equals a scalar brute force of EAGLE-2 and
satisfies the built-tree contract."""

from __future__ import annotations

import pytest
import torch
from tree_spec_checks import check_spec_invariants, spec_token_paths

import peagle  # noqa: F401
from peagle.decode import eagle2_dynamic_tree


def brute_force_eagle2(root, table, depth, topk, num_nodes):
    """Scalar EAGLE-2 for one request: draft distribution after a node = table[last token]."""
    cands = [(1.0, -1, -1)]  # (score, parent candidate, token)
    frontier = [0]
    dist = {0: root}
    for _ in range(depth):
        new = []
        for f in frontier:
            order = sorted(range(len(dist[f])), key=lambda t, f=f: (-float(dist[f][t]), t))[:topk]
            new += [(cands[f][0] * float(dist[f][t]), f, t) for t in order]
        new = sorted(enumerate(new), key=lambda e: (-e[1][0], e[0]))
        base = len(cands)
        cands += [c for _, c in new]
        frontier = list(range(base, base + min(topk, len(new))))
        for i in frontier:
            dist[i] = table[cands[i][2]]
    ranked = sorted(range(1, len(cands)), key=lambda i: (-cands[i][0], i))[: num_nodes - 1]
    paths = set()
    for i in ranked:
        seq = []
        while i > 0:
            seq.append(cands[i][2])
            i = cands[i][1]
        paths.add(tuple(reversed(seq)))
    return paths


def test_eagle2_dynamic_tree(generator):
    batch, vocab, depth, topk, num_nodes = 3, 12, 4, 3, 10
    table = torch.softmax(torch.randn(vocab, vocab, generator=generator) * 2, -1)  # drafter: p(next | last token)
    root = torch.softmax(torch.randn(batch, vocab, generator=generator) * 2, -1)
    calls = []

    def draft_step(tokens, candidate_index):
        calls.append(tokens.shape)
        return table[tokens]

    spec = eagle2_dynamic_tree(root, draft_step, depth, topk, num_nodes)
    assert calls == [(batch, topk)] * (depth - 1)
    check_spec_invariants(spec, num_nodes)
    for b in range(batch):
        assert spec_token_paths(spec, b) == brute_force_eagle2(root[b], table, depth, topk, num_nodes)


def test_eagle2_dynamic_tree_rejects_a_draft_step_with_another_vocabulary():
    root = torch.softmax(torch.randn(2, 12), -1)

    def wider_step(tokens, candidate_index):
        return torch.softmax(torch.randn(*tokens.shape, 20), -1)  # 20 != the root's 12 tokens

    with pytest.raises(ValueError, match=r"draft_step must return \[B, width, V\] = \[2, 3, 12\]"):
        eagle2_dynamic_tree(root, wider_step, 3, 3, 8)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(root_probs=torch.rand(12)), r"root_probs must be 2-D \[B, V\]"),
        (dict(root_probs=torch.zeros(2, 12, dtype=torch.long)), "root_probs must be floating"),
        (dict(depth=-1), r"depth must be >= 1, got -1"),
        (dict(topk=0), r"topk must be in \[1, V\] = \[1, 12\], got 0"),
        (dict(topk=13), r"topk must be in \[1, V\] = \[1, 12\], got 13"),
        (dict(num_nodes=0), r"num_nodes must be >= 1, got 0"),
        (dict(draft_step=None), "draft_step must be callable"),
    ],
)
def test_eagle2_dynamic_tree_validates_arguments(args, message):
    table = torch.softmax(torch.randn(12, 12), -1)
    call = dict(root_probs=torch.softmax(torch.randn(2, 12), -1), draft_step=lambda t, i: table[t], depth=3, topk=2)
    call.update(num_nodes=6)
    call.update(args)
    with pytest.raises(ValueError, match=message):
        eagle2_dynamic_tree(**call)
