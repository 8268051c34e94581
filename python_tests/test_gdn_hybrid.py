"""A tiny Qwen3-Next-style hybrid target (random weights) verifies draft trees through the GDN tree ops: the logits at
every node equal running the Hugging Face model on the whole root-to-node sequence."""

from __future__ import annotations

import pytest
import torch

from peagle.decode import HybridTreeCache, hybrid_prefill, hybrid_tree_commit, hybrid_tree_forward
from peagle.ops.gdn import tree_path
from testkit import fresh_seed, random_tree

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        attn_implementation="eager",
    )
    torch.manual_seed(fresh_seed() % (2**31))
    m = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial gates and norms (the defaults are mostly ones)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
    return m


def full_sequence_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("kind", ["random", "chain", "deep"])
def test_tree_logits_equal_per_path_full_runs(model, kind):
    seed = fresh_seed()
    print(f"input seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 2, model.config.vocab_size
    prefix = torch.randint(0, vocab, (batch, 11), generator=gen)
    cache = HybridTreeCache.empty(model, batch)
    # The prefix goes through the same path as a chain, then is committed: this exercises commit as well.
    chain = torch.arange(prefix.shape[1]).expand(batch, -1) - 1
    hybrid_tree_forward(model, prefix, chain, cache)
    hybrid_tree_commit(cache, torch.full((batch,), prefix.shape[1] - 1))
    history = prefix.tolist()
    for nodes in (13, 7):
        parent = torch.stack([random_tree(gen, nodes, kind) for _ in range(batch)])
        ids = torch.randint(0, vocab, (batch, nodes), generator=gen)
        logits = hybrid_tree_forward(model, ids, parent, cache)
        for b in range(batch):
            for i in range(nodes):
                tokens = history[b] + ids[b, tree_path(parent[b], i)].tolist()
                expected = full_sequence_logits(model, tokens)
                torch.testing.assert_close(logits[b, i], expected, rtol=1e-4, atol=1e-4)
        # Accept a path of the same length in every request: the deepest node at the smallest maximum depth.
        depths = [[len(tree_path(parent[b], i)) for i in range(nodes)] for b in range(batch)]
        target = min(max(d) for d in depths)
        last = torch.tensor([d.index(target) for d in depths])
        hybrid_tree_commit(cache, last)
        for b in range(batch):
            history[b] += ids[b, tree_path(parent[b], int(last[b]))].tolist()
    assert cache.length == len(history[0])


def test_long_prompt_prefill_then_tree(model):
    seed = fresh_seed()
    print(f"input seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 150), generator=gen)
    cache = HybridTreeCache.empty(model, 1)
    last_logits = hybrid_prefill(model, prompt, cache, chunk=64)
    torch.testing.assert_close(last_logits[0], full_sequence_logits(model, prompt[0].tolist()), rtol=1e-4, atol=1e-4)
    parent = random_tree(gen, 9, "random").unsqueeze(0)
    ids = torch.randint(0, vocab, (1, 9), generator=gen)
    logits = hybrid_tree_forward(model, ids, parent, cache)
    for i in range(9):
        tokens = prompt[0].tolist() + ids[0, tree_path(parent[0], i)].tolist()
        torch.testing.assert_close(logits[0, i], full_sequence_logits(model, tokens), rtol=1e-4, atol=1e-4)
