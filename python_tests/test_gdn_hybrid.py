"""A tiny Qwen3-Next-style hybrid target (random weights) verifies draft trees through the target runner, whose GDN
layers run the GDN tree ops: the logits at every node equal running the Hugging Face model on the whole root-to-node
sequence, also after committing accepted paths of different lengths per request."""

from __future__ import annotations

import pytest
import torch

from peagle.decode import TargetRunner
from peagle.ops import ancestor_mask
from peagle.ops.gdn import tree_path
from testkit import fresh_seed, random_tree, tiny_target

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3_next", vocab_size=97, seed=fresh_seed() % 1000, successor=False)


def full_sequence_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def tree_inputs(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = ancestor_mask(parent)
    return mask, mask.sum(-1) - 1


@pytest.mark.parametrize("kind", ["random", "chain", "deep"])
def test_tree_logits_equal_per_path_full_runs(model, kind):
    seed = fresh_seed()
    print(f"input seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 2, model.config.vocab_size
    runner = TargetRunner(model, block_size=8)
    runner.allocate(batch, 64)
    rows = torch.arange(batch)
    history = torch.randint(0, vocab, (batch, 11), generator=gen).tolist()
    runner.prefill(history)
    for nodes in (13, 7, 9):
        parent = torch.stack([random_tree(gen, nodes, kind) for _ in range(batch)])
        ids = torch.randint(0, vocab, (batch, nodes), generator=gen)
        mask, depth = tree_inputs(parent)
        final, _ = runner.forward(rows, [0, 1], ids, depth, mask, parent, torch.full((batch,), nodes))
        logits = runner.logits(final)
        for b in range(batch):
            for i in range(nodes):
                tokens = history[b] + ids[b, tree_path(parent[b], i)].tolist()
                torch.testing.assert_close(logits[b, i], full_sequence_logits(model, tokens), rtol=1e-4, atol=1e-4)
        # Accept paths of different lengths: the deepest node in request 0, a random node in request 1.
        last = [int(depth[0].argmax()), int(torch.randint(0, nodes, (), generator=gen))]
        paths = [tree_path(parent[b], last[b]) for b in range(batch)]
        accepted = torch.full((batch, nodes), -1, dtype=torch.long)
        for b, path in enumerate(paths):
            accepted[b, : len(path)] = torch.tensor(path)
        num_accepted = [len(p) - 1 for p in paths]
        runner.commit(rows, [0, 1], accepted, torch.tensor(num_accepted), torch.tensor(last), num_accepted)
        for b in range(batch):
            history[b] += ids[b, paths[b]].tolist()
    assert runner.kv.host_len == [len(h) for h in history]


def test_long_prompt_prefill_then_tree(model):
    seed = fresh_seed()
    print(f"input seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (150, 70)]
    runner = TargetRunner(model, prefill_chunk=256)
    assert runner.prefill_chunk == 64  # the GDN kernels take at most 64 nodes per forward
    runner.allocate(2, 160)
    last, _ = runner.prefill(prompts)
    for b in range(2):
        torch.testing.assert_close(
            runner.logits(last[b]), full_sequence_logits(model, prompts[b]), rtol=1e-4, atol=1e-4
        )
    parent = torch.stack([random_tree(gen, 9, "random") for _ in range(2)])
    ids = torch.randint(0, vocab, (2, 9), generator=gen)
    mask, depth = tree_inputs(parent)
    final, _ = runner.forward(torch.arange(2), [0, 1], ids, depth, mask, parent, torch.tensor([9, 9]))
    logits = runner.logits(final)
    for b in range(2):
        for i in range(9):
            tokens = prompts[b] + ids[b, tree_path(parent[b], i)].tolist()
            torch.testing.assert_close(logits[b, i], full_sequence_logits(model, tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="a hybrid target verifies at most 64 nodes per tree, got 65"):
        big = torch.zeros(2, 65, dtype=torch.long)
        runner.forward(
            torch.arange(2), [0, 1], big, big, torch.ones(2, 65, 65, dtype=torch.bool), big - 1, big[:, 0] + 1
        )
