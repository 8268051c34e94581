"""harness_decide: the CPU op equals its PyTorch reference bit for bit on random inputs (padding, stopped requests,
ties, budgets at the node limit), its decisions follow the ratio rule of harness.h checked by brute force, opcheck,
and every argument check."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import HarnessState, calibration_scale, harness_decide, harness_decide_reference


def random_case(generator: torch.Generator, batch: int, frontier: int, max_nodes: int):
    scores = torch.rand(batch, frontier, generator=generator, dtype=torch.float64) ** 2
    scores[torch.rand(batch, frontier, generator=generator) < 0.2] = -torch.inf
    if frontier > 1:  # ties
        scores[:, 1] = scores[:, 0]
    calibration = torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 10
    widths = torch.tensor([1, 2, 3, 5, 8][: int(torch.randint(1, 6, (1,), generator=generator))])
    draft_cost = torch.rand(len(widths), generator=generator, dtype=torch.float64).sort().values * 0.01
    verify_cost = 0.02 + torch.rand(max_nodes + 1, generator=generator, dtype=torch.float64).cumsum(0) * 0.002
    state = HarnessState.start(batch, "cpu")
    state.expected.copy_(torch.rand(batch, generator=generator, dtype=torch.float64) * 3)
    state.draft_time.copy_(torch.rand(batch, generator=generator, dtype=torch.float64) * 0.01)
    state.num_nodes.copy_(torch.randint(1, max_nodes + 1, (batch,), generator=generator))
    state.stop.copy_((torch.rand(batch, generator=generator) < 0.2).int())
    return scores, calibration, widths, draft_cost, verify_cost, state


def clone(state: HarnessState) -> HarnessState:
    return HarnessState(*(t.clone() for t in state))


@pytest.mark.parametrize("batch,frontier,max_nodes", [(1, 1, 2), (3, 4, 6), (16, 12, 32), (64, 40, 60), (5, 0, 8)])
def test_op_equals_reference(generator, batch, frontier, max_nodes):
    for _ in range(20):
        scores, calib, widths, dcost, vcost, state = random_case(generator, batch, frontier, max_nodes)
        op_state, ref_state = clone(state), clone(state)
        harness_decide(scores, calib, widths, dcost, vcost, op_state)
        harness_decide_reference(scores, calib, widths, dcost, vcost, ref_state)
        for name, a, e in zip(HarnessState._fields, op_state, ref_state, strict=True):
            assert a.dtype == e.dtype and torch.equal(a, e), f"{name}:\n{a}\n{e}"


def brute_force(scores, calib, widths, dcost, vcost, state, b):
    """The rule of harness.h for request b with Python floats: the first width of largest ratio above the current."""
    if state.stop[b]:
        return 0
    scale = float(calibration_scale(calib)[b])
    ranked = sorted((p for p in scores[b].tolist() if p >= 0), reverse=True)
    e, t, n = float(state.expected[b]), float(state.draft_time[b]), int(state.num_nodes[b])
    best, choice = (1 + e) / (t + float(vcost[n])), 0
    for j, w in enumerate(widths.tolist()):
        if w > len(ranked) or n + w > len(vcost) - 1:
            break
        gain = sum(min(1.0, scale * p) for p in ranked[:w])
        ratio = (1 + e + gain) / (t + float(dcost[j]) + float(vcost[n + w]))
        if ratio > best * (1 + 1e-12):
            best, choice = ratio, w
    return choice


def test_decisions_follow_the_ratio_rule(generator):
    for _ in range(30):
        scores, calib, widths, dcost, vcost, state = random_case(generator, 8, 10, 24)
        before = clone(state)
        harness_decide(scores, calib, widths, dcost, vcost, state)
        for b in range(8):
            assert int(state.width[b]) == brute_force(scores, calib, widths, dcost, vcost, before, b)
            assert int(state.stop[b]) == int(state.width[b] == 0)
            assert int(state.num_nodes[b]) == int(before.num_nodes[b]) + int(state.width[b])
        assert int(state.go[0]) == int(bool((state.stop == 0).any()))


def test_stops_when_verify_cost_rises_faster_than_acceptance():
    """A confident candidate pays for a cheap verify step; the same candidate does not when each node costs a lot."""
    scores = torch.tensor([[0.9, 0.5, -torch.inf]], dtype=torch.float64)
    calib = torch.zeros(1, 2, dtype=torch.float64)
    widths, dcost = torch.tensor([1, 2]), torch.tensor([0.001, 0.0015], dtype=torch.float64)
    flat = torch.full((9,), 0.02, dtype=torch.float64)
    state = HarnessState.start(1, "cpu")
    harness_decide(scores, calib, widths, dcost, flat, state)
    assert state.width.tolist() == [2] and state.go.tolist() == [1]
    steep = 0.02 * torch.arange(9, dtype=torch.float64)  # every node doubles the verify cost of the root
    state = HarnessState.start(1, "cpu")
    harness_decide(scores, calib, widths, dcost, steep, state)
    assert state.width.tolist() == [0] and state.stop.tolist() == [1] and state.go.tolist() == [0]


def test_opcheck(generator):
    scores, calib, widths, dcost, vcost, state = random_case(generator, 4, 6, 10)
    torch.library.opcheck(torch.ops.peagle.harness_decide, (scores, calib, widths, dcost, vcost, *state))


def test_argument_errors(generator):
    scores, calib, widths, dcost, vcost, state = random_case(generator, 2, 3, 5)

    def call(**replace):
        args = dict(frontier_scores=scores, calibration=calib, widths=widths, draft_cost=dcost, verify_cost=vcost) | {
            k: v
            for k, v in replace.items()
            if k in {"frontier_scores", "calibration", "widths", "draft_cost", "verify_cost"}
        }
        fields = state._replace(**{k: v for k, v in replace.items() if k in HarnessState._fields})
        harness_decide(*args.values(), fields)

    cases = [
        (dict(frontier_scores=scores.float()), "frontier_scores must be Double"),
        (dict(frontier_scores=scores[0]), r"frontier_scores must be 2-D \[B, F\]"),
        (dict(calibration=calib[:1]), r"calibration must have shape \[B, 2\]"),
        (dict(widths=widths.int()), "widths must be Long"),
        (dict(widths=widths[:0], draft_cost=dcost[:0]), "widths must hold at least one width"),
        (dict(draft_cost=dcost[:-1] if len(dcost) > 1 else dcost.repeat(2)), r"draft_cost must have shape \[W\]"),
        (dict(verify_cost=vcost[:1]), r"verify_cost must cover at least 1 node"),
        (dict(width=state.width.long()), "width must be Int"),
        (dict(go=state.go.repeat(2)), r"go must have shape \[1\]"),
        (dict(stop=torch.zeros(4, 2, dtype=torch.int32)[:, 0]), "stop must have shape"),
        (dict(frontier_scores=scores.clone().fill_(1.5)), r"frontier_scores must be -inf \(padding\) or in \[0, 1\]"),
        (dict(frontier_scores=scores.clone().fill_(float("nan"))), "frontier_scores must be -inf"),
        (dict(calibration=-torch.ones_like(calib)), "calibration must be finite and >= 0"),
        (dict(widths=torch.tensor([2, 2]), draft_cost=torch.zeros(2, dtype=torch.float64)), "strictly ascending"),
        (dict(draft_cost=torch.full_like(dcost, float("inf"))), "draft_cost must be finite and >= 0"),
        (dict(verify_cost=torch.full_like(vcost, -1.0)), "verify_cost must be finite and >= 0"),
        (dict(num_nodes=torch.full_like(state.num_nodes, 6)), r"num_nodes must be in \[1, M\] = \[1, 5\]"),
    ]
    for replace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call(**replace)
    noncontig = torch.zeros(2, 2, dtype=torch.float64)[:, 0]
    with pytest.raises(RuntimeError, match="expected must be contiguous"):
        call(expected=noncontig)
