"""Training the EAGLE-4 drafter options: the MoE load-balancing loss and the efficient LM head's KL enter exactly the
parameters they should, the trainer logs their metrics, and a trained options drafter is a loadable checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import read_metrics, work  # noqa: F401 (a module fixture of the tiny target)

from peagle.model import DrafterConfig, PEagleDrafter, from_pretrained
from peagle.ops import cod_sample
from peagle.train.dataset import TrainRow
from peagle.train.trainer import OPTION_STATS, TrainArgs, Trainer, new_stats, train_row
from testkit import random_packed_row

pytestmark = pytest.mark.usefixtures("one_thread")


def _row_gradients(moe_balance_weight: float, lm_head_kl_weight: float) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(7)
    cfg = DrafterConfig(hidden_size=32, vocab_size=40, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=24, mask_token_id=39, num_depths=3, aux_layer_ids=[1, 2, 3], eh_proj=True,
                        sliding_window=6, moe_num_experts=3, moe_top_k=2, efficient_lm_head_rank=4,
                        efficient_lm_head_candidates=5)  # fmt: skip
    torch.manual_seed(0)
    model = PEagleDrafter(cfg).double().train()
    length = 96
    packed = random_packed_row(gen, length, mean_document_length=30)
    row = TrainRow(torch.randint(0, 39, (length,), generator=gen), torch.randn(length, 96, generator=gen).double(),
                   torch.randn(length, 32, generator=gen).double(), packed.document_ids, packed.loss_mask)  # fmt: skip
    head = torch.randn(40, 32, generator=gen).double()
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 3, 0.8, 0.3, None, 1)
    stats = train_row(model, row, anchors, depths, head, model.draft_ids(), torch.ones(3, dtype=torch.float64),
                      moe_balance_weight=moe_balance_weight, lm_head_kl_weight=lm_head_kl_weight)  # fmt: skip
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def test_option_losses_reach_exactly_their_parameters():
    """The balance loss moves the routers (and what feeds them), never what lies after the last router (the expert
    loads are counts); the low-rank head's KL moves only D and U (it reads detached final states): the trunk's
    gradients are those of the drafting loss alone."""
    plain, stats = _row_gradients(0.0, 0.0)
    balanced, _ = _row_gradients(0.5, 0.0)
    distilled, _ = _row_gradients(0.0, 1.0)
    after_routers = ("layers.1.mlp.experts.", "layers.1.post_mlp_layernorm.", "norm.", "lm_head.")
    for name, grad in plain.items():
        low_rank = name.startswith(("lm_head_down", "lm_head_up"))
        if name.endswith("mlp.gate.weight"):
            assert not torch.equal(balanced[name], grad), name
        if name.startswith(after_routers) or low_rank:
            assert torch.equal(balanced[name], grad), name
        assert torch.equal(distilled[name], grad) != low_rank, name
        if low_rank:
            assert not grad.any(), name
    acc = dict(zip(OPTION_STATS, stats["options"].tolist(), strict=True))
    assert acc["moe_forwards"] >= 1 and acc["moe_imbalance"] / acc["moe_forwards"] >= 1.0
    assert acc["lm_head_kl"] > 0 and 0 <= acc["lm_head_hits"] <= acc["lm_head_rows"] > 0


def test_new_stats_has_a_slot_per_option_metric():
    assert new_stats(2)["options"].shape == (len(OPTION_STATS),)


def test_trainer_with_every_option_logs_and_saves_them(work, tmp_path):  # noqa: F811 (the fixture)
    args = TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / "run"), num_layers=1, num_depths=3, steps=12,
                     lr=3e-3, progress=False, eh_proj=True, nope=True, sliding_window=16, moe_num_experts=4,
                     moe_top_k=2, efficient_lm_head_rank=8, efficient_lm_head_candidates=16)  # fmt: skip
    Trainer(args).run()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 12
    for record in metrics:
        assert record["moe_imbalance"] >= 1.0 and record["moe_balance_loss"] > 0
        assert 0.0 <= record["lm_head_recall"] <= 1.0 and record["lm_head_kl"] >= 0
    # The low-rank head learns the full head's distribution.
    first = sum(r["lm_head_kl"] for r in metrics[:3])
    last = sum(r["lm_head_kl"] for r in metrics[-3:])
    assert last < first
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["peagle_drafter_options"] == {
        "eh_proj": True,
        "nope": True,
        "sliding_window": 16,
        "moe": {"num_experts": 4, "top_k": 2},
        "efficient_lm_head": {"rank": 8, "num_candidates": 16},
    }
    assert from_pretrained(tmp_path / "run" / "final").config.moe_num_experts == 4


def test_option_settings_out_of_range_are_named(tmp_path):
    for changes, flag in [
        (dict(sliding_window=0), "--sliding-window"),
        (dict(moe_num_experts=2, moe_top_k=3), "--moe-top-k"),
        (dict(moe_balance_weight=-1.0), "--moe-balance-weight"),
        (dict(efficient_lm_head_rank=-1), "--lm-head-rank"),
        (dict(efficient_lm_head_candidates=0), "--lm-head-candidates"),
    ]:
        with pytest.raises(ValueError, match=flag):
            TrainArgs(data="d", out=str(tmp_path / "o"), **changes).check()
