"""The engine's EAGLE-3 harness on a GPU drafts each round through CUDA graphs chained by device tail launch
(peagle.decode.drafting.DepthDraftRound over DepthStepper / GraphChainCache): the same tokens and per-round acceptance
as the host loop on CUDA, the same greedy tokens as the CPU engine, over many rounds, padded batch sizes and rounds
that stop at different depths, with no host synchronisation inside a replayed round; a step that cannot be captured
falls back to the host loop with the reason in the metrics."""

from __future__ import annotations

import copy

import pytest
import torch

from peagle.decode import SpeculativeDecoder
from peagle.decode.harness.depth_harness import DepthStepper
from peagle.decode.harness.graphs import device_launch_available
from python_tests.test_harness_stepper import COST_TABLE, PROMPTS
from testkit import self_distilled_rows, tiny_target, train_tiny_drafter
from testkit.depth_chain import ToyDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_device_launch = pytest.mark.skipif(
    not torch.cuda.is_available() or not device_launch_available("cuda"),
    reason="needs CUDA, a peagle build with device graph launch (not PEAGLE_NO_DLINK=1) and torch CUDAGraph keep_graph",
)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("llama", seed=1)
    drafter = train_tiny_drafter(model, 1, self_distilled_rows(model, seed=1))
    return model, drafter


def generate(setup, device: str, chain_mode: str, batch: int, temperature: float = 0.0):
    """EAGLE-3 harness rounds (top-k drafts when sampling: the path that drafts depth by depth under the harness)."""
    model, drafter = (copy.deepcopy(m) for m in setup)  # the engine moves the modules it is given
    decoder = SpeculativeDecoder(
        model,
        drafter,
        "harness",
        method="eagle3",
        depth=4,
        num_nodes=12,
        cost_table=COST_TABLE,
        draft_sampling="topk",
        device=device,
        harness_timing=False,  # decisions that repeat from run to run: the runs are compared round by round
    )
    decoder.depth_chain_mode = chain_mode
    return decoder.generate(PROMPTS[:batch], NEW_TOKENS, temperature=temperature, seed=3)


@needs_device_launch
@pytest.mark.parametrize(("temperature", "batch"), [(0.0, 3), (0.0, 6), (1.0, 3)])
def test_graph_chain_equals_host_loop_and_cpu(setup, monkeypatch, temperature, batch):
    """Batch 3: the harness drafts trees (several candidates per depth); batch 6: chains. Requests finish at different
    rounds, so later rounds run at smaller padded batch sizes with padding rows."""
    replays = []
    run = DepthStepper.run

    def no_sync_run(self):  # a replayed round must not synchronise (the capture ran before, on first use)
        if self.mode == "device":
            torch.cuda.set_sync_debug_mode("error")
            try:
                run(self)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            replays.append(self)
        else:
            run(self)

    monkeypatch.setattr(DepthStepper, "run", no_sync_run)
    graphs = generate(setup, "cuda", "auto", batch, temperature)
    host = generate(setup, "cuda", "host", batch, temperature)
    assert graphs.metrics.depth_chain == "device" and host.metrics.depth_chain == "host"
    assert graphs.tokens == host.tokens
    assert [r.accepted for r in graphs.requests] == [r.accepted for r in host.requests]
    if temperature == 0:  # greedy: the target's tokens on any device
        assert graphs.tokens == generate(setup, "cpu", "auto", batch).tokens
    assert len({id(stepper) for stepper in replays}) >= 2  # chains of several padded batch sizes were replayed
    assert len(replays) == graphs.metrics.rounds >= 20  # every round after prefill drafted through the chain


def test_step_that_synchronises_falls_back_to_the_host_loop():
    drafter = ToyDrafter(2, 3, device="cuda")
    steps = drafter.steps()
    inner = steps[1]

    def synchronising() -> None:
        inner()
        int(drafter.go[0])  # a host read: not capturable

    steps[1] = synchronising
    stepper = DepthStepper(steps, drafter.finalize, drafter.go)
    assert stepper.mode == "host"
    assert stepper.fallback.startswith("capture failed") or stepper.fallback.startswith("device graph launch")
    drafter.start_round([3, 4], seed=1, stop_after=3)
    stepper.run()
    assert int(drafter.depth_count) == 3 and int(drafter.finalized) >= 1
