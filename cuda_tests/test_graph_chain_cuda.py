"""The graph chain on a GPU (peagle.decode.harness.graphs): 32 depths chained by device tail launch with one host
launch per round, the same tokens as the host loop and the Python reference over rounds with changed device scalars,
and clear errors from the graph_chain_* ops."""

from __future__ import annotations

import random

import pytest
import torch

from peagle.decode.harness.graphs import DepthGraphChain, GraphChainCache, device_launch_available
from testkit import fresh_seed
from testkit.depth_chain import ToyDrafter, expected_round

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_device_launch = pytest.mark.skipif(
    not torch.cuda.is_available() or not device_launch_available("cuda"),
    reason="needs CUDA, a peagle build with device graph launch (not PEAGLE_NO_DLINK=1) and torch CUDAGraph keep_graph",
)
DEPTHS = 32


def make(mode: str, batch: int = 4, max_depth: int = DEPTHS) -> tuple[ToyDrafter, DepthGraphChain]:
    drafter = ToyDrafter(batch, max_depth, device="cuda")
    chain = DepthGraphChain(drafter.steps(), drafter.finalize, drafter.go, mode=mode)
    drafter.finalized.zero_()  # building a graph chain ran every step once (warm-up)
    return drafter, chain


def random_rounds(rng: random.Random, count: int, batch: int, vocab: int = 1009) -> list[tuple]:
    """(root, seed, stop_after, stop_token) per round: stop_after 0 .. DEPTHS + 3, sometimes a stop token."""
    rounds = [([1] * batch, 3, DEPTHS + 5, -1), ([2] * batch, 9, 1, -1)]  # every depth; depth 0 only
    for _ in range(count - len(rounds)):
        stop_token = rng.choice([-1, -1, rng.randrange(vocab)])
        rounds.append(
            ([rng.randrange(vocab) for _ in range(batch)], rng.randrange(1000), rng.randrange(DEPTHS + 4), stop_token)
        )
    return rounds


def run_round(drafter: ToyDrafter, chain: DepthGraphChain, round_args: tuple) -> tuple[int, list[list[int]]]:
    drafter.start_round(*round_args)
    chain.run()
    torch.cuda.synchronize()
    return int(drafter.depth_count), drafter.emitted.tolist()


@needs_device_launch
def test_device_chain_runs_32_depths_from_one_host_launch():
    drafter, chain = make("device")
    assert chain.mode == "device"
    root, seed = [11, 22, 33, 44], 5
    drafter.start_round(root, seed, stop_after=DEPTHS + 1)
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time ahead of the launch
    chain.run()
    # run() only queued depth 0 behind the sleep: nothing synchronised, the stream is still busy.
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    chain.check()
    # Every transition (31 depth -> depth, 1 depth -> finalize) was a tail launch made on the device.
    assert chain.transitions() == DEPTHS and int(drafter.depth_count) == DEPTHS and int(drafter.finalized) == 1
    assert drafter.emitted.tolist() == expected_round(root, seed, DEPTHS + 1, DEPTHS)[1]


@needs_device_launch
def test_device_chain_equals_host_loop_over_rounds_with_changed_scalars():
    seed = fresh_seed()
    print("seed", seed)
    rounds = random_rounds(random.Random(seed), 12, batch=4)
    runs = {mode: make(mode) for mode in ("device", "host_graphs", "host")}
    total = 0
    for round_args in rounds:
        want = expected_round(*round_args[:3], DEPTHS, stop_token=round_args[3])
        for mode, (drafter, chain) in runs.items():
            assert run_round(drafter, chain, round_args) == want, (mode, round_args)
        total += want[0]
    for mode, (drafter, chain) in runs.items():
        chain.check()
        assert chain.transitions() == total and int(drafter.finalized) == len(rounds), mode


@needs_device_launch
def test_chain_cache_serves_each_padded_batch():
    drafters: dict[int, ToyDrafter] = {}

    def build(batch: int) -> DepthGraphChain:
        drafters[batch] = ToyDrafter(batch, 8, device="cuda")
        return DepthGraphChain(drafters[batch].steps(), drafters[batch].finalize, drafters[batch].go)

    cache = GraphChainCache(build)
    for batch, stop_after in [(1, 3), (4, 8), (1, 20), (4, 2)]:
        chain = cache.get(batch)
        assert chain.mode == "device"
        root = list(range(7, 7 + batch))
        assert run_round(drafters[batch], chain, (root, batch, stop_after)) == expected_round(
            root, batch, stop_after, 8
        )
    assert len(cache) == 2
    cache.close()


@needs_device_launch
def test_closed_chain_and_bad_handles_raise():
    _, chain = make("device", max_depth=2)
    chain_id = chain._chain
    chain.close()
    with pytest.raises(RuntimeError, match="closed"):
        chain.run()
    with pytest.raises(RuntimeError, match=f"chain {chain_id} is not a live graph chain"):
        torch.ops.peagle.graph_chain_launch(chain_id)
    with pytest.raises(RuntimeError, match="is not a live graph chain"):
        torch.ops.peagle.graph_chain_destroy(-5)
    execs = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"graphs\[1\] is a null cudaGraph_t"):
        torch.ops.peagle.graph_chain_create([1, 0], execs)
    with pytest.raises(RuntimeError, match="expected graphs to hold at least one depth graph"):
        torch.ops.peagle.graph_chain_create([1], execs[:1])
    with pytest.raises(RuntimeError, match="expected execs to be a contiguous 1-D int64 CUDA tensor"):
        torch.ops.peagle.graph_chain_create([1, 2], execs.cpu())


@needs_device_launch
def test_tail_op_checks_its_arguments():
    go = torch.zeros(1, dtype=torch.int32, device="cuda")
    execs = torch.zeros(3, dtype=torch.int64, device="cuda")
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    tail = torch.ops.peagle.graph_chain_tail
    with pytest.raises(RuntimeError, match="expected go to be a 1-element int32 CUDA tensor"):
        tail(go.cpu(), execs, status, 0)
    with pytest.raises(RuntimeError, match="expected go to be a 1-element int32 CUDA tensor"):
        tail(go.long(), execs, status, 0)
    with pytest.raises(RuntimeError, match="expected status to be a 2-element int32 CUDA tensor"):
        tail(go, execs, status[:1], 0)
    with pytest.raises(RuntimeError, match=r"expected depth in \[0, 2\)"):
        tail(go, execs, status, 2)
    # CUDA launches the tail kernel only from a graph, so the op refuses an eager call.
    with pytest.raises(RuntimeError, match="expected a call under a CUDA graph capture"):
        tail(go, execs, status, 0)
    # Captured outside a chain (handles never written), the kernel records the missing handle instead of launching.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tail(go, execs, status, 0)
    graph.replay()
    assert status.tolist() == [0, -1]


def test_host_graphs_mode_equals_the_reference_without_device_launch():
    """Host-launched per-depth graphs need no device graph launch: they run wherever CUDA graphs do."""
    drafter, chain = make("host_graphs", max_depth=6)
    for round_args in [([3, 4, 5, 6], 1, 4, -1), ([9, 8, 7, 6], 2, 0, -1), ([1, 1, 1, 1], 3, 9, -1)]:
        assert run_round(drafter, chain, round_args) == expected_round(*round_args[:3], 6)
    assert drafter.calls.count("finalize") == 2  # warm-up and capture: the replays call no Python


@needs_device_launch
def test_a_chain_closed_during_another_capture_is_destroyed_after_it():
    """Destroying a chain synchronises the device, which would invalidate a capture under way (a chain garbage
    collected inside a later capture): it is deferred to the next chain built, and both the capture and the later
    chain work."""
    from peagle.decode.harness import graphs

    _drafter, chain = make("device", max_depth=3)
    other = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(other):
        x.add_(1)
        chain.close()
    assert graphs._pending_destroy == [chain._chain]
    other.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4
    drafter2, chain2 = make("device", max_depth=3)
    assert graphs._pending_destroy == []
    with pytest.raises(RuntimeError, match="graph_chain_destroy"):  # already destroyed
        torch.ops.peagle.graph_chain_destroy(chain._chain)
    drafter2.start_round([1, 2, 3, 4], 5, stop_after=2)
    chain2.run()
    chain2.check()
    assert chain2.transitions() == 2 and int(drafter2.finalized) == 1  # depths 0 and 1, then finalize
    chain2.close()
