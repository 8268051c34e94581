"""The engine serving drafters with the EAGLE-4 options (eh_proj, NoPE, sliding window, MoE): the cached passes equal
the uncached drafter, a sliding-window pass reads the same number of cached entries at any context length, and greedy
decoding with options-on drafters is the target's greedy output in chain and tree modes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine import (
    NEW_TOKENS,
    OPTIONS,
    PROMPTS,
    assert_cached_pass_equals_forward_inference,
    eagle3,
    feed,
    random_drafter,
    random_prefix,
    reference_probs,
)

from peagle.decode import SpeculativeDecoder
from peagle.decode.drafting import PEagleDrafting, Sampling
from peagle.ops.gdn import tree_path
from peagle.train.evaluate import chain_drafts
from testkit import fresh_seed, greedy_reference, self_distilled_rows, tiny_target, train_tiny_drafter

SERVED_OPTIONS = [
    dict(sliding_window=5),
    dict(sliding_window=1, nope=True),
    dict(eh_proj=True, moe_num_experts=3, moe_top_k=2),
    dict(eh_proj=True, nope=True, sliding_window=40, moe_num_experts=4, moe_top_k=1, layer_style="qwen3"),
    dict(efficient_lm_head_rank=8, efficient_lm_head_candidates=12, sliding_window=7),
]


def case_id(changes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in changes.items())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("changes", SERVED_OPTIONS, ids=case_id)
@torch.no_grad()  # as the engine drafts (the efficient head's op has no autograd)
def test_cached_peagle_pass_with_options_equals_forward_inference(changes):
    """test_engine's cached-pass check with the options on, the sliding window included."""
    assert_cached_pass_equals_forward_inference(changes)


@pytest.mark.parametrize("changes", [dict(sliding_window=3), dict(sliding_window=1, eh_proj=True)], ids=case_id)
def test_cached_eagle3_chain_with_a_window_equals_chain_drafts(changes):
    """Greedy EAGLE-3 chains over the windowed cache == evaluate.chain_drafts under the windowed P-EAGLE mask (chains
    deeper than the window: a node keeps its anchor and ancestors, as the mask's chain rule does)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 1, draft_vocab_size=50, **changes)
    drafting = eagle3(model, "chain", 5, 1, 6)
    batch = 3
    tokens, hidden = random_prefix(gen, batch, 40)
    drafting.allocate(batch, 48, 30, block_size=4)
    seen = [0] * batch
    greedy = Sampling(0.0, False, torch.zeros(batch, dtype=torch.long), 0)
    for lengths in ([30, 7, 19], [3, 1, 6]):
        feed(drafting, tokens, hidden, seen, lengths)
        tree = drafting.draft(torch.arange(batch), list(range(batch)), torch.zeros(batch, dtype=torch.long), greedy)
        for b in range(batch):
            seen[b] += lengths[b]
            end = seen[b]
            _, drafts = chain_drafts(model, tokens[b, :end], hidden[b, :end], torch.zeros(end, dtype=torch.long),
                                     torch.tensor([end - 1]), 5)  # fmt: skip
            assert tree.tokens[b, 1:].tolist() == drafts[0].tolist()


def test_eagle3_tree_nodes_with_options_follow_the_uncached_drafter():
    """Every node of an EAGLE-2 dynamic tree of an options drafter (window wider than the tree) is a top-k token of
    the uncached drafter's distribution after its path."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 1, draft_vocab_size=50, sliding_window=8, nope=True, moe_num_experts=3, moe_top_k=2)
    topk, depth, budget = 3, 4, 14
    drafting = eagle3(model, "tree", depth, topk, budget)
    tokens, hidden = random_prefix(gen, 2, 20)
    drafting.allocate(2, 40, 20, block_size=8)
    lengths = [20, 13]
    feed(drafting, tokens, hidden, [0, 0], lengths)
    tree = drafting.draft(torch.arange(2), [0, 1], torch.tensor([7, 8]), Sampling(0.0, False, torch.tensor([5, 6]), 3))
    draft_ids = model.draft_ids()
    for b in range(2):
        for i in range(1, int(tree.num_nodes[b])):
            path = tree_path(tree.parent[b], i)
            probs = reference_probs(
                model, tokens[b, : lengths[b]], hidden[b, : lengths[b]], tree.tokens[b, path[1:-1]].tolist()
            )
            token = int(torch.nonzero(draft_ids == tree.tokens[b, i]))
            assert probs[token] >= torch.topk(probs, topk).values[-1] - 1e-12


def test_sliding_window_reads_the_same_entries_at_any_context_length():
    """The append-only draft cache keeps every committed entry, but a windowed pass reads a fixed number of them."""
    gen = torch.Generator().manual_seed(fresh_seed())
    read = {}
    for window in (None, 6):
        model = random_drafter(gen, 4, sliding_window=window)
        drafting = PEagleDrafting(model, 61, "chain", 4, [1] * 4, 5)
        drafting.allocate(1, 520, 8, block_size=4)
        tokens, hidden = random_prefix(gen, 1, 512)
        seen = 0
        for length in (16, 240, 256):
            feed(drafting, tokens, hidden, [seen], [length])
            drafting.run_pending(torch.arange(1), [0], 3, 4)
            seen += length
            context, committed, positions = drafting.context(torch.arange(1), [0])
            read[window, seen] = context[0][0].shape[1]
            held = set(positions[committed].tolist())
            assert held == set(range(seen)) if window is None else set(range(seen - 5, seen)) <= held
            assert drafting.cache.host_len[0] == seen  # append-only: every element is kept
    assert read[None, 16] < read[None, 256] < read[None, 512]
    assert read[6, 16] == read[6, 256] == read[6, 512] <= 6 + 2 * 4


@pytest.fixture(scope="module")
def served(one_thread):
    """A tiny Llama target and options-on drafters trained on its own greedy text (P-EAGLE K = 4 and EAGLE-3)."""
    model = tiny_target("llama", seed=1)
    rows = self_distilled_rows(model, seed=1)
    options = dict(eh_proj=True, nope=True, sliding_window=16, moe_num_experts=4, moe_top_k=2,
                   efficient_lm_head_rank=8, efficient_lm_head_candidates=16)  # fmt: skip
    peagle = train_tiny_drafter(model, 4, rows, draft_vocab_size=56, **options)
    eagle3_drafter = train_tiny_drafter(model, 1, rows, **options)
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = greedy_reference(model, prompt, NEW_TOKENS)
        return cache[tuple(prompt)]

    return SimpleNamespace(model=model, peagle=peagle, eagle3=eagle3_drafter, reference=reference)


@pytest.mark.parametrize(("method", "mode"), list(OPTIONS))
def test_greedy_output_with_an_options_drafter_is_the_targets_greedy_output(served, method, mode):
    drafter = served.peagle if method == "peagle" else served.eagle3
    decoder = SpeculativeDecoder(served.model, drafter, mode, method=method, **OPTIONS[(method, mode)])
    out = decoder.generate(PROMPTS, NEW_TOKENS)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert tokens == served.reference(prompt)
    print(f"options drafter {method} {mode}: AL {out.metrics.acceptance_length:.2f}")
    assert out.metrics.acceptance_length > 1.5  # the options drafter really drafts


# ---------------------------------------------------------------------------------------------------------------------
# Exact distribution with an options-on drafter

SAMPLED_OPTIONS = dict(eh_proj=True, nope=True, sliding_window=2, moe_num_experts=3, moe_top_k=2,
                       efficient_lm_head_rank=4, efficient_lm_head_candidates=6)  # fmt: skip


@pytest.fixture(scope="module")
def sampled(one_thread):
    """The 12-token target of test_engine_sampling and options-on drafters (a window of 2 positions: it bites within
    the prompt and the 3 sampled tokens; the efficient head drafts from 6 of the 12 tokens, -inf for the others)."""
    from test_engine_sampling import VOCAB

    model = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3, logit_scale=0.1,
                        num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    rows = self_distilled_rows(model, sequences=8, length=32, seed=3)
    return SimpleNamespace(
        model=model,
        peagle=train_tiny_drafter(model, 3, rows, steps=30, seed=3, **SAMPLED_OPTIONS),
        eagle3=train_tiny_drafter(model, 1, rows, steps=30, seed=3, **SAMPLED_OPTIONS),
    )


@pytest.mark.parametrize(
    "case", ["peagle-chain-gumbel", "peagle-tree-gumbel", "eagle3-tree-gumbel", "peagle-tree-topk"]
)
def test_first_three_tokens_with_an_options_drafter_follow_the_exact_distribution(sampled, case):
    from test_engine_sampling import CASES, chi_square_pvalue, decoder_for, exact_joint, sample_counts

    method, mode, draft_sampling, temperature, top_k, top_p = CASES[case]
    decoder = decoder_for(sampled, method, mode, draft_sampling)
    counts = sample_counts(decoder, temperature, top_k, top_p)
    pvalue = chi_square_pvalue(counts, exact_joint(sampled.model, temperature, top_k, top_p))
    print(f"options drafter {case}: chi-square p-value {pvalue:.4f}")
    assert pvalue > 1e-3
