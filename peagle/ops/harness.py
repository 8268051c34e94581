"""The harness's per-depth decision (:func:`harness_decide`): how many of the candidate nodes a request drafts at the
next depth, and whether it stops, from calibrated path scores and the cost table (math: ``csrc/include/peagle/
harness.h``; the policy around it: :mod:`peagle.decode.harness.policy`).

The op writes into preallocated tensors (no outputs), so a CUDA graph can capture it and a device-side runner can read
``go`` without the host. :func:`harness_decide_reference` is the executable spec in PyTorch, operation for operation
the same float64 arithmetic, so its results equal the kernels' bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CALIBRATION_PRIOR",
    "CALIBRATION_SCALE_RANGE",
    "HarnessState",
    "calibration_scale",
    "harness_decide",
    "harness_decide_reference",
]

# Constants of csrc/include/peagle/harness.h (kPrior, kMinScale, kMaxScale).
CALIBRATION_PRIOR = 2.0
CALIBRATION_SCALE_RANGE = (0.125, 4.0)


class HarnessState(NamedTuple):
    """The tensors harness_decide updates in place ([B] each; ``go`` [1])."""

    expected: Tensor  # float64: expected accepted drafts of the nodes drafted so far
    draft_time: Tensor  # float64: drafting seconds so far this round
    num_nodes: Tensor  # int64: nodes drafted so far, root included
    width: Tensor  # int32: nodes added at the last decided depth
    stop: Tensor  # int32: 1 once a request stopped drafting this round
    go: Tensor  # int32 [1]: 1 while some request drafts on

    @classmethod
    def start(cls, batch: int, device: torch.device | str, draft_time: Tensor | float = 0.0) -> HarnessState:
        """The state at a round's start: the root alone (1 node, nothing expected), ``draft_time`` already spent."""
        f64 = dict(dtype=torch.float64, device=device)
        spent = torch.as_tensor(draft_time, **f64).expand(batch).clone()
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            torch.zeros(batch, **f64),
            spent,
            torch.ones(batch, dtype=torch.long, device=device),
            torch.zeros(batch, **i32),
            torch.zeros(batch, **i32),
            torch.ones(1, **i32),
        )


def harness_decide(
    frontier_scores: Tensor,
    calibration: Tensor,
    widths: Tensor,
    draft_cost: Tensor,
    verify_cost: Tensor,
    state: HarnessState,
) -> None:
    """Decides the next depth's width of every request and updates ``state`` in place.

    Args:
        frontier_scores: [B, F] float64 path scores of the candidates (-inf = padding), in any order.
        calibration: [B, 2] float64 decayed sums (observed accepted drafts, predicted accepted drafts).
        widths: [W] int64 the widths the cost table has, ascending, >= 1.
        draft_cost: [W] float64 seconds of this depth's drafter forward at each width.
        verify_cost: [M + 1] float64 target verify seconds for n tree nodes (index n, root included).
        state: the running state; requests with ``stop`` set keep width 0.
    """
    torch.ops.peagle.harness_decide(frontier_scores, calibration, widths, draft_cost, verify_cost, *state)


@torch.library.register_fake("peagle::harness_decide")
def _harness_decide_fake(
    frontier_scores, calibration, widths, draft_cost, verify_cost, expected, draft_time, num_nodes, width, stop, go
):
    return None


def calibration_scale(calibration: Tensor) -> Tensor:
    """(2) of harness.h: clamp((observed + prior) / (predicted + prior)) per request, from [B, 2] sums."""
    low, high = CALIBRATION_SCALE_RANGE
    scale = (calibration[:, 0] + CALIBRATION_PRIOR) / (calibration[:, 1] + CALIBRATION_PRIOR)
    return scale.clamp(low, high)


def harness_decide_reference(
    frontier_scores: Tensor,
    calibration: Tensor,
    widths: Tensor,
    draft_cost: Tensor,
    verify_cost: Tensor,
    state: HarnessState,
) -> None:
    """Reference of :func:`harness_decide` (no input validation), vectorised over requests and widths."""
    batch, frontier = frontier_scores.shape
    max_nodes = verify_cost.shape[0] - 1
    live = state.stop == 0
    scale = calibration_scale(calibration.double())
    valid = frontier_scores >= 0
    ordered = torch.sort(torch.where(valid, frontier_scores, -1.0), dim=1, descending=True, stable=True).values
    contrib = torch.clamp(scale[:, None] * ordered, max=1.0)
    sums = torch.cumsum(torch.where(ordered >= 0, contrib, 0.0), dim=1)  # S_w at column w - 1
    nodes, w = state.num_nodes, widths.long()
    count = valid.sum(1)
    feasible = (w[None, :] <= count[:, None]) & (nodes[:, None] + w[None, :] <= max_nodes) & (nodes[:, None] >= 1)
    column = (w - 1).clamp(0, max(frontier - 1, 0)).expand(batch, -1)
    s_w = sums.gather(1, column) if frontier else torch.zeros_like(column, dtype=torch.float64)
    e = state.expected[:, None] + s_w
    t = state.draft_time[:, None] + draft_cost[None, :]
    v = verify_cost[(nodes[:, None] + w[None, :]).clamp(0, max_nodes)]
    ratio = torch.where(feasible, (1.0 + e) / (t + v), -torch.inf)
    current = (1.0 + state.expected) / (state.draft_time + verify_cost[nodes.clamp(0, max_nodes)])
    best = ratio.argmax(1) if len(widths) else torch.zeros(batch, dtype=torch.long)
    pick = lambda x: x.gather(1, best[:, None])[:, 0]  # noqa: E731
    chosen = live & (pick(ratio) > current) & (nodes <= max_nodes)
    state.width.copy_(torch.where(chosen, w[best], 0).int())
    state.stop.copy_(torch.where(chosen, 0, 1).int())
    state.expected.copy_(torch.where(chosen, pick(e), state.expected))
    state.draft_time.copy_(torch.where(chosen, pick(t), state.draft_time))
    state.num_nodes.copy_(torch.where(chosen, nodes + w[best], nodes))
    state.go.fill_(int(bool(chosen.any())))
