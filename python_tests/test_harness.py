"""harness_decide and harness_pass_decide: the CPU ops equal their PyTorch references bit for bit on random inputs
(padding, stopped requests, ties, budgets at the node limit, chains and trees, shallower / same / deeper next depths),
their decisions follow the ratio rules of harness.h checked by brute force, opcheck, and every argument check.
harness_observe: the CPU op equals its reference and (6) of harness.h in Python floats bit for bit (every row, rows
in random order, no rows, both clamps); a swapped sharpness ratio fails the same comparison; opcheck; argument
checks. harness_edge_scores and harness_edge_observe: the CPU ops equal their references and (7) / (8) of harness.h in
Python floats bit for bit (chains and trees, padding, ties, empty and full kinds, every row, rows in random order, no
rows); second children counted as first fail the same comparison; opcheck; argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.decode.harness.budget import CALIBRATION_DECAY, SHARPNESS_RANGE
from peagle.decode.harness.calibration import EDGE_DECAY
from peagle.decode.harness.pass_harness import PATH_SCALE_DECAY
from peagle.ops import (
    HarnessState,
    calibration_scale,
    harness_decide,
    harness_decide_reference,
    harness_edge_observe,
    harness_edge_observe_reference,
    harness_edge_scores,
    harness_edge_scores_reference,
    harness_observe,
    harness_observe_reference,
    harness_pass_decide,
    harness_pass_decide_reference,
)
from testkit import EdgeCase, random_edge_case, random_observe_case, random_pass_case


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


@pytest.mark.parametrize("batch,max_nodes", [(1, 2), (4, 6), (16, 32), (64, 60)])
def test_pass_op_equals_reference(generator, batch, max_nodes):
    outcomes = set()  # next depth shallower (-1) / same (0) / deeper (1) than the pass: the cases compared
    for _ in range(40):
        args = random_pass_case(generator, batch, max_nodes)
        got = harness_pass_decide(*args)
        want = harness_pass_decide_reference(*args)
        for name, a, e in zip(("budget", "next_depth", "predicted"), got, want, strict=True):
            assert a.dtype == e.dtype and torch.equal(a, e), f"{name}:\n{a}\n{e}"
        outcomes.update((got[1] - args[-1]).clamp(-1, 1).tolist())
    if max_nodes > 2:
        assert {-1, 1} <= outcomes


def pass_brute_force(scores, depth, num_nodes, calibration, passes, verify, drafted, b):
    """(budget, best K') of request b by listing every K' and every n (the rule of (5) in harness.h)."""
    scale = float(calibration_scale(calibration)[b])
    nodes = [i for i in range(1, int(num_nodes[b])) if 1 <= int(depth[b, i]) <= drafted]
    table = {}
    for k in range(1, drafted + 1):
        ranked = sorted((float(scores[b, i]) for i in nodes if int(depth[b, i]) <= k), reverse=True)
        ranked = ranked[: len(verify) - 2]
        ratios = [
            (1 + sum(min(1.0, scale * p) for p in ranked[:n])) / (float(passes[k - 1]) + float(verify[n + 1]))
            for n in range(len(ranked) + 1)
        ]
        table[k] = ratios
    budget = 1 + max(range(len(table[drafted])), key=lambda n: (table[drafted][n], -n))
    best = max(range(1, drafted + 1), key=lambda k: (max(table[k]), -k))
    return budget, best


def test_pass_decisions_follow_the_ratio_rule(generator):
    for _ in range(30):
        args = random_pass_case(generator, 3, 24)
        budget, next_depth, _ = harness_pass_decide(*args)
        for b in range(3):
            want_budget, best = pass_brute_force(*args, b)
            assert int(budget[b]) == want_budget
            # + 1: the budget used the deepest depth (grow); never below the drafted depth - 1
            drafted = args[-1]
            assert int(next_depth[b]) in (max(best, drafted - 1), best + 1)
            if best < drafted - 1:
                assert int(next_depth[b]) == drafted - 1


def test_pass_opcheck(generator):
    torch.library.opcheck(torch.ops.peagle.harness_pass_decide, random_pass_case(generator, 4, 10))


def test_pass_argument_errors(generator):
    scores, depth, num_nodes, calibration, passes, verify, drafted = random_pass_case(generator, 2, 8)
    base = dict(
        scores=scores, depth=depth, num_nodes=num_nodes, calibration=calibration, pass_time=passes,
        verify_cost=verify, drafted_depth=drafted,
    )  # fmt: skip
    bad_depth = depth.clone()
    bad_depth[:, 1] = drafted + 1
    cases = [
        (dict(scores=scores.float()), "scores must be Double"),
        (dict(scores=scores[0]), r"scores must be 2-D \[B, N\]"),
        (dict(depth=depth.int()), "depth must be Long"),
        (dict(num_nodes=num_nodes[:1]), r"num_nodes must have shape \[B\]"),
        (dict(calibration=calibration[:1]), r"calibration must have shape \[B, 2\]"),
        (dict(pass_time=torch.zeros(33, dtype=torch.float64)), "pass_time must hold 1 to 32 pass depths"),
        (dict(verify_cost=verify[:1]), "verify_cost must cover at least 1 node"),
        (dict(drafted_depth=len(passes) + 1), r"drafted_depth must be in \[1, "),
        (dict(drafted_depth=0), r"drafted_depth must be in \[1, "),
        (dict(num_nodes=torch.full_like(num_nodes, scores.shape[1] + 1)), r"num_nodes must be in \[1, N\]"),
        (dict(scores=scores.clone().fill_(1.5), num_nodes=torch.full_like(num_nodes, 2)), r"must be in \[0, 1\]"),
        (dict(depth=bad_depth, num_nodes=torch.full_like(num_nodes, 2)), "depth of drafted nodes must be in"),
        (dict(calibration=-torch.ones_like(calibration)), "calibration must be finite and >= 0"),
        (dict(pass_time=torch.full_like(passes, float("nan"))), "pass_time must be finite and >= 0"),
        (dict(verify_cost=torch.full_like(verify, -1.0)), "verify_cost must be finite and >= 0"),
    ]
    for replace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            harness_pass_decide(**(base | replace))


# ---------------------------------------------------------------------------------------------------------------------
# harness_observe

OBSERVE_SETTINGS = [(CALIBRATION_DECAY, SHARPNESS_RANGE), (0.37, (0.3, 0.7))]  # the policy's, and narrow bounds


def observe_by_hand(calibration, gamma, predicted, accepted, rows, decay, gamma_range, swap_ratio=False) -> None:
    """(6) of harness.h row by row in Python floats (IEEE doubles, the same order of operations). ``swap_ratio`` turns
    the sharpness ratio upside down (observed over predicted): the mutant the comparison must catch."""
    low, high = gamma_range
    index = range(len(gamma)) if rows is None else rows.tolist()
    for r, b in enumerate(index):
        observed = float(calibration[b, 0]) * decay + float(accepted[r])
        expected = float(calibration[b, 1]) * decay + float(predicted[b])
        top, bottom = (observed, expected) if swap_ratio else (expected, observed)
        step = math.sqrt(min(max((top + 2.0) / (bottom + 2.0), 0.5), 2.0))
        calibration[b, 0], calibration[b, 1] = observed, expected
        gamma[b] = min(max(float(gamma[b]) * step, low), high)


def observe_mismatches(generator, observe, batch: int, rows: str, decay: float, gamma_range) -> tuple[int, list]:
    """Runs ``observe`` and the op on 20 fresh random cases; (cases whose calibration or gamma differ, the op's
    results as (rows updated, calibration, gamma before, gamma))."""
    mismatches, results = 0, []
    for dtype in (torch.int64, torch.int32) * 10:
        case = random_observe_case(generator, batch, rows, dtype, gamma_range)
        op_state, want_state = (case[0].clone(), case[1].clone()), (case[0].clone(), case[1].clone())
        harness_observe(*op_state, *case[2:], decay, gamma_range)
        observe(*want_state, *case[2:], decay, gamma_range)
        mismatches += not all(torch.equal(a, e) for a, e in zip(op_state, want_state, strict=True))
        updated = torch.arange(batch) if case[-1] is None else case[-1]
        results.append((updated, *op_state, case[1]))
    return mismatches, results


@pytest.mark.parametrize("decay,gamma_range", OBSERVE_SETTINGS)
@pytest.mark.parametrize(
    "batch,rows", [(1, "all"), (7, "all"), (64, "all"), (9, "subset"), (64, "subset"), (5, "none")]
)
def test_observe_op_equals_reference(generator, batch, rows, decay, gamma_range):
    for observe in (harness_observe_reference, observe_by_hand):
        mismatches, results = observe_mismatches(generator, observe, batch, rows, decay, gamma_range)
        assert mismatches == 0, observe.__name__
    # The cases reach both bounds of the ratio and of gamma (in the updated rows; the others are unchanged).
    updated = [(c[u], g[u]) for u, c, g, _ in results if len(u)]
    if sum(len(g) for _, g in updated) >= 100:  # a handful of rows may miss a bound by chance
        ratio = torch.cat([(c[:, 1] + 2.0) / (c[:, 0] + 2.0) for c, _ in updated])
        gamma = torch.cat([g for _, g in updated])
        assert (ratio < 0.5).any() and (ratio > 2.0).any() and (ratio > 0.5).any()
        assert (gamma == gamma_range[0]).any() and (gamma == gamma_range[1]).any()
    for u, _, g, before in results:
        untouched = torch.ones(batch, dtype=torch.bool)
        untouched[u] = False
        assert torch.equal(g[untouched], before[untouched])


def test_observe_comparison_has_power(generator):
    """The same comparison rejects the op's math with the sharpness ratio upside down."""
    swapped = lambda *args: observe_by_hand(*args, swap_ratio=True)  # noqa: E731
    mismatches, _ = observe_mismatches(generator, swapped, 16, "subset", *OBSERVE_SETTINGS[0])
    assert mismatches >= 15, mismatches


def test_observe_opcheck(generator):
    for rows in ("all", "subset"):
        calibration, gamma, predicted, accepted, index = random_observe_case(generator, 6, rows, torch.int64)
        args = (calibration, gamma, predicted, accepted, index, CALIBRATION_DECAY, *SHARPNESS_RANGE)
        torch.library.opcheck(torch.ops.peagle.harness_observe, args)


def test_observe_argument_errors(generator):
    calibration, gamma, predicted, _, _ = random_observe_case(generator, 4, "all", torch.int64)
    rows, accepted = torch.tensor([3, 1]), torch.tensor([2, 5])
    base = dict(calibration=calibration, gamma=gamma, predicted=predicted, accepted=accepted, rows=rows, decay=0.9,
                gamma_range=(0.02, 1.5))  # fmt: skip
    cases = [
        (dict(calibration=calibration.float()), "calibration must be Double"),
        (dict(calibration=calibration[:, 0]), r"calibration must be 2-D \[B, 2\]"),
        (dict(calibration=torch.zeros(4, 3, dtype=torch.float64)), r"calibration must have shape \[B, 2\]"),
        (dict(gamma=gamma.float()), "gamma must be Double"),
        (dict(gamma=gamma[:3]), r"gamma must have shape \[B\]"),
        (dict(gamma=torch.zeros(4, 2, dtype=torch.float64)[:, 0]), "gamma must be contiguous"),
        (dict(predicted=predicted.float()), "predicted must be Double"),
        (dict(predicted=predicted[:2]), r"predicted must have shape \[B\] \(per request\)"),
        (dict(accepted=accepted.double()), "accepted must be int32 or int64"),
        (dict(accepted=accepted[:1]), r"accepted must have shape \[R\] \(one per row\)"),
        (dict(rows=None), r"accepted must have shape \[B\] \(no rows\)"),
        (dict(rows=rows.int()), "rows must be Long"),
        (dict(rows=rows[None]), r"rows must be 1-D \[R\]"),
        (dict(rows=torch.tensor([0, 4])), r"rows must be in \[0, B\) = \[0, 4\), got 4 at 1"),
        (dict(rows=torch.tensor([-1, 2])), r"rows must be in \[0, B\) = \[0, 4\), got -1 at 0"),
        (dict(rows=torch.tensor([3, 3])), "rows must be distinct, got 3 twice"),
        (dict(decay=1.5), r"decay must be in \[0, 1\]"),
        (dict(decay=float("nan")), r"decay must be in \[0, 1\]"),
        (dict(gamma_range=(1.5, 0.02)), "gamma_min and gamma_max must be finite with 0 < gamma_min <= gamma_max"),
        (dict(gamma_range=(0.0, 1.5)), "gamma_min and gamma_max must be finite"),
        (dict(gamma_range=(0.02, math.inf)), "gamma_min and gamma_max must be finite"),
    ]
    before = calibration.clone(), gamma.clone()
    for replace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            harness_observe(**(base | replace))
    assert torch.equal(calibration, before[0]) and torch.equal(gamma, before[1])  # checked before any write


# ---------------------------------------------------------------------------------------------------------------------
# harness_edge_scores, harness_edge_observe


def edge_scores_by_hand(case: EdgeCase, later_means_rank: int = 1) -> tuple[list, list, list]:
    """(7) of harness.h in Python floats, tree by tree: a node's parent's siblings seen so far decide first / later
    (``later_means_rank`` 2 is the mutant the comparison must catch: second children counted as first)."""
    table, prior, thresholds = case.table.tolist(), case.prior.tolist(), case.thresholds.tolist()
    bins = len(thresholds) + 1
    out_path, out_q, out_kind = [], [], []
    for b in range(case.scores.shape[0]):
        scores, parent, count = case.scores[b].tolist(), case.parent[b].tolist(), int(case.num_nodes[b])
        nodes = len(scores)
        path, q, kind, children = [1.0] + [-1.0] * (nodes - 1), [0.0] * nodes, [-1] * nodes, {}
        for i in range(1, count):
            up = parent[i]
            rank = children.get(up, 0)
            children[up] = rank + 1
            edge = scores[i] / scores[up] if scores[up] > 0 else 0.0
            k = (1 if rank >= later_means_rank else 0) * bins + sum(t <= edge for t in thresholds)
            scale = (table[0][k] + prior[0][k]) / (table[1][k] + prior[1][k])
            path[i], q[i], kind[i] = path[up] * min(1.0, scale * edge), edge, k
        out_path.append(path)
        out_q.append(q)
        out_kind.append(kind)
    return out_path, out_q, out_kind


EDGE_SHAPES = [(1, "all"), (6, "all"), (64, "all"), (9, "subset")]


@pytest.mark.parametrize("batch,rows", EDGE_SHAPES)
def test_edge_scores_op_equals_reference_and_the_math_by_hand(generator, batch, rows):
    seen_kinds = set()
    for _ in range(20):
        case = random_edge_case(generator, batch, rows)
        args = case[:6]
        op, reference = harness_edge_scores(*args), harness_edge_scores_reference(*args)
        for name, a, e in zip(("path", "q", "kind"), op, reference, strict=True):
            assert a.dtype == e.dtype and torch.equal(a, e), f"{name}:\n{a}\n{e}"
        path, q, kind = op
        assert [path.tolist(), q.tolist(), kind.tolist()] == list(edge_scores_by_hand(case))
        # A node's value never exceeds its parent's (so the best n nodes by it keep their parents).
        real = kind >= 0
        above = path.gather(1, case.parent.clamp(min=0))
        assert bool((path[real] <= above[real]).all())
        seen_kinds |= set(kind[real].tolist())
    bins = case.thresholds.shape[0] + 1
    assert {k < bins for k in seen_kinds} == {True, False}  # first and later children both met


def test_edge_scores_comparison_has_power(generator):
    """The same comparison rejects second children counted as first children."""
    mismatches = 0
    for _ in range(20):
        case = random_edge_case(generator, 6)
        _, _, kind = harness_edge_scores(*case[:6])
        mismatches += kind.tolist() != edge_scores_by_hand(case, later_means_rank=2)[2]
    assert mismatches >= 5, mismatches


def edge_observe_by_hand(case: EdgeCase, q, kind, path, edge_decay: float, path_decay: float) -> tuple[list, list]:
    """(8) of harness.h in Python floats: the table decays, then each row's verified nodes whose parent is accepted
    count, in order; each row's request adds its accepted drafts and the sum of its nodes' path values."""
    table = [[x * edge_decay for x in row] for row in case.table.tolist()]
    calibration = case.calibration.tolist()
    for r in range(q.shape[0]):
        steps = case.accepted_path[r].tolist()[: int(case.num_accepted[r]) + 1]
        accepted = {s for s in steps if s >= 0}
        predicted = 0.0
        for i, k in enumerate(kind[r].tolist()):
            if k < 0:
                continue
            predicted += float(path[r, i])
            if int(case.parent[r, i]) in accepted:
                table[1][k] += float(q[r, i])
                table[0][k] += float(i in accepted)
        b = r if case.rows is None else int(case.rows[r])
        calibration[b][0] = calibration[b][0] * path_decay + int(case.num_accepted[r])
        calibration[b][1] = calibration[b][1] * path_decay + predicted
    return table, calibration


@pytest.mark.parametrize("batch,rows", [*EDGE_SHAPES, (5, "none")])
def test_edge_observe_op_equals_reference_and_the_math_by_hand(generator, batch, rows):
    for decay in ((EDGE_DECAY, PATH_SCALE_DECAY), (0.37, 1.0)):
        for _ in range(10):
            case = random_edge_case(generator, batch, rows)
            path, q, kind = harness_edge_scores(*case[:6])
            verified = (q, kind, path, case.parent, case.accepted_path, case.num_accepted, case.rows, *decay)
            op = case.table.clone(), case.calibration.clone()
            reference = case.table.clone(), case.calibration.clone()
            harness_edge_observe(*op, *verified)
            harness_edge_observe_reference(*reference, *verified)
            for name, a, e in zip(("table", "calibration"), op, reference, strict=True):
                assert torch.equal(a, e), f"{name}:\n{a}\n{e}"
            table, calibration = edge_observe_by_hand(case, q, kind, path, *decay)
            assert op[0].tolist() == table and op[1].tolist() == calibration
            updated = torch.zeros(batch, dtype=torch.bool)
            updated[torch.arange(batch) if case.rows is None else case.rows] = True
            assert torch.equal(op[1][~updated], case.calibration[~updated])  # other requests untouched


def test_edge_ops_opcheck(generator):
    for rows in ("all", "subset"):
        case = random_edge_case(generator, 5, rows)
        torch.library.opcheck(torch.ops.peagle.harness_edge_scores, tuple(case[:6]))
        path, q, kind = harness_edge_scores(*case[:6])
        args = (case.table.clone(), case.calibration.clone(), q, kind, path, case.parent, case.accepted_path,
                case.num_accepted, case.rows, EDGE_DECAY, PATH_SCALE_DECAY)  # fmt: skip
        torch.library.opcheck(torch.ops.peagle.harness_edge_observe, args)


def test_edge_scores_argument_errors(generator):
    case = random_edge_case(generator, 3)
    base = dict(zip(("scores", "parent", "num_nodes", "table", "prior", "thresholds"), case[:6], strict=True))
    base["num_nodes"] = torch.full((3,), 2)  # node 1 (a child of the root) is real in every tree
    bad_parent = case.parent.clone()
    bad_parent[0, 1] = 1
    bad_scores = case.scores.clone()
    bad_scores[0, 1] = 1.5
    bad_prior = case.prior.clone()
    bad_prior[1, 0] = 0.0
    cases = [
        (dict(scores=case.scores.float()), "scores must be Double"),
        (dict(scores=case.scores[0]), r"scores must be 2-D \[B, N\]"),
        (dict(parent=case.parent.int()), "parent must be Long"),
        (dict(parent=case.parent[:, :1]), r"parent must have shape \[B, N\] \(like scores\)"),
        (dict(num_nodes=case.num_nodes[:2]), r"num_nodes must have shape \[B\]"),
        (dict(num_nodes=torch.zeros(3, dtype=torch.long)), r"num_nodes must be in \[1, N\]"),
        (dict(table=case.table[:1]), r"table must have shape \[2, E\]"),
        (dict(table=-case.table - 1), "table must be finite and >= 0"),
        (dict(prior=case.prior[:, :4]), r"prior must have shape \[2, E\] \(like table\)"),
        (dict(prior=bad_prior), r"prior must be finite, >= 0 \(accepted\) and > 0 \(drafted\)"),
        (dict(thresholds=case.thresholds[:3]), r"table must have E = 2 \* \(T \+ 1\) = 8 kinds for T = 3"),
        (dict(thresholds=case.thresholds.flip(0)), "thresholds must be finite and strictly ascending"),
        (dict(parent=bad_parent), r"parent of a real node i must be in \[0, i\), got 1 at \[0, 1\]"),
        (dict(scores=bad_scores), r"scores of real nodes must be in \[0, 1\], got 1.5 at \[0, 1\]"),
    ]
    for replace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            harness_edge_scores(**(base | replace))


def test_edge_observe_argument_errors(generator):
    case = random_edge_case(generator, 4, "subset")
    path, q, kind = harness_edge_scores(*case[:6])
    rows = torch.arange(q.shape[0])
    base = dict(table=case.table.clone(), calibration=case.calibration.clone(), q=q, kind=kind, path=path,
                parent=case.parent, accepted_path=case.accepted_path, num_accepted=case.num_accepted, rows=rows,
                edge_decay=0.99, path_decay=0.5)  # fmt: skip
    before = base["table"].clone(), base["calibration"].clone()
    bad_kind = kind.clone()
    bad_kind[0, 0] = case.table.shape[1]
    cases = [
        (dict(table=case.table.float()), "table must be Double"),
        (dict(calibration=case.calibration[:, :1]), r"calibration must have shape \[B, 2\]"),
        (dict(q=q[:, :1].contiguous()), r"kind must have shape \[R, N\] \(like q\)"),
        (dict(kind=kind.int()), "kind must be Long"),
        (dict(path=path.float()), "path must be Double"),
        (dict(parent=case.parent[:, :1]), r"parent must have shape \[R, N\] \(like q\)"),
        (dict(accepted_path=case.accepted_path[0]), r"accepted_path must be 2-D \[R, L\]"),
        (dict(num_accepted=case.num_accepted.int()), "num_accepted must be Long"),
        (dict(rows=rows[:0]), r"rows must have shape \[R\] \(one per row of q\)"),
        (dict(edge_decay=1.5), r"edge_decay must be in \[0, 1\]"),
        (dict(path_decay=float("nan")), r"path_decay must be in \[0, 1\]"),
        (dict(kind=bad_kind), r"kind must be in \[-1, E\) = \[-1, 20\)"),
        (dict(rows=torch.full_like(rows, 4)), r"rows must be in \[0, B\) = \[0, 4\), got 4 at 0"),
    ]
    if q.shape[0] > 1:
        cases.append((dict(rows=torch.zeros_like(rows)), "rows must be distinct, got 0 twice"))
    else:
        cases.append((dict(rows=None), r"without rows, q must have one row per request of calibration"))
    for replace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            harness_edge_observe(**(base | replace))
    assert torch.equal(base["table"], before[0]) and torch.equal(base["calibration"], before[1])
