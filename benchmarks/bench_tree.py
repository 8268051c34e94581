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
import time
from pathlib import Path

import pytest
import torch

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


def best_time(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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
    RESULTS.append(("build_parallel " + "x".join(map(str, topk)), batch, nodes, vocab, t_op, t_ref, float("nan")))
