"""The EAGLE-3 harness round in preallocated buffers (peagle.decode.drafting.DepthDraftRound, run by DepthStepper
through the graph chain's host loop on the CPU) builds, round after round, exactly the tree of an independent reference
loop written the way the harness drafted before: state allocated per round, the frontier cut to the widest request's
width (a host read per depth), only the depths that ran concatenated. Checked over many rounds of several generate
calls, batch sizes whose rounds have padding rows (requests finishing at different rounds), rounds stopping at different
depths, greedy and sampled-top-k drafts, and the shapes a GPU uses; the emitted tokens are the target's own greedy ones.
Equal trees (tokens, parents) verify to equal tokens, so the engine emits what it emitted before; path scores agree up
to float rounding. cuda_tests/test_harness_chain_cuda.py runs the same rounds as CUDA graphs chained on the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle.decode import SpeculativeDecoder
from peagle.decode.drafting import DepthDraftRound, NodeSteps, depth_round
from peagle.decode.harness import CostTable
from peagle.decode.harness.budget import harness_budget, predicted_acceptance, select_candidates, sharpen
from peagle.decode.harness.graphs import padded_batch_size
from peagle.decode.sampling import draft_distribution
from peagle.ops import HarnessState, TreeSpec, harness_decide, tree_expand_topk, tree_expand_topk_reference
from testkit import greedy_reference, self_distilled_rows, tiny_target, train_tiny_drafter

PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 9, 10, 11, 40, 2, 17, 33], [20], [30, 31, 2, 7, 50], [12, 13], [44, 4, 8]]
NEW_TOKENS = 48


def steep_cost_table() -> CostTable:
    """Verify time that barely grows with the verified nodes (the harness drafts trees) and drafting that costs 40%
    of a verify per depth: the harness stops at different depths from round to round (a table whose drafting is cheap
    always drafts every depth)."""
    nodes, batches = [1, 2, 4, 8, 16], [1, 4, 16]
    return CostTable(
        batch_sizes=batches,
        contexts=[0],
        verify_nodes=nodes,
        verify_s=[[[10e-3 + 0.1e-3 * b * (n - 1) for n in nodes]] for b in batches],
        draft_widths=[1, 2, 4],
        draft_s=[[[4e-3, 4.5e-3, 5e-3]] * 8] * len(batches),
        pass_s=[[1e-3 + 0.1e-3 * k for k in range(8)]] * len(batches),
    )


COST_TABLE = steep_cost_table()


@pytest.fixture(scope="module")
def setup(one_thread):
    model = tiny_target("llama", seed=1)
    drafter = train_tiny_drafter(model, 1, self_distilled_rows(model, seed=1))
    yield SimpleNamespace(model=model, drafter=drafter)


@torch.no_grad()
def reference_tree(
    round_: DepthDraftRound, rows, host_rows, root_probs, root_hidden
) -> tuple[TreeSpec, torch.Tensor, int]:
    """The round's tree, predicted acceptance and depths run, drafted as the harness did with per-round allocations."""
    harness, owner = round_.harness, round_.owner
    batch, device = rows.numel(), rows.device
    steps = NodeSteps(owner, rows, host_rows, root_hidden)
    gamma, calibration = harness.gamma[rows], harness.calibration[rows].contiguous()
    state = HarnessState.start(batch, device, harness.root_cost)
    cap = min(harness.max_width, root_probs.shape[1])
    levels: list[dict[str, torch.Tensor]] = []
    count = 1
    for depth in range(owner.depth):
        if depth == 0:
            probs, scores = root_probs[:, None], torch.ones(batch, 1, dtype=torch.float64)
            hidden, sees = root_hidden[:, None], torch.zeros(batch, 1, 0, dtype=torch.bool)
            index = torch.zeros(batch, 1, dtype=torch.long)
        else:
            level, width = levels[-1], int(state.width.max())
            sees = level["sees"][:, :width]
            logits, hidden = steps.run(level["tokens"][:, :width], level["feats"][:, :width], depth, sees)
            probs = draft_distribution(logits, round_.temperature)
            scores = torch.where(level["chosen"][:, :width], level["scores"][:, :width], 0.0)
            sees = torch.cat([sees, torch.eye(width, dtype=torch.bool).expand(batch, -1, -1)], dim=2)
            index = level["index"][:, :width]
        tokens, slot, cand = (x[:, :cap] for x in tree_expand_topk(scores, probs, cap))
        cost = harness.draft_cost[min(depth + 1, len(harness.draft_cost)) - 1]
        frontier = sharpen(torch.where(cand > 0, cand, -torch.inf), gamma).contiguous()
        harness_decide(frontier, calibration, harness.widths, cost, harness.verify_cost, state)
        levels.append(
            {
                "tokens": tokens,
                "parent": index.gather(1, slot),
                "scores": cand,
                "chosen": torch.arange(cap)[None, :] < state.width[:, None],
                "index": count + torch.arange(cap).expand(batch, cap),
                "feats": hidden.gather(1, slot[..., None].expand(-1, -1, hidden.shape[2])),
                "sees": sees.gather(1, slot[..., None].expand(-1, -1, sees.shape[2])),
            }
        )
        count += cap
        if not int(state.go[0]):
            break
    none = torch.full((batch, 1), -1, dtype=torch.long)
    tokens = torch.cat([none] + [lv["tokens"] for lv in levels], 1)
    parent = torch.cat([none] + [lv["parent"] for lv in levels], 1)
    chosen = torch.cat([torch.ones(batch, 1, dtype=torch.bool)] + [lv["chosen"] for lv in levels], 1)
    scores = torch.cat([torch.ones(batch, 1, dtype=torch.float64)] + [lv["scores"] for lv in levels], 1)
    scores = sharpen(torch.where(chosen, scores, 0.0), gamma)
    budget = harness_budget(
        torch.where(chosen, scores, -1.0)[:, 1:], calibration, state.draft_time, harness.verify_cost
    )
    # The target verifies the widest request's node count for all: each request verifies that many (or all it has).
    budget = torch.clamp(budget, min=int(budget.max())).minimum(chosen.sum(1))
    tree = select_candidates(tokens, parent, scores, chosen, budget, harness.max_nodes)
    return tree, predicted_acceptance(tree, calibration), len(levels)


@pytest.mark.parametrize(
    ("temperature", "draft_sampling", "gpu_shapes"),
    [(0.0, "gumbel", False), (1.0, "topk", False), (0.0, "gumbel", True)],
)
def test_preallocated_rounds_build_the_reference_trees(setup, monkeypatch, temperature, draft_sampling, gpu_shapes):
    """``gpu_shapes``: the steps as a GPU runs them (the whole cache capacity as context in every round, the
    reference of tree_expand_topk), on the CPU."""
    seen = []  # (requests, padded batch size, depths run) of every round
    draft = DepthDraftRound.draft
    if gpu_shapes:
        init = DepthDraftRound.__init__

        def static_init(self, *args) -> None:
            init(self, *args)
            self.static = True

        monkeypatch.setattr(DepthDraftRound, "__init__", static_init)
        monkeypatch.setattr(depth_round, "_expand_topk", tree_expand_topk_reference)

    def checked(self, rows, host_rows, root_probs, root_hidden):
        want, want_predicted, depths = reference_tree(self, rows, host_rows, root_probs, root_hidden)
        got = draft(self, rows, host_rows, root_probs, root_hidden)
        for field in ("tokens", "parent", "depth", "num_nodes", "mask"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        # Scores agree up to rounding: the drafter ran on `cap` frontier rows instead of the widest request's width
        # (float32), and elementwise float64 ops vectorise differently over rows of another length.
        torch.testing.assert_close(got.scores, want.scores, rtol=1e-4, atol=0)
        torch.testing.assert_close(self.harness.predicted[rows], want_predicted, rtol=1e-4, atol=0)
        assert self.context_len == (self.max_context if gpu_shapes else self.owner.cache.padded_len(host_rows))
        seen.append((rows.numel(), self.padded, depths))
        return got

    monkeypatch.setattr(DepthDraftRound, "draft", checked)
    decoder = SpeculativeDecoder(
        setup.model,
        setup.drafter,
        "harness",
        method="eagle3",
        depth=4,
        num_nodes=12,
        cost_table=COST_TABLE,
        draft_sampling=draft_sampling,
        harness_timing=False,  # every round drafts (timed, the tiny target may stop drafting on the wall clock)
    )
    for batch in (1, 3, 6):  # one decoder: later calls start from what earlier ones learnt
        prompts = PROMPTS[:batch]
        out = decoder.generate(prompts, NEW_TOKENS, temperature=temperature, seed=7)
        assert out.metrics.depth_chain == "host"
        if temperature == 0:
            assert out.tokens == [greedy_reference(setup.model, p, NEW_TOKENS) for p in prompts]
    assert len(seen) > 30
    assert any(count < padded for count, padded, _ in seen)  # rounds with padding rows
    assert len({count for count, _, _ in seen}) >= 4  # requests finished at different rounds
    assert len({padded for _, padded, _ in seen}) >= 3  # chains of several padded batch sizes
    assert len({depths for _, _, depths in seen}) >= 3  # rounds stopped at different depths


def test_padded_batch_size():
    assert [padded_batch_size(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert padded_batch_size(5, 16) == 8 and padded_batch_size(16, 16) == 16
    for bad in (0, 7, 2.0, True):
        with pytest.raises(ValueError, match="rows must be an int in"):
            padded_batch_size(bad, 6)
