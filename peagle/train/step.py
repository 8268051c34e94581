"""The loss step every training path shares: which elements carry loss and how much, then one forward's distillation
loss, the options' extra losses, the backward and the step statistics.

:func:`peagle.train.trainer.train_row` (P-EAGLE, segment by segment) and :func:`peagle.train.ttt.train_ttt_row`
(EAGLE-3 unrolled) differ only in which forward they run and which elements they give it; both weigh elements with
:func:`element_weights` and score a forward with :func:`loss_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from peagle.model import DraftOutput, PEagleDrafter
from peagle.train.dataset import TrainRow
from peagle.train.loss import distillation_loss, element_loss, record_stats

__all__ = ["element_weights", "loss_step", "option_losses"]


def element_weights(
    row: TrainRow, anchors: Tensor, depths: Tensor, depth_weights: Tensor, row_index: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """(valid [n], weight [n]) of elements (anchor, depth): valid when label a + d is trained and in a's document;
    weight is the depth's weight over its row's sum of them, so a row's loss is its weighted mean. ``row_index`` [T]
    names the row of each index of rows packed side by side (default: one row). None when no element carries loss."""
    label = anchors + depths
    docs = row.document_ids
    valid = row.loss_mask[label] & (docs[anchors] >= 0) & (docs[label] == docs[anchors])
    weight = valid.float() * depth_weights[depths]
    groups = row_index[anchors] if row_index is not None else torch.zeros_like(anchors)
    sums = torch.zeros(int(groups.max()) + 1 if groups.numel() else 1, dtype=weight.dtype, device=weight.device)
    sums.index_add_(0, groups, weight)
    if not bool((sums > 0).any()):
        return None
    return valid, weight / torch.where(sums > 0, sums, 1)[groups]


def option_losses(
    model: PEagleDrafter, out: DraftOutput, weight: Tensor, stats: dict[str, Any], **weights: float
) -> Tensor:
    """The options' extra training loss of one forward (scaled like the row's loss), their statistics into
    ``stats["options"]``: the MoE load-balancing loss (``moe_balance_weight``) and KL(full head || low-rank head)
    over the loss-carrying elements (``lm_head_kl_weight``), with the low-rank head's recall (the full head's top-1
    among its C candidates)."""
    extra = out.logits.new_zeros(())
    acc = stats["options"]
    balance = model.moe_balance()
    if balance is not None:
        extra = extra + weights["moe_balance_weight"] * balance[0] * float(weight.sum())
        acc[:3] += torch.tensor([1.0, balance[0].item(), balance[1].item()], dtype=torch.float64)
    if out.low_rank_logits is not None:
        full = out.logits.detach()
        kl = (element_loss(out.low_rank_logits, full, "kl") * weight).sum()
        extra = extra + weights["lm_head_kl_weight"] * kl
        with torch.no_grad():
            candidates = out.low_rank_logits.topk(model.config.efficient_lm_head_candidates, dim=-1).indices
            hits = (candidates == full.argmax(-1, keepdim=True)).any(-1)
        acc[3:] += torch.tensor([kl.item(), hits.sum().item(), hits.numel()], dtype=torch.float64)
    return extra


def loss_step(
    model: PEagleDrafter,
    forward: Callable[[], DraftOutput],
    row: TrainRow,
    weight: Tensor,
    depths: Tensor,
    target_lm_head: Tensor,
    draft_ids: Tensor,
    *,
    rows: Tensor | None = None,
    loss_kind: str = "kl",
    scale: float = 1.0,
    stats: dict[str, Any],
    backward: bool = True,
    moe_balance_weight: float = 0.0,
    lm_head_kl_weight: float = 1.0,
) -> None:
    """One forward's loss: runs ``forward()`` (bf16 autocast on CUDA), scores its logits (promoted to at least
    float32) against the target's distribution with element weights ``weight`` [n] at ``depths`` [n], adds the
    options' losses, back-propagates ``scale`` times the sum (unless ``backward=False``) and records the loss and
    per-depth hits in ``stats``. ``rows`` picks the n scored elements from the forward's output (default: all)."""
    device = row.input_ids.device
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        out = forward()
    if rows is not None:
        low_rank = out.low_rank_logits[rows] if out.low_rank_logits is not None else None
        out = out._replace(logits=out.logits[rows], label_index=out.label_index[rows], low_rank_logits=low_rank)
    logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
    loss, correct = distillation_loss(
        logits, out.label_index, weight, row.target_hidden, target_lm_head, draft_ids, loss_kind
    )
    weights = dict(moe_balance_weight=moe_balance_weight, lm_head_kl_weight=lm_head_kl_weight)
    extra = option_losses(model, out._replace(logits=logits), weight, stats, **weights)
    if backward:
        ((loss + extra) * scale).backward()
    record_stats(stats, loss * scale, correct, depths)
