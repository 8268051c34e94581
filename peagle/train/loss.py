"""Distillation losses of drafter logits against the target's distribution (shared by every training path)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["OPTION_STATS", "distillation_loss", "element_loss", "new_stats", "record_stats", "weighted_kl"]

# Sums over a step of the drafter options' statistics (stats["options"]): MoE forwards, balance loss and imbalance,
# the low-rank head's KL and its recall hits over rows.
OPTION_STATS = ("moe_forwards", "moe_balance_loss", "moe_imbalance", "lm_head_kl", "lm_head_hits", "lm_head_rows")


def element_loss(logits: Tensor, target_logits: Tensor, kind: str) -> Tensor:
    """Per-element loss [n]: KL(target || draft) or cross-entropy to the target's argmax (both over the draft vocab)."""
    work = torch.promote_types(logits.dtype, torch.float32)
    logq = F.log_softmax(logits.to(work), dim=-1)
    if kind == "kl":
        logp = F.log_softmax(target_logits.to(work), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)
    if kind == "ce":
        return -logq.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    raise ValueError(f"loss must be 'kl' or 'ce', got {kind!r}")


class _WeightedKL(torch.autograd.Function):
    """sum_e w_e KL(p_{u(e)} || softmax(logits_e)) with the targets p stored once per distinct label row u.

    Elements of overlapping chains share label rows, so the target side is computed for the distinct rows only;
    the backward is the closed form w_e (softmax(logits_e) - p_{u(e)}).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, logp: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
        # KL_e = sum_v p (log p - z_v + lse_e) = -H_u - p_u . z_e + lse_e  (sum_v p = 1).
        # lse from the fused log-softmax (lse = z_0 - log q_0); the [n, V] log-softmax itself is not kept.
        lse = logits[:, 0] - F.log_softmax(logits, dim=-1)[:, 0]
        p = logp.exp()
        neg_entropy = (p * logp).sum(-1)
        p_e = p[inverse]
        dot = torch.einsum("nv,nv->n", p_e, logits)
        ctx.save_for_backward(logits, p_e, weight)
        return (weight * (neg_entropy[inverse] - dot + lse)).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, p_e, weight = ctx.saved_tensors
        g = torch.softmax(logits, dim=-1)
        g.sub_(p_e)
        g.mul_((grad * weight)[:, None])
        return g, None, None, None


def weighted_kl(logits: Tensor, target_logp: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
    """Weighted KL sum over elements; ``target_logp`` [U, V] log-probabilities, ``inverse`` [n] element -> row."""
    return _WeightedKL.apply(logits, target_logp, inverse, weight)


def distillation_loss(
    logits: Tensor,
    label_index: Tensor,
    weight: Tensor,
    target_hidden: Tensor,
    target_lm_head: Tensor,
    draft_ids: Tensor,
    kind: str,
) -> tuple[Tensor, Tensor]:
    """sum_e weight_e loss(logits_e, target distribution at ``label_index[e]``) and whether each element's argmax
    (a target id through ``draft_ids``) is the target's argmax [n] bool.

    The target logits are ``target_hidden[row] @ target_lm_head.T``, computed once per distinct label row
    (overlapping chains share them) and restricted to the draft vocabulary.
    """
    with torch.no_grad():
        rows, inverse = torch.unique(label_index, return_inverse=True)
        target = target_hidden[rows].to(target_lm_head.dtype) @ target_lm_head.T
        target_best = target.argmax(-1)[inverse]
        if draft_ids.numel() != target.shape[1]:
            target = target[:, draft_ids]
        correct = draft_ids[logits.argmax(-1)] == target_best
    if kind == "kl":
        loss = weighted_kl(logits, F.log_softmax(target, dim=-1), inverse, weight)
    else:
        loss = (element_loss(logits, target[inverse], kind) * weight).sum()
    return loss, correct


def new_stats(num_depths: int) -> dict[str, Any]:
    """Accumulators of a step: loss, elements run, correct / counted elements per depth, and the options' sums."""
    return {
        "loss": 0.0,
        "elements": 0,
        "correct": torch.zeros(num_depths, dtype=torch.float64),
        "count": torch.zeros(num_depths, dtype=torch.float64),
        "options": torch.zeros(len(OPTION_STATS), dtype=torch.float64),
    }


@torch.no_grad()
def record_stats(stats: dict[str, Any], loss: Tensor, correct: Tensor, depths: Tensor) -> None:
    """Adds a loss (already scaled) and the per-element hits ``correct`` [n] at ``depths`` [n] to ``stats``."""
    num_depths = stats["count"].numel()
    stats["loss"] += float(loss)
    stats["correct"] += torch.bincount(depths, weights=correct.double(), minlength=num_depths).cpu()
    stats["count"] += torch.bincount(depths, minlength=num_depths).cpu().double()
