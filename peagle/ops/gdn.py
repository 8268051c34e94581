"""Gated DeltaNet (GDN) layers over a draft tree: verification, state commit, and the causal conv1d in front of GDN.

Hybrid targets (Qwen3-Next style) interleave GDN linear-attention layers with attention layers. To verify a draft tree
in one forward pass, every node's recurrent state must derive from its parent's; after acceptance, the state after the
last accepted node becomes the committed state. Per value head, with state S [K, V] (fp32):

    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)

(q/k optionally L2-normalised; value head hv uses q/k head hv // (HV / H)). Node 0, and any node whose parent is -1,
starts from the committed state ``state_pool[slots[b]]``.

How commit gets the accepted state. Keeping every node's state would cost n x HV x K x V x 4 bytes per layer and
request (2 MiB per node at HV = 32, K = V = 128). Instead, the kernels use the closed form of the delta rule over the
tree (see csrc/include/peagle/gdn.h): S_i = exp(G_i) S0 + sum_{j on the path to i} exp(G_i - G_j) k_j u_j^T, where G is
the cumulative gate along the path and u_j the "delta values" the verification solves for anyway. Verification
returns u [B, n, HV, V] fp32 (V x 4 bytes per node and head: K times smaller than a state, 16 KiB per node at HV = 32,
V = 128), and :func:`gdn_commit` rebuilds the accepted node's state in place from S0, the path's k, g and u in one pass
(path length x K x V multiply-adds per head; no replay of the triangular solve, no per-node state at any n).

The references below (sequential recurrence along each root-to-node path) are the executable specification.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "GdnVerifyOutput",
    "causal_conv1d_commit",
    "causal_conv1d_commit_reference",
    "causal_conv1d_tree",
    "causal_conv1d_tree_reference",
    "gdn_commit",
    "gdn_commit_reference",
    "gdn_recurrence_reference",
    "gdn_spec_step",
    "gdn_spec_step_reference",
    "gdn_tree_verify",
    "gdn_tree_verify_reference",
    "gdn_tree_verify_slots",
    "gdn_tree_verify_slots_reference",
    "set_gdn_cache_layers",
    "tree_path",
]

L2NORM_EPS = 1e-6


class GdnVerifyOutput(NamedTuple):
    o: Tensor  # [B, n, HV, V] in v's dtype: the GDN output of every node
    u: Tensor  # [B, n, HV, V] fp32: delta values, what gdn_commit needs to rebuild the accepted state


def gdn_tree_verify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parent: Tensor,
    state_pool: Tensor,
    slots: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    validate: bool = True,
    tensor_cores: bool = False,
) -> GdnVerifyOutput:
    """GDN outputs of every node of a draft tree per request; the committed states are only read.

    Args:
        q, k: [B, n, H, K] float32/bfloat16/float16.
        v: [B, n, HV, V], q's dtype; HV a multiple of H (value heads share q/k heads).
        g: [B, n, HV] log decay (g <= 0 keeps the state bounded); beta: [B, n, HV] write strength.
        parent: [B, n] int, parent[b, i] in [-1, i); -1 starts from the committed state (node 0, or padding).
            1 <= n <= 64.
        state_pool: [P, HV, K, V] float32 committed states; slots: [B] the pool row of each request.
            Layouts: q, k, v with a contiguous last dim are read through their strides (the splits of a fused qkv
            projection need no copy; other layouts are copied); state_pool needs contiguous rows of V and
            non-overlapping outer strides (a slice of a larger cache is fine; it is never copied).
        scale: multiplies q (default K^-0.5). use_qk_l2norm: L2-normalise q and k first (eps 1e-6).
        validate: check parent/slot values (on CUDA this synchronises with the host, unless deferred checks are on:
            :mod:`peagle.ops.errors`). Pass False, or turn deferred checks on, inside CUDA graphs:
            the kernels then guard themselves and a request with bad indices gets NaN outputs. The CPU always checks.
        tensor_cores: on CUDA (sm_80+, built with the CUTLASS headers), project the committed states on TF32 tensor
            cores with fp32 accumulation: faster for large trees, within ~1e-3 of the exact path rather than equal
            to it. By default (and on the CPU) every result is the exact fp32 computation, bit-identical across
            backends.

    Returns:
        (o, u): o [B, n, HV, V] in v's dtype; u [B, n, HV, V] float32 for :func:`gdn_commit`.
    """
    o, u = torch.ops.peagle.gdn_tree_verify(
        q, k, v, g, beta, parent, state_pool, slots, scale, use_qk_l2norm, validate, tensor_cores
    )
    return GdnVerifyOutput(o, u)


def gdn_tree_verify_slots(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parent: Tensor,
    state_cache: Tensor,
    start_slots: Tensor,
    state_slots: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    validate: bool = True,
) -> Tensor:
    """Verification that reads and writes a state cache in place: the outputs of every node, and the state after each
    node written into its own slot (vLLM's speculative GDN step: the state after draft t goes to slot t, and the next
    step resumes from the slot of the last accepted draft).

    Args:
        q, k, v, g, beta, parent, scale, use_qk_l2norm: as in :func:`gdn_tree_verify`.
        state_cache: [P, HV, K, V], float32 or q's dtype (vLLM's bfloat16 caches), updated in place: contiguous rows
            of V and non-overlapping outer strides (a slice of a larger cache is fine; it is never copied).
        start_slots: [B] int, request b starts from ``state_cache[start_slots[b]]`` (read as fp32).
        state_slots: [B, n] int, the state after node i of request b goes to ``state_cache[state_slots[b, i]]``
            (rounded to the cache's dtype); -1 writes nothing. The slots written must be distinct, and none may be
            another request's start slot (a request may overwrite its own: its start state is read first).
        validate: as in :func:`gdn_tree_verify`; on CUDA without the host checks (validate=False, or deferred checks)
            the slots are claimed on the device: a request whose start slot or written slots another request also
            writes is skipped (NaN outputs, nothing written), and :func:`peagle.ops.check_errors` raises the host
            check's error.

    Node states follow the recurrence node by node from the parent's state with the verification's delta values,
    ``S_i = exp(g_i) S_parent + f_i k_i u_i^T`` in fp32 (the start state converted exactly), so a chain's states equal
    :func:`gdn_commit` applied to one node after another, and the outputs equal :func:`gdn_tree_verify`'s bit for bit.

    Returns:
        o [B, n, HV, V] in v's dtype.
    """
    return torch.ops.peagle.gdn_tree_verify_slots(
        q, k, v, g, beta, parent, state_cache, start_slots, state_slots, scale, use_qk_l2norm, validate
    )


def gdn_spec_step(
    A_log: Tensor,  # vLLM's argument names: the vLLM plugin installs this op in place of vLLM's by keyword
    dt_bias: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    initial_state_source: Tensor,
    spec_state_indices: Tensor,
    num_accepted_tokens: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> Tensor:
    """vLLM's speculative GDN step (sigmoid gating, one state slot per draft position) in one op.

    Args:
        A_log, dt_bias: [HV]; the gates are ``g = -exp(A_log) softplus(a + dt_bias)`` (torch's softplus with
            ``softplus_beta`` and ``softplus_threshold``) and ``beta = sigmoid(b)``, in float32.
        q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV] (same dtype): the T tokens of all sequences, flattened.
        initial_state_source: [P, HV, K, V], float32 or q's dtype, updated in place (vLLM's state cache).
        spec_state_indices: [>= S, >= n] int: the slots of each sequence's positions.
        num_accepted_tokens: [>= S] int: sequence s starts from slot
            ``spec_state_indices[s, num_accepted_tokens[s] - 1]`` (column 0 when it is 0).
        cu_seqlens: [S + 1] int, 0 .. T: sequence s is tokens ``cu_seqlens[s] .. cu_seqlens[s + 1]`` (read on the
            host: the chain length n is a shape); the state after its token t goes to slot ``spec_state_indices[s, t]``.
        use_qk_l2norm_in_kernel: L2-normalise q and k (scale K^-0.5 either way).

    One :func:`gdn_tree_verify_slots` over the chains (no gathered copy of the states, no loop over positions); the slot
    rules are its own (written slots distinct, none another sequence's start slot). Returns o [T, HV, V] in v's dtype.
    """
    return torch.ops.peagle.gdn_spec_step(
        A_log, dt_bias, q, k, v, a, b, initial_state_source, spec_state_indices, num_accepted_tokens, cu_seqlens,
        use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold,
    )  # fmt: skip


def set_gdn_cache_layers(layers: int) -> int:
    """Tells the CPU kernels how many GDN layers' state caches one serving step writes; returns the previous value (2
    until set). The vLLM plugin counts them itself.

    :func:`gdn_tree_verify_slots` (and so :func:`gdn_spec_step`) writes every position's state into the cache, and the
    next step reads one of them back, after every other GDN layer wrote as many of its own. When ``layers`` times the
    bytes one call writes exceed a quarter of the last-level cache, the states would be evicted before that read, so
    the call writes them with streaming stores (no read for ownership of each line, nothing evicted for them); below
    it, cached stores leave them for the next step. ``PEAGLE_CPU_STREAMING_BYTES`` replaces the quarter of the cache.
    Process-wide; the values computed do not depend on it.
    """
    return torch.ops.peagle.set_gdn_cache_layers(layers)


def gdn_commit(
    k: Tensor,
    g: Tensor,
    u: Tensor,
    parent: Tensor,
    last_accepted: Tensor,
    state_pool: Tensor,
    slots: Tensor,
    use_qk_l2norm: bool = False,
    validate: bool = True,
) -> None:
    """Commits, in place, the state after each request's last accepted node into ``state_pool[slots[b]]``.

    Equal to running the sequential recurrence over the accepted path root..last_accepted[b] from the committed state.
    ``k, g, parent, slots, use_qk_l2norm`` are those given to :func:`gdn_tree_verify`, ``u`` its second output.
    last_accepted[b] = -1 leaves request b's state unchanged. Active requests must use distinct slots. Layouts as in
    :func:`gdn_tree_verify` (k and the pool are used in place).
    validate=False skips the host-synchronising value checks (CUDA graphs; deferred checks, :mod:`peagle.ops.errors`,
    keep them on the device instead); a request with bad indices is then skipped. Without the host checks, CUDA claims
    the slots on the device: a slot that several committing requests share is left unchanged (they never race on it)
    and :func:`peagle.ops.check_errors` raises the host check's error for the smallest such slot.
    """
    torch.ops.peagle.gdn_commit(k, g, u, parent, last_accepted, state_pool, slots, use_qk_l2norm, validate)


def causal_conv1d_tree(
    x: Tensor,
    parent: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    validate: bool = True,
    slots: Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv1d over a draft tree: node i's window is (committed state, ancestors of i, i).

    Args:
        x: [B, n, C] inputs of the tree nodes; parent: [B, n] as in :func:`gdn_tree_verify`.
        conv_state: [B, C, W - 1] x's dtype, the last W - 1 committed inputs (column W - 2 is the newest); with
            ``slots``, a cache [P, C, W - 1] whose row slots[b] is request b's (read in place, no gathered copy).
        weight: [C, W] (tap W - 1 multiplies the newest input); bias: [C] or None.
        activation: None / "none" / "identity", or "silu" / "swish".
        validate: as in :func:`gdn_tree_verify` (bad trees or slots give NaN outputs when False on CUDA).
        slots: [B] int in [0, P), or None.

    Returns:
        [B, n, C] in x's dtype (accumulated in fp32).
    """
    return torch.ops.peagle.causal_conv1d_tree(x, parent, conv_state, weight, bias, activation, validate, slots)


def causal_conv1d_commit(
    x: Tensor,
    parent: Tensor,
    last_accepted: Tensor,
    conv_state: Tensor,
    validate: bool = True,
    slots: Tensor | None = None,
) -> None:
    """Commits, in place, the conv state after each request's last accepted node (the last W - 1 inputs of
    committed state + accepted path). last_accepted[b] = -1 leaves request b unchanged. With ``slots`` ([B] int),
    conv_state is a cache [P, C, W - 1] and request b commits into its row slots[b]; the committing requests' slots
    must be in [0, P) and distinct (as :func:`gdn_commit`'s). validate: as in :func:`gdn_commit`."""
    torch.ops.peagle.causal_conv1d_commit(x, parent, last_accepted, conv_state, validate, slots)


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


@torch.library.register_fake("peagle::gdn_tree_verify")
def _gdn_tree_verify_fake(
    q, k, v, g, beta, parent, state_pool, slots, scale=None, use_qk_l2norm=False, validate=True, tensor_cores=False
):
    return v.new_empty(v.shape), v.new_empty(v.shape, dtype=torch.float32)


@torch.library.register_fake("peagle::gdn_tree_verify_slots")
def _gdn_tree_verify_slots_fake(
    q, k, v, g, beta, parent, state_cache, start_slots, state_slots, scale=None, use_qk_l2norm=False, validate=True
):
    return v.new_empty(v.shape)


@torch.library.register_fake("peagle::gdn_spec_step")
def _gdn_spec_step_fake(
    A_log, dt_bias, q, k, v, a, b, initial_state_source, spec_state_indices, num_accepted_tokens, cu_seqlens,
    use_qk_l2norm_in_kernel, softplus_beta=1.0, softplus_threshold=20.0,
):  # fmt: skip
    return v.new_empty(v.shape)


@torch.library.register_fake("peagle::gdn_commit")
def _gdn_commit_fake(k, g, u, parent, last_accepted, state_pool, slots, use_qk_l2norm=False, validate=True):
    return None


@torch.library.register_fake("peagle::causal_conv1d_tree")
def _causal_conv1d_tree_fake(x, parent, conv_state, weight, bias=None, activation=None, validate=True, slots=None):
    return x.new_empty(x.shape)


@torch.library.register_fake("peagle::causal_conv1d_commit")
def _causal_conv1d_commit_fake(x, parent, last_accepted, conv_state, validate=True, slots=None):
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Pure-PyTorch references: the sequential recurrence along each root-to-node path.


def tree_path(parent: Tensor | list[int], node: int) -> list[int]:
    """Node indices from the path's root (a node whose parent is -1) to ``node``."""
    parents = parent.tolist() if isinstance(parent, Tensor) else parent
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gdn_recurrence_reference(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Tensor | None, Tensor]:
    """Plain sequential GDN recurrence over T tokens, computed in ``state``'s dtype.

    q, k [T, H, K] (q may be None), v [T, HV, V], g, beta [T, HV], state [HV, K, V] (not modified).
    Returns (o [T, HV, V] or None, final state [HV, K, V]).
    """
    dtype = state.dtype
    hv, key_dim = state.shape[0], state.shape[1]
    group = hv // k.shape[1]
    scale = key_dim**-0.5 if scale is None else scale
    k = k.to(dtype).repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        k = _l2norm(k)
    if q is not None:
        q = q.to(dtype).repeat_interleave(group, dim=1)
        q = (_l2norm(q) if use_qk_l2norm else q) * scale
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    s = state.clone()
    outputs = []
    for t in range(k.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        if q is not None:
            outputs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    o = torch.stack(outputs) if q is not None and outputs else None
    return o, s


def gdn_tree_verify_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parent: Tensor,
    state_pool: Tensor,
    slots: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Every node's output by the sequential recurrence along its root-to-node path; o [B, n, HV, V] in
    ``compute_dtype``."""
    batch, nodes = q.shape[:2]
    o = torch.empty(batch, nodes, v.shape[2], v.shape[3], dtype=compute_dtype, device=v.device)
    for b in range(batch):
        s0 = state_pool[int(slots[b])].to(compute_dtype)
        for i in range(nodes):
            p = tree_path(parent[b], i)
            out, _ = gdn_recurrence_reference(q[b, p], k[b, p], v[b, p], g[b, p], beta[b, p], s0, scale, use_qk_l2norm)
            o[b, i] = out[-1]
    return o


def gdn_tree_verify_slots_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parent: Tensor,
    state_cache: Tensor,
    start_slots: Tensor,
    state_slots: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """(o [B, n, HV, V] in ``compute_dtype``, new state cache): every node by the sequential recurrence along its
    root-to-node path from ``state_cache[start_slots[b]]``; the state after node i goes into a copy of the cache at
    ``state_slots[b, i]`` (>= 0), in the cache's dtype. Start states are all read before any slot is written."""
    batch, nodes = q.shape[:2]
    o = torch.empty(batch, nodes, v.shape[2], v.shape[3], dtype=compute_dtype, device=v.device)
    starts = [state_cache[int(start_slots[b])].to(compute_dtype) for b in range(batch)]
    cache = state_cache.clone()
    for b in range(batch):
        for i in range(nodes):
            p = tree_path(parent[b], i)
            out, state = gdn_recurrence_reference(
                q[b, p], k[b, p], v[b, p], g[b, p], beta[b, p], starts[b], scale, use_qk_l2norm
            )
            o[b, i] = out[-1]
            if int(state_slots[b, i]) >= 0:
                cache[int(state_slots[b, i])] = state.to(cache.dtype)
    return o, cache


def gdn_spec_step_reference(
    A_log: Tensor,
    dt_bias: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    initial_state_source: Tensor,
    spec_state_indices: Tensor,
    num_accepted_tokens: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[Tensor, Tensor]:
    """(o [T, HV, V] float32, new state cache): each sequence by the sequential recurrence from its start slot, token by
    token, the state after token t stored (in the cache's dtype) into a copy of the cache at its slot."""
    gate = -A_log.float().exp() * torch.nn.functional.softplus(
        a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold
    )
    beta = b.float().sigmoid()
    o = torch.zeros(v.shape, dtype=torch.float32)
    cache = initial_state_source.clone()
    bounds = [int(x) for x in cu_seqlens]
    starts = [
        initial_state_source[int(spec_state_indices[s, max(int(num_accepted_tokens[s]) - 1, 0)])].float()
        for s in range(len(bounds) - 1)
    ]
    for s, (begin, end) in enumerate(itertools.pairwise(bounds)):
        state = starts[s]
        for t in range(end - begin):
            token = slice(begin + t, begin + t + 1)
            out, state = gdn_recurrence_reference(
                q[token], k[token], v[token], gate[token], beta[token], state, None, use_qk_l2norm_in_kernel
            )
            o[begin + t] = out[-1]
            cache[int(spec_state_indices[s, t])] = state.to(cache.dtype)
    return o, cache


def gdn_commit_reference(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parent: Tensor,
    last_accepted: Tensor,
    state_pool: Tensor,
    slots: Tensor,
    use_qk_l2norm: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """New state pool (a copy, in ``compute_dtype``): the recurrence over each accepted path from the committed
    state."""
    pool = state_pool.to(compute_dtype).clone()
    for b in range(k.shape[0]):
        a = int(last_accepted[b])
        if a < 0:
            continue
        p = tree_path(parent[b], a)
        slot = int(slots[b])
        _, pool[slot] = gdn_recurrence_reference(
            None, k[b, p], v[b, p], g[b, p], beta[b, p], pool[slot], None, use_qk_l2norm
        )
    return pool


def _conv_window(x_b: Tensor, state_b: Tensor, path: list[int], width: int) -> Tensor:
    sequence = torch.cat([state_b, x_b[path].transpose(0, 1)], dim=1)  # [C, W - 1 + L], oldest first
    return sequence[:, -width:]


def causal_conv1d_tree_reference(
    x: Tensor,
    parent: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    compute_dtype: torch.dtype = torch.float32,
    slots: Tensor | None = None,
) -> Tensor:
    """Per node: the causal conv over (committed state, root-to-node path inputs); [B, n, C] in ``compute_dtype``.
    With ``slots``, request b's committed state is conv_state[slots[b]]."""
    if slots is not None:
        conv_state = conv_state[slots.long()]
    batch, nodes, channels = x.shape
    width = weight.shape[1]
    w = weight.to(compute_dtype)
    out = torch.empty(batch, nodes, channels, dtype=compute_dtype, device=x.device)
    for b in range(batch):
        for i in range(nodes):
            window = _conv_window(
                x[b].to(compute_dtype), conv_state[b].to(compute_dtype), tree_path(parent[b], i), width
            )
            y = (window * w).sum(-1)
            if bias is not None:
                y = y + bias.to(compute_dtype)
            out[b, i] = torch.nn.functional.silu(y) if activation in ("silu", "swish") else y
    return out


def causal_conv1d_commit_reference(
    x: Tensor, parent: Tensor, last_accepted: Tensor, conv_state: Tensor, slots: Tensor | None = None
) -> Tensor:
    """New conv state (a copy): the last W - 1 inputs of (committed state, accepted path); with ``slots``, request b's
    row of the cache is slots[b]."""
    new_state = conv_state.clone()
    width = conv_state.shape[2] + 1
    for b in range(x.shape[0]):
        a = int(last_accepted[b])
        row = b if slots is None else int(slots[b])
        if a >= 0:
            new_state[row] = _conv_window(x[b], conv_state[row], tree_path(parent[b], a), width - 1)
    return new_state
