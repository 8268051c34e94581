"""EAGLE-3 training-time test: the unrolled training forward equals autoregressive serving step by step (the path of
``peagle eval --autoregressive``), and its loss's gradients equal autograd through that serving path."""

from __future__ import annotations

import pytest
import torch

from peagle.model import DrafterConfig, PEagleDrafter
from peagle.ops import cod_sample
from peagle.train.dataset import TrainRow
from peagle.train.evaluate import chain_steps
from peagle.train.loss import element_loss, new_stats
from peagle.train.ttt import step_weights, train_ttt_row
from testkit import random_packed_row

STEPS = 4
LENGTH = 96


def tiny_drafter(**overrides) -> PEagleDrafter:
    cfg = DrafterConfig(hidden_size=32, vocab_size=40, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=48, mask_token_id=39, num_depths=1, aux_layer_ids=[1, 2, 3],
                        **overrides)  # fmt: skip
    torch.manual_seed(0)
    model = PEagleDrafter(cfg).double()
    model.reset_parameters(std=0.3)  # weights large enough that the fed-back hidden states steer the drafts
    if cfg.uses_draft_vocab:
        model.set_draft_vocab(torch.arange(0, 40, 40 // cfg.draft_vocab_size)[: cfg.draft_vocab_size])
    return model


def random_row(seed: int) -> TrainRow:
    gen = torch.Generator().manual_seed(seed)
    packed = random_packed_row(gen, LENGTH, mean_document_length=30)
    return TrainRow(torch.randint(0, 39, (LENGTH,), generator=gen), torch.randn(LENGTH, 96, generator=gen).double(),
                    torch.randn(LENGTH, 32, generator=gen).double(), packed.document_ids, packed.loss_mask)  # fmt: skip


def ttt_elements(row: TrainRow, ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return cod_sample(row.loss_mask, row.document_ids, STEPS, ratio, min(ratio, 0.5), None, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"draft_vocab_size": 20, "norm_output": True},
        {"layer_style": "qwen3", "fc_norm": True},
        {"sliding_window": 5, "nope": True, "eh_proj": True},  # EAGLE-4 options (MoE and the low-rank head refused)
    ],
)
@pytest.mark.parametrize("ratio", [1.0, 0.6])
def test_every_unrolled_step_equals_autoregressive_serving(overrides, ratio):
    """Step s of forward_unrolled at anchor a == step s of chain_steps (the eval --autoregressive path) from a."""
    model = tiny_drafter(**overrides)
    row = random_row(1)
    anchors, depths = ttt_elements(row, ratio)
    assert int(depths.max()) == STEPS - 1  # every step is exercised
    with torch.no_grad():
        out = model.forward_unrolled(row.input_ids, row.hidden, anchors, depths, row.document_ids)
        chains = anchors[depths == 1]
        served = list(chain_steps(model, row.input_ids, row.hidden, row.document_ids, chains, STEPS))
    assert len(served) == STEPS
    torch.testing.assert_close(out.label_index, anchors + depths)
    real = row.document_ids[anchors] >= 0  # padding queries attend to nothing when served
    for step, (logits, _) in enumerate(served):
        rows = torch.nonzero((depths == step) & real).squeeze(1)
        if step == 0:
            reference = logits[anchors[rows]]
        else:
            reference = logits[torch.searchsorted(chains, anchors[rows])]
        assert rows.numel() > 0
        torch.testing.assert_close(out.logits[rows], reference, rtol=1e-9, atol=1e-9)


def test_unrolled_steps_feed_back_the_drafted_token_and_hidden_state():
    """The unroll is not the first step repeated: changing the drafter's step-0 view of a chain changes step 1."""
    model = tiny_drafter()
    row = random_row(2)
    anchors, depths = ttt_elements(row)
    with torch.no_grad():
        out = model.forward_unrolled(row.input_ids, row.hidden, anchors, depths, row.document_ids)
        first = depths == 0
        alone = model.forward_unrolled(row.input_ids, row.hidden, anchors[first], depths[first], row.document_ids)
    torch.testing.assert_close(out.logits[first], alone.logits)  # step 0 does not see later steps
    hidden = row.hidden.clone()
    a = int(anchors[depths == 1][0])
    hidden[a] += 1.0  # the target state at the chain's anchor: step 0's output there, hence step 1's inputs, change
    with torch.no_grad():
        moved = model.forward_unrolled(row.input_ids, hidden, anchors, depths, row.document_ids)
    step1 = torch.nonzero((depths == 1) & (anchors == a)).squeeze(1)
    assert not torch.allclose(moved.logits[step1], out.logits[step1])


def test_ttt_loss_gradients_equal_autograd_through_serving():
    """train_ttt_row (cached keys, dense rectangular masks, fused KL) == the weighted-mean KL of the served chains'
    logits, differentiated through chain_steps' full recomputation, in loss and every gradient (float64)."""
    model = tiny_drafter(draft_vocab_size=20)
    row = random_row(3)
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(9)).double()
    anchors, depths = ttt_elements(row, 0.7)
    weights = torch.tensor(step_weights(STEPS, 0.8), dtype=torch.float64)
    stats = train_ttt_row(model, row, anchors, depths, head, model.draft_ids(), weights, stats=new_stats(STEPS))
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    docs = row.document_ids
    chains = anchors[depths == 1]
    total, denominator, counts = 0.0, 0.0, []
    for step, (logits, _) in enumerate(chain_steps(model, row.input_ids, row.hidden, docs, chains, STEPS)):
        a = anchors[depths == step]
        logits = logits[a] if step == 0 else logits[torch.searchsorted(chains, a)]
        label = a + step
        w = (row.loss_mask[label] & (docs[a] >= 0) & (docs[label] == docs[a])).double() * weights[step]
        target = (row.target_hidden[label] @ head.T)[:, model.draft_ids()]
        total = total + (element_loss(logits, target, "kl") * w).sum()
        denominator += float(w.sum())
        counts.append(float((w > 0).sum()))
    loss = total / denominator
    loss.backward()
    assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-9)
    assert stats["count"].tolist() == counts and min(counts) > 0  # every step carries loss, counted per step
    for name, param in model.named_parameters():
        if param.grad is None:
            assert name not in ours or not ours[name].any(), name
            continue
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-7, atol=1e-10, msg=name)
    assert ours["fc.weight"].abs().sum() > 0 and ours["layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_bad_elements_are_named():
    model = tiny_drafter()
    row = random_row(4)
    anchors, depths = ttt_elements(row)
    with pytest.raises(ValueError, match="ascending"):
        model.forward_unrolled(row.input_ids, row.hidden, anchors.flip(0), depths.flip(0), row.document_ids)
    orphan = int(anchors[depths == 1][0])
    keep = ~((depths == 0) & (anchors == orphan))  # (orphan, 1) without (orphan, 0)
    with pytest.raises(ValueError, match="nested"):
        model.forward_unrolled(row.input_ids, row.hidden, anchors[keep], depths[keep], row.document_ids)
