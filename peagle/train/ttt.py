"""EAGLE-3 training-time test (TTT): the drafter unrolled over S autoregressive steps, a loss at every step.

A K = 1 drafter is served autoregressively: after its first draft it reads back its own hidden state and its own
drafted token (vLLM's eagle3 proposer, ``peagle.train.evaluate.chain_steps``). Trained on the first step only, it
never sees those inputs; TTT trains on them. The elements are COD's with S depths (step s = depth s: the nested chains
``cod_sample`` keeps, so ``--ratio``/``--max-anchors`` bound the unrolled work), run by
:meth:`peagle.model.PEagleDrafter.forward_unrolled`; step s's loss weight is ``step_weights[s]`` (e.g. decay^s).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from peagle.model import PEagleDrafter
from peagle.train.dataset import TrainRow
from peagle.train.step import element_weights, loss_step

__all__ = ["step_weights", "train_ttt_row"]


def step_weights(steps: int, decay: float) -> list[float]:
    """Loss weight of each unrolled step: ``decay ** s`` (speculators' ``ttt_step_loss_decay``)."""
    return [decay**s for s in range(steps)]


def train_ttt_row(
    model: PEagleDrafter,
    row: TrainRow,
    anchors: Tensor,
    depths: Tensor,
    target_lm_head: Tensor,
    draft_ids: Tensor,
    weights: Tensor,
    *,
    loss_kind: str = "kl",
    scale: float = 1.0,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Forward + backward of one row unrolled over ``weights.numel()`` steps (elements (a, s) with s < S, nested,
    grouped by step); the row's loss is the weighted mean over its valid elements (label a + s trained and in a's
    document), times ``scale``. Accumulates the loss and per-step accuracy into ``stats``."""
    if depths.numel() and int(depths.max()) >= weights.numel():
        raise ValueError(f"depths must be below the {weights.numel()} steps, got {int(depths.max())}")
    stats["elements"] += anchors.numel()
    weighed = element_weights(row, anchors, depths, weights)
    if weighed is None:
        return stats
    weight = weighed[1]
    keep = torch.nonzero(weight > 0).squeeze(1)
    run = partial(model.forward_unrolled, row.input_ids, row.hidden, anchors, depths, row.document_ids)
    loss_step(model, run, row, weight[keep], depths[keep], target_lm_head, draft_ids, rows=keep, loss_kind=loss_kind,
              scale=scale, stats=stats)  # fmt: skip
    return stats
