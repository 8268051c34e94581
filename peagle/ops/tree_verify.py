"""Draft-tree verification: greedy tree verification and lossless tree rejection sampling over batches of draft trees
(construction: :mod:`peagle.ops.tree_build`).

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

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DRAFT_FLOOR",
    "TreeVerifyOutput",
    "draft_distribution",
    "philox_uniforms",
    "target_probs",
    "tree_rejection_sample",
    "tree_rejection_sample_reference",
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


# The distributions sampled verification compares (the engine's rounds and offline evaluation alike).
# Draft probabilities below this are raised to it (then renormalised), so every drawable token has q > 0.
DRAFT_FLOOR = 1e-9


def target_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """float32 probabilities [..., V] after temperature (> 0), top-k (0 = off) and top-p (1 = off)."""
    scores = logits.double() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(dim=-1).float()


def draft_distribution(logits: Tensor, temperature: float) -> Tensor:
    """The drafter's float32 distribution [..., V] at ``temperature`` (1 when greedy), floored so that every token
    has positive probability (a Gumbel draw must never pick a token of probability 0)."""
    probs = (logits.float() / (temperature if temperature > 0 else 1.0)).softmax(dim=-1).clamp_min(DRAFT_FLOOR)
    return probs / probs.sum(dim=-1, keepdim=True)


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
