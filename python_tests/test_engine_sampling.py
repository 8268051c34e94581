"""Sampled speculative decoding is lossless: on a target with a 12-token vocabulary, the first 3 tokens the engine
emits follow the exact joint distribution computed by enumeration (with Hugging Face's temperature / top-k / top-p
warpers), for P-EAGLE chains and trees and EAGLE-3 trees, with Gumbel-sampled and deterministic top-k drafts
(chi-square over 10^5 samples), and under the cost-aware harness (P-EAGLE and EAGLE-3). A deliberately biased
verifier fails the same test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import peagle.decode.engine as engine
from peagle.decode import SpeculativeDecoder
from testkit import flat_cost_table, self_distilled_rows, tiny_target, train_tiny_drafter

stats = pytest.importorskip("scipy.stats")

VOCAB = 12
PROMPT = [1, 2, 3]
SAMPLES = 100_000
BATCH = 25_000

CASES = {
    # id: (method, mode, draft_sampling, temperature, top_k, top_p)
    "peagle-chain-gumbel": ("peagle", "chain", "gumbel", 1.0, 0, 1.0),
    "peagle-chain-topk": ("peagle", "chain", "topk", 0.8, 6, 1.0),
    "peagle-tree-gumbel": ("peagle", "tree", "gumbel", 1.2, 0, 0.9),
    "peagle-tree-topk": ("peagle", "tree", "topk", 1.0, 8, 0.95),
    "eagle3-tree-gumbel": ("eagle3", "tree", "gumbel", 1.0, 0, 1.0),
    "eagle3-tree-topk": ("eagle3", "tree", "topk", 0.9, 0, 0.8),
    "peagle-harness-gumbel": ("peagle", "harness", "gumbel", 1.0, 0, 0.9),
    "peagle-harness-topk": ("peagle", "harness", "topk", 0.9, 6, 1.0),
    "eagle3-harness-gumbel": ("eagle3", "harness", "gumbel", 1.0, 0, 1.0),
    "eagle3-harness-topk": ("eagle3", "harness", "topk", 1.0, 0, 0.9),
}
OPTIONS = {
    ("peagle", "chain"): {},
    ("peagle", "tree"): dict(topk=[3, 2, 2], num_nodes=10),
    ("eagle3", "tree"): dict(depth=3, topk=3, num_nodes=10),
    # The table and the observed acceptance decide (timed, the tiny target may stop drafting on the wall clock).
    ("peagle", "harness"): dict(cost_table=flat_cost_table(), num_nodes=10, harness_timing=False),
    ("eagle3", "harness"): dict(depth=3, cost_table=flat_cost_table(), num_nodes=10, harness_timing=False),
}


@pytest.fixture(scope="module")
def setup(one_thread):
    model = tiny_target(
        "llama",
        vocab_size=VOCAB,
        hidden=32,
        layers=2,
        seed=3,
        logit_scale=0.1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    rows = self_distilled_rows(model, sequences=8, length=32, seed=3)
    yield SimpleNamespace(
        model=model,
        peagle=train_tiny_drafter(model, 3, rows, steps=30, seed=3),
        eagle3=train_tiny_drafter(model, 1, rows, steps=30, seed=3),
    )


@torch.no_grad()
def exact_joint(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] by enumeration of every 2-token continuation, through Hugging Face's warpers."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def probs(scores: torch.Tensor) -> torch.Tensor:
        for warper in warpers:
            scores = warper(None, scores)
        return scores.softmax(-1)

    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (t1, t2), t1-major
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    logits = model(ids).logits.double()
    n = len(PROMPT)
    p1 = probs(logits[:1, n - 1])[0]
    p2 = probs(logits[::VOCAB, n])  # after t1 (rows t1 * V)
    p3 = probs(logits[:, n + 1]).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_counts(decoder: SpeculativeDecoder, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    counts = torch.zeros(VOCAB**3, dtype=torch.long)
    for call in range(SAMPLES // BATCH):
        seeds = list(range(call * BATCH, (call + 1) * BATCH))
        out = decoder.generate([PROMPT] * BATCH, 3, temperature=temperature, top_k=top_k, top_p=top_p, seed=seeds)
        first = torch.tensor(out.tokens)
        counts += torch.bincount((first[:, 0] * VOCAB + first[:, 1]) * VOCAB + first[:, 2], minlength=VOCAB**3)
    return counts


def chi_square_pvalue(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Chi-square p-value of the counts against the joint; cells with expected count < 5 are pooled. A sample in a
    cell of probability 0 gives 0."""
    expected = joint.flatten() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[small].double().sum()[None]])
    expect = torch.cat([expected[big], expected[small].sum()[None]])
    observed, expect = observed[expect > 0], expect[expect > 0]
    return float(stats.chisquare(observed.numpy(), expect.numpy()).pvalue)


def decoder_for(setup, method: str, mode: str, draft_sampling: str) -> SpeculativeDecoder:
    drafter = setup.peagle if method == "peagle" else setup.eagle3
    options = OPTIONS[(method, mode)]
    return SpeculativeDecoder(setup.model, drafter, mode, method=method, draft_sampling=draft_sampling, block_size=4,
                              **options)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_first_three_tokens_follow_the_exact_distribution(setup, case):
    method, mode, draft_sampling, temperature, top_k, top_p = CASES[case]
    decoder = decoder_for(setup, method, mode, draft_sampling)
    joint = exact_joint(setup.model, temperature, top_k, top_p)
    counts = sample_counts(decoder, temperature, top_k, top_p)
    pvalue = chi_square_pvalue(counts, joint)
    print(f"{case}: chi-square p-value {pvalue:.4f}")
    assert pvalue > 1e-3


def biased_rejection_sample(parent, tokens, num_nodes, target_probs, draft_probs=None, uniforms=None, **kwargs):
    """A wrong verifier: accepts a draft whenever the target gives its token any probability (every node's row
    becomes one-hot on its first child the target gives mass), then samples the bonus as usual."""
    batch, nodes, vocab = target_probs.shape
    index = torch.arange(nodes)
    child = (parent[:, None, :] == index[None, :, None]) & (index[None, None, :] < num_nodes[:, None, None])
    p_child = target_probs.gather(2, tokens.clamp(min=0)[:, None, :].expand(batch, nodes, nodes))
    ok = child & (p_child > 0)
    first = torch.where(ok, index, nodes).amin(-1).clamp(max=nodes - 1)
    onehot = F.one_hot(tokens.gather(1, first), vocab).float()
    rows = torch.where(ok.any(-1)[..., None], onehot, target_probs)
    return REAL_REJECTION_SAMPLE(parent, tokens, num_nodes, rows, None, uniforms)


REAL_REJECTION_SAMPLE = engine.tree_rejection_sample


def test_a_biased_verifier_fails_the_test(setup, monkeypatch):
    method, mode, draft_sampling, temperature, top_k, top_p = CASES["peagle-tree-gumbel"]
    monkeypatch.setattr(engine, "tree_rejection_sample", biased_rejection_sample)
    decoder = decoder_for(setup, method, mode, draft_sampling)
    counts = sample_counts(decoder, temperature, top_k, top_p)
    pvalue = chi_square_pvalue(counts, exact_joint(setup.model, temperature, top_k, top_p))
    print(f"biased verifier: chi-square p-value {pvalue:.3g}")
    assert pvalue < 1e-6
