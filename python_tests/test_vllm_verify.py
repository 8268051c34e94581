"""peagle.vllm.verify: vLLM's flattened speculative batch verified by peagle's tree kernels (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from peagle.vllm.verify import chain_batch, verify_chains
from testkit import fresh_seed


def vllm_greedy_semantics(drafts, counts, target_probs, bonus, max_spec_len):
    """vLLM's greedy rule, one request at a time: accept while draft == target argmax, then the argmax (or bonus)."""
    out = torch.full((len(counts), max_spec_len + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(counts):
        argmax = target_probs[start : start + n].argmax(-1)
        j = 0
        while j < n and int(drafts[start + j]) == int(argmax[j]):
            out[b, j] = int(drafts[start + j])
            j += 1
        out[b, j] = int(argmax[j]) if j < n else int(bonus[b])
        start += n
    return out


def random_batch(gen, counts, vocab, agree=0.7):
    total = sum(counts)
    target_probs = torch.softmax(torch.randn(total, vocab, generator=gen) * 3, -1)
    drafts = target_probs.argmax(-1)
    disagree = torch.rand(total, generator=gen) > agree
    drafts[disagree] = torch.randint(0, vocab, (int(disagree.sum()),), generator=gen)
    bonus = torch.randint(0, vocab, (len(counts), 1), generator=gen)
    return drafts, target_probs, bonus


@pytest.mark.parametrize("counts", [[3], [1, 4, 0, 2], [5, 5, 5], [0, 0]])
def test_greedy_matches_vllm_semantics(counts):
    gen = torch.Generator().manual_seed(fresh_seed())
    max_spec_len = max(max(counts), 1) + 1
    drafts, target_probs, bonus = random_batch(gen, counts, 50)
    got = verify_chains(drafts, counts, max_spec_len, target_probs, bonus, None)
    want = vllm_greedy_semantics(drafts, counts, target_probs, bonus, max_spec_len)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_all_accepted_emits_vllms_bonus_token_in_both_modes():
    gen = torch.Generator().manual_seed(fresh_seed())
    counts = [4, 2]
    drafts, target_probs, bonus = random_batch(gen, counts, 30, agree=1.0)
    target_probs = torch.nn.functional.one_hot(drafts, 30).float()  # every draft is certain under the target
    for is_greedy in (None, torch.tensor([False, True])):
        out = verify_chains(drafts, counts, 5, target_probs, bonus, is_greedy, seed=fresh_seed())
        assert out[0, :5].tolist() == [*drafts[:4].tolist(), int(bonus[0])]
        assert out[1, :3].tolist() == [*drafts[4:].tolist(), int(bonus[1])] and out[1, 3:].tolist() == [-1, -1, -1]


def test_sampled_rejection_resamples_without_the_rejected_draft():
    # Target puts no mass on the draft: it must be rejected and the correction drawn from the rest of the target.
    counts = [1] * 2000
    target_probs = torch.tensor([[0.0, 0.5, 0.25, 0.25]]).expand(2000, 4).contiguous()
    drafts = torch.zeros(2000, dtype=torch.long)
    bonus = torch.zeros(2000, 1, dtype=torch.long)
    out = verify_chains(drafts, counts, 1, target_probs, bonus, torch.zeros(2000, dtype=torch.bool), seed=fresh_seed())
    assert (out[:, 1] == -1).all()
    freq = torch.bincount(out[:, 0].long(), minlength=4).float() / 2000
    assert freq[0] == 0 and abs(freq[1] - 0.5) < 0.05 and abs(freq[2] - 0.25) < 0.05


def test_chain_batch_layout():
    drafts = torch.tensor([7, 8, 9])
    probs = torch.softmax(torch.randn(3, 10), -1)
    parent, tokens, num_nodes, tree_probs, tree_draft = chain_batch(drafts, [2, 1], 3, probs, torch.tensor([[4], [5]]))
    assert parent.tolist() == [[-1, 0, 1, 2]] * 2
    assert tokens[:, 1:3].tolist() == [[7, 8], [9, 0]] and num_nodes.tolist() == [3, 2]
    assert torch.equal(tree_probs[0, :2], probs[:2]) and torch.equal(tree_probs[1, 0], probs[2])
    assert tree_probs[0, 2, 4] == 1 and tree_probs[1, 1, 5] == 1 and tree_draft is None


def test_expand_batch_to_tokens_repeats_per_request_values():
    from peagle.vllm.verify import expand_batch_to_tokens

    temperature = torch.tensor([0.7, 0.0, 1.3])
    cumulative = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = expand_batch_to_tokens(temperature, cumulative, 5, replace_from=0, replace_to=1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3])
    out = expand_batch_to_tokens(temperature, torch.tensor([1, 3, 4]), 4, replace_from=0, replace_to=1)
    assert out.tolist() == pytest.approx([0.7, 1.0, 1.0, 1.3])


def test_a_step_without_drafts_emits_the_bonus_tokens_as_the_kernels_would(monkeypatch):
    """The plugin's rejection_sample answers a step in which no request has drafts (the harness skipped the pass)
    with vLLM's bonus tokens, without the kernels: the rows the kernels give such a batch, greedy or sampled."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from peagle.vllm import ENABLE_ENV, make_rejection_sample

    monkeypatch.setenv(ENABLE_ENV, "1")
    calls = []
    sample = make_rejection_sample(lambda *args: calls.append(args))
    gen = torch.Generator().manual_seed(fresh_seed())
    vocab = 40
    for counts in ([0, 0, 0], [2, 0, 3]):
        drafts, target_probs, bonus = random_batch(gen, counts, vocab)
        logits = target_probs.log()
        max_spec_len = max(counts)
        for greedy in (True, False):
            metadata = SimpleNamespace(all_greedy=greedy, all_random=not greedy, generators={},
                                       temperature=torch.full((len(counts),), 1.0))  # fmt: skip
            got = sample(drafts, counts, max_spec_len, None, None, logits, bonus, metadata)
            want = verify_chains(drafts, counts, max_spec_len, logits.softmax(-1), bonus, None if greedy else
                                 torch.zeros(len(counts), dtype=torch.bool), all_random=not greedy)  # fmt: skip
            if max_spec_len == 0:
                assert torch.equal(got, want) and got.tolist() == bonus.tolist()
            else:  # power: a batch with drafts goes through the kernels (greedy rows are deterministic)
                assert got.shape == want.shape and (not greedy or torch.equal(got, want))
    assert calls == []  # vLLM's own sampler is never asked
