"""The drafter's GPU training path: flex attention + BlockMask (forward and backward) == document-blocked SDPA, on CUDA,
and a bf16-autocast training row runs. Skips without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from peagle.model import DrafterConfig, PEagleDrafter
from peagle.ops import cod_sample
from peagle.train.dataset import TrainRow
from peagle.train.trainer import train_row
from testkit import fresh_seed, random_packed_row

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def setup(seed: int, length: int = 1024):
    gen = torch.Generator().manual_seed(seed)
    cfg = DrafterConfig(hidden_size=128, vocab_size=512, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                        intermediate_size=256, mask_token_id=511, num_depths=6, aux_layer_ids=[1, 2, 3])  # fmt: skip
    torch.manual_seed(seed)
    model = PEagleDrafter(cfg).cuda()
    packed = random_packed_row(gen, length, mean_document_length=length / 6)
    row = TrainRow(
        torch.randint(0, 511, (length,), generator=gen),
        torch.randn(length, 384, generator=gen),
        torch.randn(length, 128, generator=gen),
        packed.document_ids,
        packed.loss_mask,
    )
    row = TrainRow(*(t.cuda() for t in row))
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 6, 0.7, 0.2, None, seed)
    head = torch.randn(512, 128, generator=gen).cuda() * 0.1
    return model, row, anchors, depths, head


def test_flex_equals_sdpa_forward_and_backward_cuda():
    seed = fresh_seed()
    print(f"input seed {seed}")
    grads = {}
    losses = {}
    for attention in ("sdpa", "flex"):
        model, row, anchors, depths, head = setup(seed)
        stats = train_row(model, row, anchors, depths, head, model.draft_ids(), torch.ones(6, device="cuda"),
                          attention=attention)  # fmt: skip
        losses[attention] = stats["loss"]
        grads[attention] = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=2e-2)
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["flex"][name], g, rtol=5e-2, atol=5e-3, msg=name)


def test_partitioned_flex_training_row_cuda():
    seed = fresh_seed()
    print(f"input seed {seed}")
    model, row, anchors, depths, head = setup(seed, 2048)
    whole = train_row(model, row, anchors, depths, head, model.draft_ids(), torch.ones(6, device="cuda"),
                      attention="flex")  # fmt: skip
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    parts = train_row(model, row, anchors, depths, head, model.draft_ids(), torch.ones(6, device="cuda"),
                      attention="flex", segments=4)  # fmt: skip
    assert parts["loss"] == pytest.approx(whole["loss"], rel=2e-2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g1[name], rtol=5e-2, atol=5e-3, msg=name)
