"""Checks of built draft trees (TreeSpec) from first principles, shared by the construction tests
(test_tree_build.py) and the drafting-policy tests (test_decode_drafting.py)."""

from __future__ import annotations

import torch


def check_spec_invariants(spec, num_nodes: int):
    """Structural contract of a built tree, checked from first principles."""
    batch = spec.tokens.shape[0]
    for b in range(batch):
        n = int(spec.num_nodes[b])
        parent, depth = spec.parent[b].tolist(), spec.depth[b].tolist()
        assert parent[0] == -1 and depth[0] == 0
        assert all(x == -1 for x in parent[n:]) and all(x == -1 for x in depth[n:])
        for i in range(1, n):
            assert 0 <= parent[i] < i and depth[i] == depth[parent[i]] + 1
            assert depth[i - 1] <= depth[i], "nodes are ordered by depth"
            assert float(spec.scores[b, i]) <= float(spec.scores[b, parent[i]])
        siblings = {}
        for i in range(1, n):
            siblings.setdefault(parent[i], []).append(int(spec.tokens[b, i]))
        assert all(len(s) == len(set(s)) for s in siblings.values()), "sibling tokens must be distinct"
        expected_mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                expected_mask[i, j] = True
                j = parent[j]
        assert torch.equal(spec.mask[b], expected_mask)
        words = spec.mask_packed[b].long() & 0xFFFFFFFF
        unpacked = ((words[:, :, None] >> torch.arange(32)) & 1).reshape(num_nodes, -1)[:, :num_nodes].bool()
        assert torch.equal(unpacked, expected_mask)
        leaves = [i for i in range(n) if i not in siblings]
        assert int(spec.num_paths[b]) == len(leaves)
        for row, leaf in enumerate(leaves):
            path = [j for j in range(n) if expected_mask[leaf, j]]
            got = spec.paths[b, row].tolist()
            assert got[: len(path)] == path and all(x == -1 for x in got[len(path) :])
        assert all(x == -1 for x in spec.paths[b, len(leaves) :].reshape(-1).tolist())


def spec_token_paths(spec, b: int) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, int(spec.num_nodes[b])):
        seq, j = [], i
        while j > 0:
            seq.append(int(spec.tokens[b, j]))
            j = int(spec.parent[b, j])
        out.add(tuple(reversed(seq)))
    return out
