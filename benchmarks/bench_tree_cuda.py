"""Tree verification on the GPU (skipped without CUDA; cuda_tests/run_gpu.sh runs it with `-k cuda`): the CUDA ops
against the strongest public chain samplers installed beside them (flashinfer's chain speculative sampling), and
against the PyTorch reference on the GPU. Ratios come from one run; nothing is asserted about time.

The large shapes and the reference timings are opt-in (PEAGLE_GPU_TIMINGS=1): the default cases keep the GPU
script's build + tests + benchmarks within its time budget.
"""

from __future__ import annotations

import os

import pytest
import torch
from common import cuda_time

import peagle  # noqa: F401
from peagle.ops import tree_rejection_sample, tree_rejection_sample_reference, tree_verify_greedy
from testkit import random_tree_batch, random_tree_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LONG = os.environ.get("PEAGLE_GPU_TIMINGS", "0") not in ("", "0")
SHAPES = [(1, 8, 32000), (8, 32, 32000)] + ([(64, 64, 151936)] if LONG else [])
CHAINS = [(8, 4, 32000)] + ([(64, 7, 151936)] if LONG else [])


def tree_inputs(batch: int, n_max: int, vocab: int, chain: bool = False):
    generator = torch.Generator().manual_seed(batch * 1000 + n_max)
    tree = random_tree_batch(generator, batch, n_max, vocab, chain=chain, full=True)
    target = random_tree_probs(generator, tree, vocab).cuda()
    draft = random_tree_probs(generator, tree, vocab).cuda()
    return (tree.parent.cuda(), tree.tokens.cuda(), tree.num_nodes.cuda(), target), draft, tree


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


@pytest.mark.parametrize("shape", CHAINS, ids=lambda s: "B{}-K{}-V{}".format(*s))
def test_cuda_chain_vs_flashinfer(benchmark, shape):
    flashinfer = pytest.importorskip("flashinfer")
    batch, k, vocab = shape
    args, draft, chain = tree_inputs(batch, k + 1, vocab, chain=True)
    draft_ids = chain.tokens[:, 1:].cuda().int()
    chain_draft = draft[:, :k].contiguous()
    sampler = flashinfer.sampling.chain_speculative_sampling
    try:
        theirs = cuda_time(lambda: sampler(chain_draft, draft_ids, args[3]))
    except (TypeError, RuntimeError) as err:  # signatures differ between flashinfer releases
        pytest.skip(f"flashinfer chain_speculative_sampling failed: {err}")
    baselines = {"flashinfer chain_speculative_sampling": theirs}
    benchmark.extra_info.update(impl="peagle", case=f"cuda chain sampled B,K,V={shape}", baselines=baselines)
    benchmark.pedantic(lambda: (tree_rejection_sample(*args, draft, seed=1), torch.cuda.synchronize()), rounds=10)
