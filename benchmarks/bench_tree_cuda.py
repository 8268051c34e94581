"""Tree verification on the GPU (skipped without CUDA; cuda_tests/run_gpu.sh runs it with `-k cuda`): the CUDA ops
against the PyTorch reference on the GPU, and tree construction (tree_build_parallel) against the host round trip it
replaced (the probabilities copied to the host, the CPU kernel, the tree copied back) and against torch.topk of the
same rows on the GPU (the top-k step alone). Ratios come from one run; nothing is asserted about time. The public
chain samplers (flashinfer, vLLM) are measured side by side in bench_peers_cuda.py.

The large shapes and the reference timings are opt-in (PEAGLE_GPU_TIMINGS=1): the default cases keep the GPU
script's build + tests + benchmarks within its time budget.
"""

from __future__ import annotations

import os

import pytest
import torch
from common import cuda_time

import peagle  # noqa: F401
from peagle.ops import tree_build_parallel, tree_rejection_sample, tree_rejection_sample_reference, tree_verify_greedy
from testkit import random_tree_batch, random_tree_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LONG = os.environ.get("PEAGLE_GPU_TIMINGS", "0") not in ("", "0")
SHAPES = [(1, 8, 32000), (8, 32, 32000)] + ([(64, 64, 151936)] if LONG else [])
BUILDS = [(8, 4, 32000)] + ([(64, 8, 151936)] if LONG else [])  # B, K, V
BUILD_TOPK = [8, 4, 2, 2, 1, 1, 1, 1]


def tree_inputs(batch: int, n_max: int, vocab: int, chain: bool = False, device: str = "cuda"):
    """((parent, tokens, num_nodes, target_probs), draft_probs) on the device, and the tree on the host."""
    generator = torch.Generator().manual_seed(batch * 1000 + n_max)
    tree = random_tree_batch(generator, batch, n_max, vocab, chain=chain, full=True)
    target = random_tree_probs(generator, tree, vocab).to(device)
    draft = random_tree_probs(generator, tree, vocab).to(device)
    return (tree.parent.to(device), tree.tokens.to(device), tree.num_nodes.to(device), target), draft, tree


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-n{}-V{}".format(*s))
@pytest.mark.parametrize("mode", ["greedy", "sampled", "sampled-topk"])
def test_cuda_tree_verify(benchmark, mode, shape):
    """sampled: stochastic drafts (a residual row where a child is rejected); sampled-topk: deterministic drafts (no
    residual row: the final sample comes from the row's chunk sums)."""
    args, draft, _ = tree_inputs(*shape)
    if mode != "sampled":
        draft = None
    if mode == "greedy":
        op = lambda: tree_verify_greedy(*args)  # noqa: E731
    else:
        op = lambda: tree_rejection_sample(*args, draft, seed=1)  # noqa: E731
    baselines = {}
    if LONG:
        baselines["pytorch reference (GPU)"] = cuda_time(
            lambda: tree_rejection_sample_reference(*args, draft, seed=1), repeat=2
        )
    benchmark.extra_info.update(impl="peagle", case=f"cuda tree {mode} B,n,V={shape}", baselines=baselines)
    benchmark.pedantic(lambda: (op(), torch.cuda.synchronize()), rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("shape", BUILDS, ids=lambda s: "B{}-K{}-V{}".format(*s))
def test_cuda_tree_build_parallel(benchmark, shape):
    batch, depths, vocab = shape
    generator = torch.Generator().manual_seed(batch)
    probs = torch.softmax(torch.randn(batch, depths, vocab, generator=generator) * 4, -1).cuda()
    topk, nodes = BUILD_TOPK[:depths], 64
    baselines = {
        "host round trip (CPU kernel)": cuda_time(
            lambda: [t.cuda() for t in tree_build_parallel(probs.cpu(), topk, nodes)], repeat=3
        ),
        "torch.topk of the rows (GPU)": cuda_time(lambda: torch.topk(probs, max(topk), dim=-1)),
    }
    benchmark.extra_info.update(impl="peagle", case=f"cuda tree_build_parallel B,K,V={shape}", baselines=baselines)
    benchmark.pedantic(lambda: (tree_build_parallel(probs, topk, nodes), torch.cuda.synchronize()), rounds=10)
