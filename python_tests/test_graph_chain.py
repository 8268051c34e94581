"""The graph chain's host loop (peagle.decode.harness.graphs) on the CPU: depth steps in order while go says so,
finalize once, the same tokens as an independent Python reference, and clear errors. cuda_tests/test_graph_chain_cuda.py
holds the device chain to this loop."""

from __future__ import annotations

import random

import pytest
import torch

from peagle.decode.harness.graphs import DepthGraphChain, GraphChainCache, device_launch_available
from testkit import fresh_seed
from testkit.depth_chain import ToyDrafter, expected_round


def make_chain(batch: int = 3, max_depth: int = 6) -> tuple[ToyDrafter, DepthGraphChain]:
    drafter = ToyDrafter(batch, max_depth)
    return drafter, DepthGraphChain(drafter.steps(), drafter.finalize, drafter.go)


def test_auto_mode_is_the_host_loop_on_cpu():
    _, chain = make_chain()
    assert chain.mode == "host" and not device_launch_available("cpu")


@pytest.mark.parametrize(("stop_after", "depths"), [(0, 1), (1, 1), (3, 3), (6, 6), (50, 6)])
def test_host_loop_runs_depths_in_order_then_finalize_once(stop_after, depths):
    drafter, chain = make_chain()
    drafter.start_round([5, 17, 900], seed=4, stop_after=stop_after)
    chain.run()
    assert drafter.calls == [f"depth {d}" for d in range(depths)] + ["finalize"]
    assert int(drafter.finalized) == 1 and int(drafter.depth_count) == depths
    assert chain.transitions() == depths


def test_host_loop_stops_on_a_data_dependent_go():
    """The stop token appears at depth 2 of row 1: go = 0 after depth 2 although stop_after allows more."""
    drafter, chain = make_chain()
    root, seed = [5, 17, 900], 4
    _, rows = expected_round(root, seed, 50, 6)
    drafter.start_round(root, seed, stop_after=50, stop_token=rows[1][2])
    chain.run()
    assert drafter.calls == ["depth 0", "depth 1", "depth 2", "finalize"]
    depths, want = expected_round(root, seed, 50, 6, stop_token=rows[1][2])
    assert depths == 3 and drafter.emitted.tolist() == want


def test_host_loop_emits_the_reference_tokens_over_many_rounds():
    seed = fresh_seed()
    print("seed", seed)
    rng = random.Random(seed)
    drafter, chain = make_chain(batch=4, max_depth=8)
    total = 0
    for _ in range(30):
        root = [rng.randrange(drafter.vocab) for _ in range(4)]
        round_seed, stop_after = rng.randrange(1000), rng.randrange(0, 11)
        stop_token = rng.choice([-1, rng.randrange(drafter.vocab)])
        drafter.start_round(root, round_seed, stop_after, stop_token)
        chain.run()
        depths, want = expected_round(root, round_seed, stop_after, 8, stop_token=stop_token)
        assert drafter.emitted.tolist() == want and int(drafter.depth_count) == depths
        total += depths
    assert chain.transitions() == total and int(drafter.finalized) == 30


def test_cache_builds_one_chain_per_padded_batch():
    built = []

    def build(batch: int) -> DepthGraphChain:
        built.append(batch)
        drafter = ToyDrafter(batch, 4)
        return DepthGraphChain(drafter.steps(), drafter.finalize, drafter.go)

    cache = GraphChainCache(build)
    first = cache.get(4)
    assert cache.get(4) is first and cache.get(8) is not first
    assert built == [4, 8] and len(cache) == 2
    with pytest.raises(ValueError, match="padded_batch must be a positive int"):
        cache.get(0)
    cache.close()
    assert len(cache) == 0
    with pytest.raises(RuntimeError, match="closed"):
        first.run()


def test_bad_arguments_raise_clear_errors():
    drafter = ToyDrafter(2, 3)
    steps, fin = drafter.steps(), drafter.finalize
    with pytest.raises(ValueError, match="depth_steps must hold at least one"):
        DepthGraphChain([], fin, drafter.go)
    with pytest.raises(TypeError, match=r"depth_steps\[1\] must be callable"):
        DepthGraphChain([steps[0], 3], fin, drafter.go)
    with pytest.raises(TypeError, match="finalize must be callable"):
        DepthGraphChain(steps, None, drafter.go)
    with pytest.raises(ValueError, match=r"go must be a contiguous 1-element int32 tensor, got a torch\.int64"):
        DepthGraphChain(steps, fin, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        DepthGraphChain(steps, fin, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="mode must be one of"):
        DepthGraphChain(steps, fin, drafter.go, mode="graphs")
    with pytest.raises(RuntimeError, match="mode='device' needs go on a CUDA device"):
        DepthGraphChain(steps, fin, drafter.go, mode="device")
    with pytest.raises(ValueError, match="mode='host_graphs' needs go on a CUDA device"):
        DepthGraphChain(steps, fin, drafter.go, mode="host_graphs")


def test_a_chain_destroyed_during_a_capture_waits_for_the_next_chain(monkeypatch):
    """The deferral of graph_chain_destroy while a stream captures (the op itself needs CUDA: faked here; the real one
    runs in cuda_tests/test_graph_chain_cuda.py)."""
    from peagle.decode.harness import graphs

    destroyed: list[int] = []
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.ops.peagle, "graph_chain_destroy", destroyed.append, raising=False)
    monkeypatch.setattr(graphs, "_pending_destroy", [])
    graphs._destroy_chain(7)
    graphs._destroy_chain(8)
    assert destroyed == [] and graphs._pending_destroy == [7, 8]
    capturing[0] = False
    graphs._destroy_chain(9)
    assert sorted(destroyed) == [7, 8, 9] and graphs._pending_destroy == []
