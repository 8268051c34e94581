"""Draft trees: construction (P-EAGLE parallel trees, EAGLE-2 dynamic trees, chains) and lossless verification (greedy
tree verification and tree rejection sampling) over batches of draft trees.

Batched layout (trees padded to ``n_max`` nodes):

* ``parent`` [B, n_max] int32/int64: node 0 is the root (the last committed token), ``parent[b, 0] = -1``,
  ``0 <= parent[b, i] < i``; nodes ``i >= num_nodes[b]`` are padding and ignored.
* ``tokens`` [B, n_max] int32/int64: the drafted token of each node (the root's entry is ignored); siblings distinct.
* ``num_nodes`` [B] int32/int64 in ``[1, n_max]``.
* ``target_probs`` [B, n_max, V] float32: ``target_probs[b, i]`` is the target distribution after node i (greedy: any
  scores, the argmax is used).
* ``draft_probs`` [B, n_max, V] float32, optional: the distribution node i's children were drawn from (without
  replacement). Absent: deterministic (top-k) drafts.

Outputs (:class:`TreeVerifyOutput`): the accepted path (node indices from the root, -1 padded), the number of accepted
drafts, the emitted tokens (accepted drafts then one bonus/correction token, -1 padded) and the last accepted node.

Children of a node are tried in increasing node index. Rows are validated where the walk reads them (the rows of visited
nodes; draft rows of visited nodes that have children).

Exactness: probabilities are converted to 40-bit fixed point (``floor(p * 2^40)``), so all sums are integer sums and the
CPU kernel, the CUDA kernel and the references below agree bit for bit (see csrc/include/peagle/tree.h). Random numbers
are 24-bit uniforms from Philox 4x32-10 keyed by ``seed``, counter ``(index, request, offset)``: index ``i >= 1`` is the
acceptance test of node ``i`` and index 0 the final sample. Use a fresh ``offset`` (e.g. the round number) per call.
The sampler is exact up to these resolutions: 24-bit uniforms (acceptance and sampling probabilities are quantised to
2^-24) and 2^-40 per probability entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "TreeSpec",
    "TreeVerifyOutput",
    "eagle2_dynamic_tree",
    "philox_uniforms",
    "tree_build_parallel",
    "tree_build_parallel_reference",
    "tree_expand_topk",
    "tree_expand_topk_reference",
    "tree_rejection_sample",
    "tree_rejection_sample_reference",
    "tree_select",
    "tree_select_reference",
    "tree_verify_greedy",
    "tree_verify_greedy_reference",
]

FIXED_ONE = 1 << 40
UNIFORM_ONE = 1 << 24
_MASK32 = (1 << 32) - 1


class TreeVerifyOutput(NamedTuple):
    accepted_path: Tensor  # [B, n_max] int64 node indices from the root (path[:, 0] = 0), -1 padded
    num_accepted: Tensor  # [B] int64 accepted drafts (path length - 1)
    emitted_tokens: Tensor  # [B, n_max] int64 accepted drafts + one bonus/correction token, -1 padded
    last_node: Tensor  # [B] int64 last accepted node (0 if no draft was accepted)


def tree_verify_greedy(parent: Tensor, tokens: Tensor, num_nodes: Tensor, target_probs: Tensor) -> TreeVerifyOutput:
    """Greedy tree verification: from the root, follow the child whose token is the target argmax at its parent.

    The bonus token is the target argmax at the last accepted node. Ties go to the smallest token id; NaN is an error.
    """
    return TreeVerifyOutput(*torch.ops.peagle.tree_verify_greedy(parent, tokens, num_nodes, target_probs))


def tree_rejection_sample(
    parent: Tensor,
    tokens: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> TreeVerifyOutput:
    """Lossless tree rejection sampling (the emitted tokens are distributed exactly as target samples).

    At an accepted node with target distribution p, the residual r starts at p and the children are tried in order:

    * deterministic drafts (``draft_probs`` None): accept child c with probability r(c) / sum(r); after a rejection
      r(c) <- 0;
    * stochastic drafts (children drawn without replacement from q = ``draft_probs`` of the node): accept x_i if
      u * M * q~_i(x_i) < r(x_i), M = sum(r), q~_i = q renormalised without the earlier children; after a rejection
      r <- max(0, r - M q~_i).

    The accepted child is recursed into; if all are rejected the correction is sampled from r / sum(r) (at a leaf: the
    bonus from p). Callers pass target probabilities after temperature / top-k / top-p.

    Args:
        uniforms: optional [B, n_max] float32 in [0, 1): ``uniforms[b, i]`` (i >= 1) is the acceptance uniform of
            node i, ``uniforms[b, 0]`` the final sample's. When None, Philox(seed, offset) supplies them.
    """
    return TreeVerifyOutput(
        *torch.ops.peagle.tree_rejection_sample(
            parent, tokens, num_nodes, target_probs, draft_probs, uniforms, seed, offset
        )
    )


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


def _verify_fake(parent, target_probs):
    batch, n_max = parent.shape
    return (
        parent.new_empty(batch, n_max, dtype=torch.long),
        parent.new_empty(batch, dtype=torch.long),
        parent.new_empty(batch, n_max, dtype=torch.long),
        parent.new_empty(batch, dtype=torch.long),
    )


@torch.library.register_fake("peagle::tree_verify_greedy")
def _tree_verify_greedy_fake(parent, tokens, num_nodes, target_probs):
    return _verify_fake(parent, target_probs)


@torch.library.register_fake("peagle::tree_rejection_sample")
def _tree_rejection_sample_fake(
    parent, tokens, num_nodes, target_probs, draft_probs=None, uniforms=None, seed=0, offset=0
):
    return _verify_fake(parent, target_probs)


# ---------------------------------------------------------------------------------------------------------------------
# Pure-PyTorch references (the executable spec), vectorised over requests; they mirror csrc/include/peagle/tree.h bit
# for bit. uint32 arithmetic is emulated on int64 tensors (wrapping products, masking).


def philox_uniforms(seed: int, offset: int, request: Tensor, index: Tensor) -> Tensor:
    """24-bit Philox 4x32-10 uniforms U (u = U / 2^24) for draw ``index`` of ``request`` (broadcast int64 tensors)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    request, index = torch.broadcast_tensors(request.long(), index.long())
    c0 = index & _MASK32
    c1 = request & _MASK32
    c2 = torch.full_like(c0, offset & _MASK32)
    c3 = torch.full_like(c0, offset >> 32)
    k0, k1 = seed & _MASK32, seed >> 32
    for round_ in range(10):
        if round_:
            k0 = (k0 + 0x9E3779B9) & _MASK32
            k1 = (k1 + 0xBB67AE85) & _MASK32
        p0 = c0 * 0xD2511F53
        p1 = c2 * 0xCD9E8D57
        hi0, lo0 = (p0 >> 32) & _MASK32, p0 & _MASK32
        hi1, lo1 = (p1 >> 32) & _MASK32, p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0 >> 8


def _fixed(p: Tensor) -> Tensor:
    return (p.double() * float(FIXED_ONE)).long()


def _children_after(parent: Tensor, valid: Tensor, cur: Tensor, after: Tensor) -> Tensor:
    """First child of cur[b] with index > after[b] (and > cur[b]), or -1."""
    n_max = parent.shape[1]
    idx = torch.arange(n_max, device=parent.device)
    mask = valid & (parent == cur[:, None]) & (idx > after[:, None]) & (idx > cur[:, None])
    first = torch.where(mask, idx, n_max).amin(dim=1)
    return torch.where(first < n_max, first, -1)


def tree_verify_greedy_reference(
    parent: Tensor, tokens: Tensor, num_nodes: Tensor, target_probs: Tensor
) -> TreeVerifyOutput:
    """Reference of :func:`tree_verify_greedy` (no input validation)."""
    batch, n_max, _ = target_probs.shape
    device = target_probs.device
    parent, tokens, num_nodes = parent.long(), tokens.long(), num_nodes.long()
    idx = torch.arange(n_max, device=device)
    valid = (idx[None, :] < num_nodes[:, None]) & (idx[None, :] >= 1)
    best = target_probs.argmax(dim=-1)  # first maximal index
    # A node is on the greedy path iff its parent is and its token is the argmax at its parent.
    match = valid & (tokens == best.gather(1, parent.clamp(0, n_max - 1)))
    rows = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, n_max), -1, dtype=torch.long, device=device)
    emitted = torch.full((batch, n_max), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    count = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(n_max):
        child_mask = match & (parent == cur[:, None])
        has = child_mask.any(dim=1) & active
        child = child_mask.long().argmax(dim=1)
        emitted[rows[has], count[has]] = tokens[rows[has], child[has]]
        count = count + has.long()
        path[rows[has], count[has]] = child[has]
        cur = torch.where(has, child, cur)
        active = has
        if not bool(active.any()):
            break
    emitted[rows, count] = best[rows, cur]
    return TreeVerifyOutput(path, count, emitted, cur)


def tree_rejection_sample_reference(
    parent: Tensor,
    tokens: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> TreeVerifyOutput:
    """Reference of :func:`tree_rejection_sample` (no input validation).

    One loop step per child test (at most n_max - 1 per request), vectorised over requests.
    """
    batch, n_max, vocab = target_probs.shape
    device = target_probs.device
    parent, tokens, num_nodes = parent.long(), tokens.long(), num_nodes.long()
    idx = torch.arange(n_max, device=device)
    valid = idx[None, :] < num_nodes[:, None]
    rows = torch.arange(batch, device=device)
    if uniforms is not None:
        all_u = (uniforms.double() * float(UNIFORM_ONE)).long()
    else:
        all_u = philox_uniforms(seed, offset, rows[:, None], idx[None, :])
    stochastic = draft_probs is not None

    cur = torch.zeros(batch, dtype=torch.long, device=device)
    after = torch.zeros(batch, dtype=torch.long, device=device)  # last child tried (or cur)
    path = torch.full((batch, n_max), -1, dtype=torch.long, device=device)
    emitted = torch.full((batch, n_max), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    count = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)

    def node_state(node: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        p = _fixed(target_probs[rows, node])
        q = _fixed(draft_probs[rows, node]) if stochastic else p
        return p, p.clone(), p.sum(dim=1), q.sum(dim=1)

    p_fix, residual, mass, draft_mass = node_state(cur)
    q_fix = _fixed(draft_probs[rows, cur]) if stochastic else None
    target_sum = mass.clone()
    for _ in range(n_max + 1):
        if not bool(active.any()):
            break
        child = _children_after(parent, valid, cur, after)
        finishing = active & (child < 0)
        testing = active & (child >= 0)
        if bool(finishing.any()):
            u = all_u[:, 0]
            from_residual = mass > 0
            total = torch.where(from_residual, mass, target_sum)
            target = ((u.double() * total.double()) * (1.0 / UNIFORM_ONE)).long()
            source = torch.where(from_residual[:, None], residual, p_fix)
            above = source.cumsum(dim=1) > target[:, None]
            sample = torch.where(above.any(dim=1), above.long().argmax(dim=1), vocab - 1)
            emitted[rows[finishing], count[finishing]] = sample[finishing]
            active = active & ~finishing
        if not bool(testing.any()):
            continue
        safe_child = child.clamp(min=0)
        x = tokens[rows, safe_child].clamp(0, vocab - 1)
        u = all_u[rows, safe_child]
        rx = residual[rows, x]
        if stochastic:
            qx = q_fix[rows, x]
            scale = torch.where(draft_mass > 0, mass.double() / draft_mass.double().clamp(min=1), 0.0)
            lhs_mass = (qx.double() * scale).long()
        else:
            lhs_mass = mass
        ok = testing & ((u.double() * lhs_mass.double()) < (rx.double() * float(UNIFORM_ONE)))
        rejected = testing & ~ok
        # Rejections: update the residual of those requests.
        if stochastic:
            updated = (residual - (q_fix.double() * scale[:, None]).long()).clamp(min=0)
            updated[rows, x] = 0
            residual = torch.where(rejected[:, None], updated, residual)
            mass = torch.where(rejected, residual.sum(dim=1), mass)
            draft_mass = torch.where(rejected, draft_mass - qx, draft_mass)
        else:
            zeroed = residual.clone()
            zeroed[rows, x] = 0
            residual = torch.where(rejected[:, None], zeroed, residual)
            mass = torch.where(rejected, mass - rx, mass)
        after = torch.where(rejected, child, after)
        # Acceptances: record and move into the child.
        if bool(ok.any()):
            emitted[rows[ok], count[ok]] = tokens[rows[ok], child[ok]]
            count = count + ok.long()
            path[rows[ok], count[ok]] = child[ok]
            cur = torch.where(ok, child, cur)
            after = torch.where(ok, child, after)
            new_p, new_r, new_mass, new_draft_mass = node_state(cur)
            p_fix = torch.where(ok[:, None], new_p, p_fix)
            residual = torch.where(ok[:, None], new_r, residual)
            mass = torch.where(ok, new_mass, mass)
            target_sum = torch.where(ok, new_mass, target_sum)
            draft_mass = torch.where(ok, new_draft_mass, draft_mass)
            if stochastic:
                q_fix = torch.where(ok[:, None], _fixed(draft_probs[rows, cur]), q_fix)
    return TreeVerifyOutput(path, count, emitted, cur)


# ---------------------------------------------------------------------------------------------------------------------
# Tree construction.


class TreeSpec(NamedTuple):
    """A batch of built draft trees (N = num_nodes slots; nodes beyond num_nodes[b] are -1 / False padding).

    Node 0 is the root (its token is -1: the caller's last committed token). Nodes are ordered by depth, then by path
    score (siblings most likely first), so parents come before children. The position of node i is the committed
    length + depth[i]; ``mask[b, i, j]`` is True when node j is node i's ancestor or itself (the tree attention mask).
    """

    tokens: Tensor  # [B, N] int64
    parent: Tensor  # [B, N] int64, -1 at the root
    depth: Tensor  # [B, N] int64 (= position offset)
    num_nodes: Tensor  # [B] int64
    scores: Tensor  # [B, N] float64 path scores (product of draft probabilities)
    mask: Tensor  # [B, N, N] bool
    mask_packed: Tensor  # [B, N, ceil(N / 32)] int32, bit j % 32 of word j // 32
    paths: Tensor  # [B, N, L] int64 root-to-leaf node indices, -1 padded
    num_paths: Tensor  # [B] int64 number of leaves


def tree_select(
    cand_tokens: Tensor, cand_parent: Tensor, cand_scores: Tensor, num_candidates: Tensor, num_nodes: int
) -> TreeSpec:
    """Keeps the best ``num_nodes`` candidates (root included) by path score and lays them out as a tree.

    Candidates [B, M]: candidate 0 is the root (parent -1), ``0 <= cand_parent[i] < i``, and a child's score must not
    exceed its parent's (true for products of probabilities), so the best N always contain each kept node's parent.
    Ties go to the smaller candidate index. Paths have length L = N.
    """
    return TreeSpec(*torch.ops.peagle.tree_select(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes))


def tree_build_parallel(draft_probs: Tensor, topk: list[int], num_nodes: int) -> TreeSpec:
    """P-EAGLE parallel draft tree from the K per-depth distributions of ONE drafter pass.

    The top-``topk[d]`` tokens of depth d's distribution (ties to the smaller id) are the children of every depth-d
    node: a Cartesian candidate tree whose path score is the product of the draft probabilities. The best
    ``num_nodes`` nodes are kept. ``topk = [1] * K`` gives the greedy chain. Paths have length L = min(N, K + 1).
    """
    return TreeSpec(*torch.ops.peagle.tree_build_parallel(draft_probs, list(topk), num_nodes))


def tree_expand_topk(frontier_scores: Tensor, child_probs: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """One EAGLE-2 expansion step: each frontier node proposes its top-k children with score = its score * p.

    Args:
        frontier_scores: [B, F] path scores of the frontier nodes (float64 recommended).
        child_probs: [B, F, V] float32 draft distributions after each frontier node.

    Returns:
        tokens, frontier_slot, scores: [B, F * topk] candidates sorted best first (score, then slot-major order).
    """
    return torch.ops.peagle.tree_expand_topk(frontier_scores, child_probs, topk)


def eagle2_dynamic_tree(
    root_probs: Tensor,
    draft_step: Callable[[Tensor, Tensor], Tensor],
    depth: int,
    topk: int,
    num_nodes: int,
) -> TreeSpec:
    """EAGLE-2 dynamic draft tree for an autoregressive drafter.

    Each depth expands the top-``topk`` frontier: every frontier node proposes its top-``topk`` children (cumulative
    path score = product of draft probabilities); all of them become candidates, and the ``topk`` best form the next
    frontier. Finally the best ``num_nodes`` candidates are kept (:func:`tree_select`).

    Args:
        root_probs: [B, V] draft distribution after the root.
        draft_step: called as ``draft_step(tokens, candidate_index)`` with the new frontier ([B, topk] tokens and their
            candidate indices, whose parents are earlier candidates); returns the [B, topk, V] draft distributions
            after those nodes.
        depth: number of drafted depths.
    """
    batch = root_probs.shape[0]
    device = root_probs.device
    tokens = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    scores = [torch.ones(batch, 1, dtype=torch.float64, device=device)]
    frontier_index = torch.zeros(batch, 1, dtype=torch.long, device=device)
    frontier_scores = scores[0]
    probs = root_probs[:, None, :]
    count = 1
    for d in range(depth):
        cand_tokens, slot, cand_scores = tree_expand_topk(frontier_scores, probs, topk)
        tokens.append(cand_tokens)
        parents.append(frontier_index.gather(1, slot))
        scores.append(cand_scores)
        width = min(topk, cand_tokens.shape[1])
        frontier_index = count + torch.arange(width, device=device).expand(batch, width)
        frontier_scores = cand_scores[:, :width]
        count += cand_tokens.shape[1]
        if d + 1 < depth:
            probs = draft_step(cand_tokens[:, :width], frontier_index)
    all_tokens, all_parents, all_scores = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
    num_candidates = torch.full((batch,), all_tokens.shape[1], dtype=torch.long, device=device)
    return tree_select(all_tokens, all_parents, all_scores, num_candidates, num_nodes)


def _spec_fake(ref: Tensor, batch, nodes: int, path_len: int):
    words = (nodes + 31) // 32
    long = torch.long
    return (
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, nodes, dtype=long),
        ref.new_empty(batch, dtype=long),
        ref.new_empty(batch, nodes, dtype=torch.float64),
        ref.new_empty(batch, nodes, nodes, dtype=torch.bool),
        ref.new_empty(batch, nodes, words, dtype=torch.int32),
        ref.new_empty(batch, nodes, path_len, dtype=long),
        ref.new_empty(batch, dtype=long),
    )


@torch.library.register_fake("peagle::tree_select")
def _tree_select_fake(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes):
    return _spec_fake(cand_tokens, cand_tokens.shape[0], num_nodes, num_nodes)


@torch.library.register_fake("peagle::tree_build_parallel")
def _tree_build_parallel_fake(draft_probs, topk, num_nodes):
    return _spec_fake(draft_probs, draft_probs.shape[0], num_nodes, min(num_nodes, draft_probs.shape[1] + 1))


@torch.library.register_fake("peagle::tree_expand_topk")
def _tree_expand_topk_fake(frontier_scores, child_probs, topk):
    batch, width = child_probs.shape[0], child_probs.shape[1]
    return (
        child_probs.new_empty(batch, width * topk, dtype=torch.long),
        child_probs.new_empty(batch, width * topk, dtype=torch.long),
        child_probs.new_empty(batch, width * topk, dtype=torch.float64),
    )


def _stable_order(*keys: Tensor) -> Tensor:
    """Row-wise permutation sorting by keys[0], then keys[1], ... (ascending), ties by index."""
    order = torch.arange(keys[0].shape[1], device=keys[0].device).expand_as(keys[0])
    for key in reversed(keys):
        order = order.gather(1, torch.sort(key.gather(1, order), dim=1, stable=True).indices)
    return order


def tree_select_reference(
    cand_tokens: Tensor, cand_parent: Tensor, cand_scores: Tensor, num_candidates: Tensor, num_nodes: int
) -> TreeSpec:
    """Reference of :func:`tree_select` (no input validation)."""
    return _select_reference(
        cand_tokens.long(), cand_parent.long(), cand_scores.double(), num_candidates.long(), num_nodes, num_nodes
    )


def _select_reference(tok: Tensor, par: Tensor, sc: Tensor, count: Tensor, nodes: int, path_len: int) -> TreeSpec:
    if tok.shape[1] < nodes:  # pad with invalid candidates so that every output slot has a source column
        pad = nodes - tok.shape[1]
        tok = torch.nn.functional.pad(tok, (0, pad), value=-1)
        par = torch.nn.functional.pad(par, (0, pad), value=-1)
        sc = torch.nn.functional.pad(sc, (0, pad), value=0.0)
    batch, m = tok.shape
    device = tok.device
    idx = torch.arange(m, device=device).expand(batch, m)
    valid = idx < count[:, None]
    safe_par = torch.where(valid & (idx > 0), par, 0).clamp(0, m - 1)
    depth = torch.zeros(batch, m, dtype=torch.long, device=device)
    for _ in range(m):
        new = torch.where(idx > 0, depth.gather(1, safe_par) + 1, 0)
        if torch.equal(new, depth):
            break
        depth = new
    # Selection: root first, then by score (desc) and index; invalid candidates last.
    rank_order = _stable_order((~valid).long(), (idx > 0).long(), -sc)
    rank = torch.empty_like(rank_order).scatter_(1, rank_order, idx)
    keep = torch.minimum(count, torch.tensor(nodes, device=device))
    selected = valid & (rank < keep[:, None])
    out_order = _stable_order((~selected).long(), depth, -sc)[:, :nodes]  # [B, N] candidate index per output slot
    slot_valid = torch.arange(nodes, device=device)[None, :] < keep[:, None]
    new_index = torch.full((batch, m), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, out_order, torch.arange(nodes, device=device).expand(batch, nodes))
    new_index = torch.where(selected, new_index, -1)

    def take(values: Tensor, fill):
        return torch.where(slot_valid, values.gather(1, out_order), fill)

    tokens = take(tok, -1)
    depth_out = take(depth, -1)
    scores = take(sc, 0.0)
    parent = take(torch.where(idx > 0, new_index.gather(1, safe_par), -1), -1)
    # Ancestor-or-self mask by walking parent pointers.
    rows = torch.arange(nodes, device=device).expand(batch, nodes)
    mask = torch.zeros(batch, nodes, nodes, dtype=torch.bool, device=device)
    cur = torch.where(slot_valid, rows, -1)
    for _ in range(nodes):
        live = cur >= 0
        if not bool(live.any()):
            break
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), nodes).bool() & live[..., None]
        cur = torch.where(live, parent.gather(1, cur.clamp(min=0)), -1)
    words = (nodes + 31) // 32
    padded = torch.zeros(batch, nodes, words * 32, dtype=torch.long, device=device)
    padded[..., :nodes] = mask.long()
    packed = (padded.view(batch, nodes, words, 32) << torch.arange(32, device=device)).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).int()
    # Leaves in node order; path position of an ancestor = its depth.
    has_child = torch.zeros(batch, nodes + 1, dtype=torch.bool, device=device)
    has_child.scatter_(1, torch.where(parent >= 0, parent, nodes), True)
    leaf = slot_valid & ~has_child[:, :nodes]
    num_paths = leaf.sum(1)
    leaf_rank = torch.where(leaf, leaf.long().cumsum(1) - 1, nodes)  # row of each leaf in paths
    paths = torch.full((batch, nodes + 1, path_len), -1, dtype=torch.long, device=device)
    # For each (leaf i, ancestor j): paths[b, leaf_rank[i], depth[j]] = j.
    b_idx, i_idx, j_idx = torch.nonzero(mask & leaf[..., None], as_tuple=True)
    paths[b_idx, leaf_rank[b_idx, i_idx], depth_out[b_idx, j_idx]] = j_idx
    return TreeSpec(tokens, parent, depth_out, keep, scores, mask, packed, paths[:, :nodes], num_paths)


def _topk_stable(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k (values, ids) along the last dim, ties to the smaller id."""
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def tree_build_parallel_reference(draft_probs: Tensor, topk: list[int], num_nodes: int) -> TreeSpec:
    """Reference of :func:`tree_build_parallel`."""
    batch, depths, _ = draft_probs.shape
    device = draft_probs.device
    tokens = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    scores = [torch.ones(batch, 1, dtype=torch.float64, device=device)]
    level_start, level_count = 0, 1
    for d, k in enumerate(topk):
        values, ids = _topk_stable(draft_probs[:, d], k)
        tokens.append(ids.repeat(1, level_count))
        parents.append((level_start + torch.arange(level_count, device=device)).repeat_interleave(k).expand(batch, -1))
        scores.append((scores[-1][:, :, None] * values.double()[:, None, :]).reshape(batch, -1))
        level_start += level_count
        level_count *= k
    tok, par, sc = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
    count = torch.full((batch,), tok.shape[1], dtype=torch.long, device=device)
    return _select_reference(tok, par, sc, count, num_nodes, min(num_nodes, depths + 1))


def tree_expand_topk_reference(
    frontier_scores: Tensor, child_probs: Tensor, topk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of :func:`tree_expand_topk`."""
    batch, width, _ = child_probs.shape
    values, ids = _topk_stable(child_probs, topk)
    scores = (frontier_scores.double()[:, :, None] * values.double()).reshape(batch, -1)
    order = _stable_order(-scores)
    slots = torch.arange(width, device=child_probs.device).repeat_interleave(topk).expand(batch, -1)
    return ids.reshape(batch, -1).gather(1, order), slots.gather(1, order), scores.gather(1, order)
