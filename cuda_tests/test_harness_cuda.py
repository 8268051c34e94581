"""harness_decide on CUDA equals the CPU op bit for bit (random inputs, padding, stopped requests, ties, batches
wider than one block), writes only into its arguments (no host synchronisation: it runs inside a captured CUDA
graph), and rejects tensors on two devices. harness_pass_decide on CUDA equals the CPU op bit for bit (chains and
trees, batches over several blocks) without a host synchronisation. harness_observe on CUDA equals the CPU op bit for
bit (every row, rows in random order, no rows; int64 and int32 accepted counts; batches over several blocks) without a
host synchronisation, inside a captured CUDA graph too, and rejects tensors on two devices. harness_edge_scores and
harness_edge_observe on CUDA equal the CPU ops bit for bit (chains and trees, padding, every row, rows in random order,
no rows, batches over several blocks) without a host synchronisation, inside a captured CUDA graph too."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401
from peagle.decode.harness.budget import CALIBRATION_DECAY, SHARPNESS_RANGE
from peagle.ops import (
    HarnessState,
    harness_decide,
    harness_edge_observe,
    harness_edge_scores,
    harness_observe,
    harness_pass_decide,
)
from testkit import random_edge_case, random_observe_case, random_pass_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_case(generator: torch.Generator, batch: int, frontier: int, max_nodes: int):
    scores = torch.rand(batch, frontier, generator=generator, dtype=torch.float64) ** 2
    scores[torch.rand(batch, frontier, generator=generator) < 0.2] = -torch.inf
    scores[:, 1] = scores[:, 0]  # ties
    calibration = torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 10
    widths = torch.tensor([1, 2, 3, 5, 8])
    draft_cost = torch.rand(5, generator=generator, dtype=torch.float64).sort().values * 0.01
    verify_cost = 0.02 + torch.rand(max_nodes + 1, generator=generator, dtype=torch.float64).cumsum(0) * 0.002
    state = HarnessState.start(batch, "cpu")
    state.expected.copy_(torch.rand(batch, generator=generator, dtype=torch.float64) * 3)
    state.draft_time.copy_(torch.rand(batch, generator=generator, dtype=torch.float64) * 0.01)
    state.num_nodes.copy_(torch.randint(1, max_nodes + 1, (batch,), generator=generator))
    state.stop.copy_((torch.rand(batch, generator=generator) < 0.2).int())
    return (scores, calibration, widths, draft_cost, verify_cost), state


@pytest.mark.parametrize("batch,frontier", [(1, 4), (37, 16), (1000, 24)])
def test_harness_decide_on_cuda_equals_cpu(generator, batch, frontier):
    for _ in range(5):
        inputs, state = random_case(generator, batch, frontier, 40)
        cuda_state = HarnessState(*(t.cuda() for t in state))
        harness_decide(*inputs, state)
        harness_decide(*(t.cuda() for t in inputs), cuda_state)
        for name, a, e in zip(HarnessState._fields, cuda_state, state, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), e), name


def test_harness_decide_is_graph_capturable(generator):
    inputs, state = random_case(generator, 8, 6, 20)
    inputs = tuple(t.cuda() for t in inputs)
    live = HarnessState(*(t.cuda() for t in state))
    start = HarnessState(*(t.clone() for t in live))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        harness_decide(*inputs, HarnessState(*(t.clone() for t in start)))  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            harness_decide(*inputs, live)
    for t, s in zip(live, start, strict=True):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    harness_decide(*(t.cpu() for t in inputs), state)
    for name, a, e in zip(HarnessState._fields, live, state, strict=True):
        assert torch.equal(a.cpu(), e), name


def test_harness_decide_device_mismatch(generator):
    inputs, state = random_case(generator, 2, 3, 6)
    cuda_state = HarnessState(*(t.cuda() for t in state))
    with pytest.raises(RuntimeError, match="calibration must be on the same device as frontier_scores"):
        harness_decide(inputs[0].cuda(), *inputs[1:], cuda_state)


@pytest.mark.parametrize("batch", [1, 37, 300])
def test_harness_pass_decide_on_cuda_equals_cpu(generator, batch):
    for _ in range(10):
        args = random_pass_case(generator, batch, 40)
        want = harness_pass_decide(*args)
        cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = harness_pass_decide(*cuda_args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for name, a, e in zip(("budget", "next_depth", "predicted"), got, want, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), e), name


def cuda_args(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("batch,rows", [(1, "all"), (37, "subset"), (300, "all"), (300, "subset"), (5, "none")])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_harness_observe_on_cuda_equals_cpu(generator, batch, rows, dtype):
    for _ in range(10):
        calibration, gamma, *inputs = random_observe_case(generator, batch, rows, dtype)
        state, device_inputs = (calibration.cuda(), gamma.cuda()), cuda_args(inputs)
        torch.cuda.set_sync_debug_mode("error")  # around the op alone: the host-to-device copies synchronise
        try:
            harness_observe(*state, *device_inputs, CALIBRATION_DECAY, SHARPNESS_RANGE)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        harness_observe(calibration, gamma, *inputs, CALIBRATION_DECAY, SHARPNESS_RANGE)
        for name, a, e in zip(("calibration", "gamma"), state, (calibration, gamma), strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), e), name


def test_harness_observe_is_graph_capturable(generator):
    calibration, gamma, *inputs = random_observe_case(generator, 12, "subset", torch.int64)
    live, start = (calibration.cuda(), gamma.cuda()), (calibration.cuda(), gamma.cuda())
    inputs = cuda_args(inputs)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        harness_observe(*(t.clone() for t in start), *inputs, CALIBRATION_DECAY, SHARPNESS_RANGE)  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            harness_observe(*live, *inputs, CALIBRATION_DECAY, SHARPNESS_RANGE)
    for _ in range(3):  # three rounds: each replay folds the round in again
        graph.replay()
        harness_observe(calibration, gamma, *(t.cpu() if t is not None else t for t in inputs), CALIBRATION_DECAY,
                        SHARPNESS_RANGE)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(live[0].cpu(), calibration) and torch.equal(live[1].cpu(), gamma)


def test_harness_observe_device_mismatch(generator):
    calibration, gamma, predicted, accepted, rows = random_observe_case(generator, 4, "subset", torch.int64)
    with pytest.raises(RuntimeError, match="predicted must be on the same device as calibration"):
        harness_observe(calibration.cuda(), gamma.cuda(), predicted, accepted.cuda(), rows.cuda(), 0.9, (0.02, 1.5))
    with pytest.raises(RuntimeError, match="rows must be on the same device as calibration"):
        harness_observe(calibration.cuda(), gamma.cuda(), predicted.cuda(), accepted.cuda(), rows, 0.9, (0.02, 1.5))


@pytest.mark.parametrize("batch,rows", [(1, "all"), (37, "subset"), (300, "all"), (300, "subset"), (5, "none")])
def test_harness_edge_ops_on_cuda_equal_cpu(generator, batch, rows):
    for _ in range(10):
        case = random_edge_case(generator, batch, rows)
        on_device = cuda_args(case)
        torch.cuda.set_sync_debug_mode("error")
        try:
            path, q, kind = harness_edge_scores(*on_device[:6])
            table, calibration = on_device[3], on_device[8]
            harness_edge_observe(
                table, calibration, q, kind, path, on_device[1], *on_device[6:8], on_device[9], 0.99, 0.5
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cpu = harness_edge_scores(*case[:6])
        for name, a, e in zip(("path", "q", "kind"), (path, q, kind), cpu, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), e), name
        harness_edge_observe(case.table, case.calibration, *cpu[1:], cpu[0], case.parent, case.accepted_path,
                             case.num_accepted, case.rows, 0.99, 0.5)  # fmt: skip
        assert torch.equal(table.cpu(), case.table) and torch.equal(calibration.cpu(), case.calibration)


def test_harness_edge_ops_are_graph_capturable(generator):
    case = random_edge_case(generator, 6, "subset")
    on_device = cuda_args(case)
    live_table, live_calibration = on_device[3].clone(), on_device[8].clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()

    def round_(table, calibration):
        path, q, kind = harness_edge_scores(on_device[0], on_device[1], on_device[2], table, *on_device[4:6])
        harness_edge_observe(table, calibration, q, kind, path, on_device[1], *on_device[6:8], on_device[9], 0.99, 0.5)

    with torch.cuda.stream(stream):
        round_(live_table.clone(), live_calibration.clone())  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            round_(live_table, live_calibration)
    table, calibration = case.table.clone(), case.calibration.clone()
    for _ in range(3):  # three rounds: each replay scores with the table the last one left
        graph.replay()
        path, q, kind = harness_edge_scores(
            case.scores, case.parent, case.num_nodes, table, case.prior, case.thresholds
        )
        harness_edge_observe(table, calibration, q, kind, path, case.parent, case.accepted_path, case.num_accepted,
                             case.rows, 0.99, 0.5)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(live_table.cpu(), table) and torch.equal(live_calibration.cpu(), calibration)
