"""Depth-to-depth transition cost of the graph chain (peagle.decode.harness.graphs) on a GPU, against host-launched
per-depth graphs, ratios measured in one run (issue 14 goal: <= 10 us per transition in the chain).

    python -m pytest benchmarks/bench_graph_chain.py -q -s      # pytest-benchmark; numbers in extra_info (CUDA only)
    python benchmarks/bench_graph_chain.py                       # prints a markdown table
    (cuda_tests/run_gpu.sh runs it with the other GPU benchmarks: `pytest benchmarks -k cuda`.)

Case: a round of 32 depths whose every depth is the same three tiny kernels (count the depth, compare it with the
round's limit, write go), so a round's time is almost all transitions. Timed per round, synchronised:

* ``peagle`` (device chain): one host launch; each depth's last kernel tail-launches the next depth's graph.
* ``host graphs, go read``: the same per-depth graphs launched from the host, which reads go after each depth (the
  host loop that makes the same decisions; a synchronisation per depth).
* ``host graphs, no go read``: the per-depth graphs launched back to back without reading go (no decisions: the host
  launch floor, not a working alternative).
* ``one graph``: all 32 depths captured into one graph (no transitions and no decisions: the kernels' own time).

Transition cost = (round time - one graph's round time) / 32.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from common import cuda_round_time

from peagle.decode.harness.graphs import DepthGraphChain, device_launch_available

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
DEPTHS = 32
ROUNDS = 20 if SMOKE else 300
GOAL_US = 10.0


class CountingRound:
    """Depth steps that count on the device and keep go = 1 until the last depth: every round runs all DEPTHS."""

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.int32, device="cuda")
        self.limit = torch.full((), DEPTHS, dtype=torch.int32, device="cuda")
        self.go = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step(self) -> None:
        self.count.add_(1)
        self.go.copy_((self.count < self.limit).to(torch.int32).reshape(1))

    def finalize(self) -> None:
        self.count.zero_()


def capture(steps: list[Callable[[], None]]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    return graph


class Runs:
    """The same 32-depth round run four ways (see the module docstring), on one CountingRound."""

    def __init__(self) -> None:
        work = CountingRound()
        steps = [work.step] * DEPTHS
        self.chain = DepthGraphChain(steps, work.finalize, work.go, mode="device")
        host = DepthGraphChain(steps, work.finalize, work.go, mode="host_graphs")
        per_depth = [capture([step]) for step in [*steps, work.finalize]]
        self.baselines: dict[str, Callable[[], None]] = {
            "host graphs, go read": host.run,
            "host graphs, no go read": lambda: [graph.replay() for graph in per_depth],
            "one graph": capture([*steps, work.finalize]).replay,
        }

    def check_chain(self, rounds: int) -> None:
        self.chain.check()
        assert self.chain.transitions() == DEPTHS * rounds, "the device chain skipped or repeated depths"


def transition_us(times: dict[str, float], name: str) -> float:
    return (times[name] - times["one graph"]) / DEPTHS * 1e6


@pytest.mark.skipif(
    not torch.cuda.is_available() or not device_launch_available("cuda"), reason="needs CUDA with device graph launch"
)
def test_cuda_graph_chain_transition(benchmark):
    runs = Runs()
    times = {name: cuda_round_time(run, ROUNDS, warmup=3) for name, run in runs.baselines.items()}
    benchmark.pedantic(lambda: (runs.chain.run(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=3)
    runs.check_chain(ROUNDS + 3)
    times["peagle"] = benchmark.stats.stats.mean
    chain_us, host_us = transition_us(times, "peagle"), transition_us(times, "host graphs, go read")
    benchmark.extra_info.update(
        impl="peagle",
        case=f"cuda graph chain, {DEPTHS} depths per round",
        baselines={name: times[name] for name in runs.baselines},
        transition_us=chain_us,
        host_transition_us=host_us,
        host_over_chain=host_us / chain_us if chain_us > 0 else float("inf"),
        goal_us=GOAL_US,
    )
    print(table(times))


def table(times: dict[str, float]) -> str:
    lines = [
        f"{DEPTHS} depths per round, {ROUNDS} rounds",
        "| run | us per round | us per transition |",
        "|---|---|---|",
    ]
    for name, seconds in sorted(times.items(), key=lambda item: item[1]):
        per = "-" if name == "one graph" else f"{transition_us(times, name):.2f}"
        lines.append(f"| {name} | {seconds * 1e6:.1f} | {per} |")
    ratio = transition_us(times, "host graphs, go read") / max(transition_us(times, "peagle"), 1e-9)
    lines.append(
        f"chain transition {transition_us(times, 'peagle'):.2f} us (goal <= {GOAL_US:.0f} us); host loop "
        f"with go reads {ratio:.1f}x that"
    )
    return "\n".join(lines)


def main() -> None:
    if not torch.cuda.is_available() or not device_launch_available("cuda"):
        raise SystemExit("needs a CUDA device and a peagle build with device graph launch")
    runs = Runs()
    times = {"peagle": cuda_round_time(runs.chain.run, ROUNDS, warmup=3)}
    runs.check_chain(ROUNDS + 3)
    times.update({name: cuda_round_time(run, ROUNDS, warmup=3) for name, run in runs.baselines.items()})
    print(table(times))


if __name__ == "__main__":
    main()
