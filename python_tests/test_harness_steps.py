"""The harness over a server's steps (:mod:`peagle.decode.harness.steps`, the per-step draft lengths of vLLM's plugin):
the batch's budget against a brute-force optimum, the verify row of an unpadded batch, what a decision does with the
batch size, the drafter's confidence, fixed requests and the acceptance it observes; cost tables' identity checks
and tables of P-EAGLE passes only (what ``peagle profile --backend vllm`` writes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from peagle.decode.harness import CostTable
from peagle.decode.harness.budget import ragged_chain_lengths
from peagle.decode.harness.cost import model_identity, monotone
from peagle.decode.harness.steps import (
    EXPECTED_DECAY,
    PROBE_AFTER,
    PROBE_AFTER_MAX,
    STEP_OVERHEAD_DECAY,
    STEP_OVERHEAD_MAX,
    TYPICAL_CHAINS,
    StepHarness,
)

K = 4


def step_table(per_token_ms: dict[int, float], base_ms: float = 10.0, pass_ms: float = 1.0) -> CostTable:
    """A table of P-EAGLE passes only: a step of b requests verifying i nodes each costs base + per_token[b] * b *
    (i - 1) milliseconds (a compute-bound forward grows with the batch's tokens), the pass ``pass_ms``."""
    batches, nodes = sorted(per_token_ms), list(range(1, K + 2))
    return CostTable(
        batch_sizes=batches,
        contexts=[0],
        verify_nodes=nodes,
        verify_s=[[[(base_ms + per_token_ms[b] * b * (n - 1)) * 1e-3 for n in nodes]] for b in batches],
        draft_widths=[1],
        draft_s=[],
        pass_s=[[pass_ms * 1e-3] * K for _ in batches],
        machine={"backend": "vllm 0.32.0", "device": "cpu", "processor": "x86_64"},
    )


def chain_rows(generator: torch.Generator, rows: int, depth: int) -> torch.Tensor:
    """[rows, depth] predicted acceptances, non-increasing along a row (products of random edges), with ties and
    zeros now and then."""
    edges = torch.rand(rows, depth, generator=generator, dtype=torch.float64)
    edges = torch.where(torch.rand(rows, depth, generator=generator) < 0.2, 1.0, edges)  # ties along a row
    edges = torch.where(torch.rand(rows, depth, generator=generator) < 0.1, 0.0, edges)
    return torch.cumprod(edges, 1)


def best_ratio(acceptance: torch.Tensor, batch: int, draft_time: float, verify: torch.Tensor) -> float:
    """The best (batch + S) / (T + V[n]) over every choice of a prefix per chain (brute force)."""
    rows, depth = acceptance.shape
    best = -1.0
    for lengths in itertools.product(range(depth + 1), repeat=rows):
        gain = sum(float(acceptance[r, :length].sum()) for r, length in enumerate(lengths))
        best = max(best, (batch + gain) / (draft_time + float(verify[1 + sum(lengths)])))
    return best


def test_the_step_budget_is_the_best_choice_of_prefixes(generator):
    chosen = set()
    for case in range(60):
        rows, depth = 1 + case % 3, 1 + (case // 3) % 3
        acceptance = chain_rows(generator, rows, depth)
        batch = rows + int(torch.randint(0, 3, (1,), generator=generator))
        # V[n]: flat to steep, concave or convex in the drafts kept.
        slope = float(torch.rand(1, generator=generator)) * (0.3 if case % 2 else 0.02)
        power = 0.5 + 1.5 * float(torch.rand(1, generator=generator))
        n = torch.arange(rows * depth + 2, dtype=torch.float64).clamp(min=1) - 1
        verify = 0.01 + slope * 0.01 * n**power
        draft_time = 0.002 * float(torch.rand(1, generator=generator))
        lengths = ragged_chain_lengths(acceptance, batch, draft_time, verify)
        assert lengths.shape == (rows,) and bool(((lengths >= 0) & (lengths <= depth)).all())
        gain = sum(float(acceptance[r, : int(length)].sum()) for r, length in enumerate(lengths))
        ratio = (batch + gain) / (draft_time + float(verify[1 + int(lengths.sum())]))
        assert ratio == pytest.approx(best_ratio(acceptance, batch, draft_time, verify), rel=1e-12), case
        chosen.add(tuple(lengths.tolist()) == (depth,) * rows)
    assert chosen == {True, False}  # power: neither "keep every draft" nor a shorter constant choice passes


def test_ragged_verify_rows_read_the_table_at_the_mean_node_count():
    table = step_table({1: 0.05, 4: 0.3})
    row = table.verify_row(4, 0, K + 1)
    ragged = table.ragged_verify_row(4, 0, 4 * K, fixed=0)
    assert ragged[0] == ragged[1] == row[1]
    for drafts in range(0, 4 * K + 1, 4):  # 4 requests, drafts / 4 each: the table's own points
        assert float(ragged[1 + drafts]) == pytest.approx(float(row[1 + drafts // 4]), rel=1e-12)
    assert float(ragged[3]) == pytest.approx(float(row[1] + row[2]) / 2, rel=1e-12)  # 2 drafts: half a node each
    fixed = table.ragged_verify_row(4, 0, 8, fixed=4)  # 4 drafts verified whatever is chosen
    assert float(fixed[1]) == pytest.approx(float(row[2]), rel=1e-12)


def test_large_batches_keep_fewer_drafts_where_the_forward_grows_with_them():
    # 0.05 ms a token at batch 1 (latency-bound), 0.5 ms a token at batch 16 (compute-bound).
    table = step_table({1: 0.05, 16: 0.5})
    confidence = torch.tensor([0.95, 0.9, 0.8, 0.6]).repeat(16, 1)
    alone = StepHarness(table, K).decide(["a"], confidence[:1], [False], [False], 64)
    assert alone == [K]
    busy = StepHarness(table, K).decide([str(i) for i in range(16)], confidence, [False] * 16, [False] * 16, 64)
    assert max(busy) < K and sum(busy) < 16 * K
    steep = step_table({1: 5.0, 16: 5.0})  # every draft costs half a step: plain decoding for all
    assert StepHarness(steep, K).decide(["a", "b"], confidence[:2], [False] * 2, [False] * 2, 64) == [0, 0]


def test_fixed_requests_keep_every_draft_and_others_are_budgeted_around_them():
    table = step_table({1: 20.0, 4: 20.0})
    harness = StepHarness(table, K)
    confidence = torch.full((4, K), 0.9)
    lengths = harness.decide(list("abcd"), confidence, [True, True, False, False], [True, False, False, True], 64)
    assert lengths[0] == K and lengths[3] == K and lengths[1] == lengths[2] == 0


def test_the_observed_acceptance_moves_a_request_s_lengths():
    table = step_table({1: 1.5, 2: 1.5})
    harness = StepHarness(table, K)
    confidence = torch.tensor([[0.6, 0.5, 0.4, 0.3], [0.6, 0.5, 0.4, 0.3]])
    first = harness.decide(["easy", "hard"], confidence, [False] * 2, [False] * 2, 64)
    assert first[0] == first[1] and 0 < first[0] < K
    for _ in range(12):
        lengths = harness.decide(["easy", "hard"], confidence, [False] * 2, [False] * 2, 64)
        harness.observe(["easy", "hard"], lengths, [lengths[0], 0])  # the easy text accepts all, the hard none
    easy, hard = harness.decide(["easy", "hard"], confidence, [False] * 2, [False] * 2, 64)
    assert easy > first[0] >= hard and hard < first[1]
    slot = harness.slots["easy"]
    assert float(harness.calibration[slot, 0]) > 0 and float(harness.calibration[harness.slots["hard"], 0]) == 0
    # Sampled requests learn in a table of their own: the greedy table's experience does not move them.
    fresh = StepHarness(table, K).decide(["new"], confidence[:1], [True], [False], 64)
    assert harness.decide(["new"], confidence[:1], [True], [False], 64) == fresh


def test_requests_come_and_go_in_slots():
    harness = StepHarness(step_table({1: 0.05, 8: 0.05}), K, capacity=2)
    names = [f"r{i}" for i in range(5)]
    lengths = harness.decide(names, torch.full((5, K), 0.9), [False] * 5, [False] * 5, 64)
    assert len(lengths) == 5 and len(set(harness.slots.values())) == 5
    harness.observe([*names, "unknown"], [*lengths, 2], [1] * 6)  # unknown requests are skipped
    harness.observe(names, [0] * 5, [0] * 5)  # nothing verified: nothing observed
    harness.finish(names[:3])
    assert set(harness.slots) == set(names[3:]) and len(harness.free) >= 3
    assert bool((harness.calibration[[s for s in range(harness.calibration.shape[0]) if s not in
                                      harness.slots.values()]] == 0).all())  # fmt: skip
    counts = harness.take_lengths()
    assert sum(counts[5].values()) == 5 and harness.take_lengths() == {}
    with pytest.raises(
        ValueError, match=r"confidence must be \[B, K\] for B = 2 requests and K in 1 .. 4, got \[2, 5\]"
    ):
        harness.decide(["a", "b"], torch.ones(2, 5), [False] * 2, [False] * 2, 64)


def test_cost_tables_name_what_differs_from_what_is_served(tmp_path):
    for name in ("t", "t2", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * (10 if name != "t2" else 11))
        (tmp_path / name / "config.json").write_text('{"layers": 1}')
    target, drafter = model_identity(tmp_path / "t"), {**model_identity(tmp_path / "d"), "num_speculative_tokens": 4}
    machine = {"backend": "vllm 0.32.0", "device": "cpu", "processor": "x86_64"}
    table = step_table({1: 0.05})
    table.target, table.drafter, table.machine = target, drafter, machine
    assert table.identity_mismatches(target, drafter, dict(machine)) == []
    copied = tmp_path / "copy"
    (tmp_path / "t").rename(copied)  # the same model elsewhere
    assert table.identity_mismatches(model_identity(copied), drafter, machine) == []
    other = table.identity_mismatches(model_identity(tmp_path / "t2"), {**drafter, "num_speculative_tokens": 3},
                                      {**machine, "device": "cuda:0", "gpu": "NVIDIA H200"})  # fmt: skip
    assert [line.split(":")[0] for line in other] == ["device", "target", "drafter"]
    assert "profiled on cpu (x86_64), served on cuda (NVIDIA H200)" in other[0]
    assert "num_speculative_tokens 4" in other[2] and "num_speculative_tokens 3" in other[2]
    engine = table.identity_mismatches(target, drafter, {**machine, "backend": "peagle"})
    assert engine == ["backend: profiled with vllm 0.32.0, served by peagle"]
    assert table.identity_mismatches(target, drafter, {**machine, "backend": "vllm 0.33.1"}) == []  # its version


def test_tables_of_p_eagle_passes_only_round_trip(tmp_path):
    table = step_table({1: 0.05, 4: 0.1})
    loaded = CostTable.load(table.save(tmp_path / "costs.json"))
    assert loaded == table and loaded.max_depth == K and loaded.backend == "vllm 0.32.0"
    with pytest.raises(ValueError, match="times P-EAGLE passes only"):
        loaded.draft_row(1, 1)
    with pytest.raises(ValueError, match="draft_s or pass_s must hold timings"):
        CostTable(batch_sizes=[1], contexts=[0], verify_nodes=[1], verify_s=[[[1.0]]], draft_widths=[1], draft_s=[])
    assert monotone([3.0, 1.0, 2.0, 2.5, 2.4]) == [1.0, 1.0, 2.0, 2.4, 2.4]


def test_calls_inside_and_outside_inference_mode_mix():
    """vLLM builds the harness and calls it inside torch.inference_mode on some paths and outside on others: state made
    in one must take updates in the other (an inference tensor refuses in-place updates outside the mode)."""
    table = step_table({1: 1.5, 2: 1.5})
    with torch.inference_mode():
        harness = StepHarness(table, K)
        confidence = torch.tensor([[0.6, 0.5, 0.4, 0.3], [0.6, 0.5, 0.4, 0.3]], dtype=torch.float64)
        first = harness.decide(["a", "b"], confidence, [False] * 2, [False] * 2, 64)
        harness.observe(["a", "b"], first, first)
    second = harness.decide(["a", "b"], confidence, [False] * 2, [False] * 2, 64)
    harness.observe(["a", "b"], second, [0, 0])
    with torch.inference_mode():
        assert harness.decide(["a", "b"], confidence, [False] * 2, [False] * 2, 64) == harness.decide(
            ["a", "b"], confidence.clone(), [False] * 2, [False] * 2, 64
        )
    assert not harness.calibration.is_inference() and not harness.pending_q.is_inference()


def plan_reference(harness: StepHarness, names: list[str], table: CostTable) -> bool:
    """Whether the pass can pay, brute force: the best (B + S) / (T + V[n]) over every prefix per chain of the
    requests' expected chains against B / V[1] without a pass."""
    expected = harness.expected[[harness.slots[n] for n in names]]
    batch = len(names)
    verify = table.ragged_verify_row(batch, 64, batch * K)
    return best_ratio(expected, batch, table.pass_time(batch, K), verify) > batch / float(verify[1])


def test_the_pass_runs_only_where_the_expected_drafts_pay_for_it(generator):
    outcomes = set()
    for case in range(40):
        rows = 1 + case % 3
        per_token = 0.05 + 3.0 * float(torch.rand(1, generator=generator))
        pass_ms = 10.0 * float(torch.rand(1, generator=generator))
        table = step_table({rows: per_token}, pass_ms=pass_ms)
        harness = StepHarness(table, K)
        names, plain = [f"r{i}" for i in range(rows)], [False] * rows
        first, second = (torch.rand(rows, K, generator=generator).clamp(min=0.05) for _ in range(2))
        harness.decide(names, first, plain, plain, 64)
        chains = harness.expected[[harness.slots[n] for n in names]].clone()  # a fresh request's: its first chain
        fresh = StepHarness(table, K)
        fresh.decide(names, second, plain, plain, 64)
        harness.decide(names, second, plain, plain, 64)
        expected = EXPECTED_DECAY * chains + (1 - EXPECTED_DECAY) * fresh.expected[[fresh.slots[n] for n in names]]
        assert torch.allclose(harness.expected[[harness.slots[n] for n in names]], expected, rtol=1e-12, atol=0)
        harness.take_lengths()
        reference = plan_reference(harness, names, table)  # before: a skipped step moves the expectations
        go = harness.plan_pass(names, plain, plain, 64)
        assert go == reference, case
        assert harness.take_lengths() == ({} if go else {rows: {0: rows}})  # a skipped pass: every request plain
        outcomes.add(go)
    assert outcomes == {True, False}  # power: neither answer alone passes


def test_the_pass_runs_while_nothing_is_known_of_a_kind_and_for_fixed_requests():
    table = step_table({1: 5.0, 2: 5.0, 4: 5.0}, pass_ms=5.0)  # every draft costs half a step: no pass pays
    harness = StepHarness(table, K)
    assert harness.plan_pass(["a", "b"], [False] * 2, [False] * 2, 64)  # no chain seen: only a pass can tell
    harness.decide(["a", "b"], torch.full((2, K), 0.5), [False] * 2, [False] * 2, 64)
    harness.take_lengths()
    for _ in range(3):  # steps in a row: the same answer (kept), every skipped step counted
        assert not harness.plan_pass(["a", "b"], [False] * 2, [False] * 2, 64)
    assert harness.take_lengths() == {2: {0: 6}}
    assert not harness.plan_pass(["new"], [False], [False], 64)  # a new greedy request: the greedy chains' mean
    assert harness.plan_pass(["new"], [True], [False], 64)  # no sampled chain seen yet
    assert harness.plan_pass(["a", "b"], [True] * 2, [True, False], 64)  # a seeded request keeps its drafts


def test_a_run_of_skipped_passes_is_broken_by_probes_further_and_further_apart():
    table = step_table({1: 5.0, 2: 5.0}, pass_ms=5.0)  # no pass pays
    harness = StepHarness(table, K)
    harness.decide(["a", "b"], torch.full((2, K), 0.5), [False] * 2, [False] * 2, 64)
    answers = [harness.plan_pass(["a", "b"], [False] * 2, [False] * 2, 64) for _ in range(300)]
    probes, index, gap = [], -1, PROBE_AFTER
    while index + gap + 1 < len(answers):
        index += gap + 1
        probes.append(index)
        gap = min(2 * gap, PROBE_AFTER_MAX)
    assert [i for i, go in enumerate(answers) if go] == probes and probes[-1] - probes[-2] == PROBE_AFTER_MAX + 1
    # A pass that pays starts the count over: on a table where drafts are free the next skip is PROBE_AFTER away.
    harness.table = step_table({1: 0.0, 2: 0.0}, pass_ms=0.0)
    harness._costs.clear()
    harness.decide(["a", "b"], torch.full((2, K), 0.5), [False] * 2, [False] * 2, 64)
    assert harness.plan_pass(["a", "b"], [False] * 2, [False] * 2, 64)
    harness.table = table
    harness._costs.clear()
    harness.decide(["a", "b"], torch.full((2, K), 0.5), [False] * 2, [False] * 2, 64)
    answers = [harness.plan_pass(["a", "b"], [False] * 2, [False] * 2, 64) for _ in range(PROBE_AFTER + 1)]
    assert answers == [False] * PROBE_AFTER + [True]


def test_requests_without_chains_of_their_own_take_their_kind_s_mean_chain(generator):
    three, plain = ["a", "b", "c"], [False] * 3
    differs = False
    for case in range(400):
        per_token = 0.05 + 2.0 * float(torch.rand(1, generator=generator))
        table = step_table({3: per_token}, pass_ms=5.0 * float(torch.rand(1, generator=generator)))
        confidence = torch.rand(2, K, generator=generator).clamp(min=0.05)
        mixed = StepHarness(table, K)
        mixed.decide(["a", "b"], confidence, [False] * 2, [False] * 2, 64)
        mean = mixed.expected[[mixed.slots["a"], mixed.slots["b"]]].mean(0)
        assert torch.allclose(mixed.typical[False], mean, rtol=1e-12, atol=0) and mixed.typical[True] is None
        answers = {}
        for fill in ("mean", "none"):  # c given the mean chain, or a chain that drafts nothing (the power check)
            full = StepHarness(table, K)
            full.decide(three, torch.cat([confidence, confidence[:1]]), plain, plain, 64)
            full.expected[full.slots["c"]] = mean if fill == "mean" else 0.0
            answers[fill] = full.plan_pass(three, plain, plain, 64)
        assert mixed.plan_pass(three, plain, plain, 64) == answers["mean"], case
        differs |= answers["mean"] != answers["none"]
    assert differs


def expected_of(harness: StepHarness, names: list[str]) -> torch.Tensor:
    return harness.expected[[harness.slots[n] for n in names]].clone()


def test_a_kind_s_mean_chain_is_the_mean_of_its_latest_chains(generator):
    harness = StepHarness(step_table({1: 1.0, 50: 1.0, 100: 1.0}), K)
    chains, sampled_chains = [], []
    for step in range(8):  # fresh requests each step: a fresh request's expectation is its first chain
        rows = 50 if step < 4 else 100
        names = [f"s{step}-{i}" for i in range(rows)]
        sampled = [i % 5 == 0 for i in range(rows)]
        harness.decide(names, torch.rand(rows, K, generator=generator), sampled, [False] * rows, 64)
        step_chains = expected_of(harness, names)
        is_sampled = torch.tensor(sampled)
        chains.append(step_chains[~is_sampled])
        sampled_chains.append(step_chains[is_sampled])
        seen = torch.cat(chains)
        if seen.shape[0] <= TYPICAL_CHAINS:  # every chain seen so far, alike
            assert torch.allclose(harness.typical[False], seen.mean(0), rtol=1e-12, atol=1e-15), step
            mean_before = seen.mean(0)
        else:  # past the cap the newest rows weigh rows / TYPICAL_CHAINS
            weight = chains[-1].shape[0] / TYPICAL_CHAINS
            mean_before = mean_before + weight * (chains[-1].mean(0) - mean_before)
            assert torch.allclose(harness.typical[False], mean_before, rtol=1e-12, atol=1e-15), step
        sampled_seen = torch.cat(sampled_chains)
        assert sampled_seen.shape[0] <= TYPICAL_CHAINS
        assert torch.allclose(harness.typical[True], sampled_seen.mean(0), rtol=1e-12, atol=1e-15), step
    assert torch.cat(chains).shape[0] > TYPICAL_CHAINS  # the capped branch ran


def test_skipped_steps_move_each_request_s_expectation_toward_its_kind_s_mean_chain(generator):
    table = step_table({2: 5.0, 3: 5.0, 4: 5.0}, pass_ms=5.0)  # every draft costs half a step: no pass pays
    harness = StepHarness(table, K)
    names, sampled = ["a", "b", "c", "d"], [False, False, True, True]
    harness.decide(names, torch.rand(4, K, generator=generator), sampled, [False] * 4, 64)
    harness.decide(["idle"], torch.rand(1, K, generator=generator), [False], [False], 64)
    greedy, drawn = harness.typical[False].clone(), harness.typical[True].clone()
    before, idle = expected_of(harness, names), expected_of(harness, ["idle"])
    steps = 3
    for _ in range(steps):
        assert not harness.plan_pass(names, sampled, [False] * 4, 64)
    kind = torch.stack([greedy, greedy, drawn, drawn])
    stale = EXPECTED_DECAY**steps
    assert torch.allclose(expected_of(harness, names), kind + stale * (before - kind), rtol=1e-12, atol=1e-15)
    assert torch.equal(expected_of(harness, ["idle"]), idle)  # a request outside the batch keeps its own
    assert torch.equal(harness.typical[False], greedy) and torch.equal(harness.typical[True], drawn)


def test_a_request_with_poor_chains_drafts_again_when_its_kind_s_chains_pay():
    # At batch 1 a draft costs 2 ms and the pass 1 ms of a 10 ms step: drafts of probability 0.9 (calibrated about
    # 0.8) pay for the pass, drafts of 0.05 (calibrated about 0.24, then falling fast along the chain) do not.
    table = step_table({1: 2.0, 3: 2.0}, pass_ms=1.0)
    harness = StepHarness(table, K)
    harness.decide(["g1", "g2", "g3"], torch.full((3, K), 0.9), [False] * 3, [False] * 3, 64)
    harness.decide(["poor"], torch.full((1, K), 0.05), [False], [False], 64)
    typical, own = harness.typical[False].clone(), expected_of(harness, ["poor"])[0]
    answers, references = [], []
    for skipped in range(PROBE_AFTER):
        stale = own if skipped == 0 else typical + EXPECTED_DECAY**skipped * (own - typical)
        reference = StepHarness(table, K)  # a harness given that expectation outright
        reference.decide(["poor"], torch.full((1, K), 0.05), [False], [False], 64)
        reference.expected[reference.slots["poor"]] = stale
        references.append(plan_reference(reference, ["poor"], table))
        answers.append(harness.plan_pass(["poor"], [False], [False], 64))
        if answers[-1]:
            break
    assert answers == references
    # Power: the pass is first skipped, then resumed by the regression (before the first probe, PROBE_AFTER away).
    assert answers[0] is False and answers[-1] is True and len(answers) <= PROBE_AFTER


def test_each_timed_step_s_excess_over_its_price_is_the_overhead_every_price_carries():
    table = step_table({2: 5.0}, pass_ms=5.0)  # no pass pays at overhead 0
    harness = StepHarness(table, K)
    names, plain = ["a", "b"], [False, False]
    harness.decide(names, torch.full((2, K), 0.5), plain, plain, 64)
    v1 = float(table.ragged_verify_row(2, 64, 2 * K)[1])
    pass_s = table.pass_time(2, K)
    assert not harness.plan_pass(names, plain, plain, 64)
    harness.step_ended(None)  # untimed; the next step verifies no drafts (priced V[1]) and runs no pass
    overhead, steps = 0.0, [3.0 * v1, 2.5 * v1, 9.0 * v1, None, 1.5 * v1]
    for seconds in steps:
        harness._skipped_run = 0  # no probes
        assert not harness.plan_pass(names, plain, plain, 64)  # skipped: the step's price is V[1] and no pass
        harness.step_ended(seconds)
        if seconds is not None and seconds <= STEP_OVERHEAD_MAX * v1:  # 9 V[1]: an idle gap, left out
            overhead = STEP_OVERHEAD_DECAY * overhead + (1 - STEP_OVERHEAD_DECAY) * (seconds - v1)
        assert harness.step_overhead == pytest.approx(overhead, rel=1e-12), seconds
    # A step whose pass ran is priced with its pass and the verification decide chose for it.
    harness.step_overhead = 0.0
    harness.table = step_table({2: 0.0}, pass_ms=pass_s * 1e3)  # drafts are free: every pass pays
    harness._costs.clear()
    assert harness.plan_pass(names, plain, plain, 64)
    kept = harness.decide(names, torch.full((2, K), 0.5), plain, plain, 64)
    harness.step_ended(2.0 * v1)  # the step whose pass just ran: priced V[1] (skipped before) + the pass
    assert harness.step_overhead == pytest.approx((1 - STEP_OVERHEAD_DECAY) * max(2.0 * v1 - v1 - pass_s, 0.0))
    before = harness.step_overhead
    harness.step_ended(None)  # a step the policy did not plan (a prompt's) is not timed
    price = float(harness.table.ragged_verify_row(2, 64, 2 * K)[1 + sum(kept)])
    assert harness.step_overhead == before and price > 0
    harness.step_ended(0.5 * price)  # overpriced: the overhead never goes negative
    assert harness.step_overhead >= 0.0


def test_a_dear_served_step_makes_the_pass_pay():
    """Power: a table whose prices make the pass lose at overhead 0 makes it pay once every step is seen to cost
    more (the overhead is common to a step with drafts and one without), as the brute-force plan says."""
    table = step_table({1: 2.0}, pass_ms=10.0)
    harness = StepHarness(table, K)
    harness.decide(["a"], torch.full((1, K), 0.3), [False], [False], 64)
    answers = []
    for overhead in (0.0, 0.002, 0.01, 0.05):
        harness.step_overhead = overhead
        verify = table.ragged_verify_row(1, 64, K) + overhead
        expected = harness.expected[[harness.slots["a"]]]
        reference = best_ratio(expected, 1, table.pass_time(1, K), verify) > 1 / float(verify[1])
        answers.append(harness.plan_pass(["a"], [False], [False], 64))
        harness._skipped_run = 0  # no probes: the answer is the plan's
        assert answers[-1] == reference, overhead
    assert answers[0] is False and answers[-1] is True
